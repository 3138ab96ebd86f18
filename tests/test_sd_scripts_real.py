"""sd-scripts' own modules routed through the engine, where an sd-scripts tree can be imported: set
``LIB_ATTN_SD_SCRIPTS`` to its folder (seen at 48d368fa; its ``library`` must import, so sd-scripts'
requirements are needed). Skipped otherwise (CI: tests/test_sd_scripts.py runs the same cases on its double).

Two training steps of Flux's double and single blocks (with and without the T5 mask, with gradient
checkpointing, under bf16 autocast), SD1 and SDXL CrossAttention (sdpa, default and upcast paths),
``library.attention`` with a varlen mask (torch mode) and SD3's MMDiT block with SD3.5's extra
self-attention: outputs and every gradient equal sd-scripts' own within 1e-5 relative in fp32 (1e-2
under bf16), every call counted, the recomputed ones apart."""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

import lib_attn
from lib_attn.integrations import sd_scripts

TREE = os.environ.get("LIB_ATTN_SD_SCRIPTS", "")
pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(TREE, "library", "flux_models.py")),
                                reason="LIB_ATTN_SD_SCRIPTS names no sd-scripts tree")


@pytest.fixture(scope="module")
def library():
    saved = {n: m for n, m in sys.modules.items() if n == "library" or n.startswith("library.")}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, TREE)
    try:
        import library.attention
        import library.flux_models
        import library.original_unet
        import library.sd3_models
        import library.sdxl_original_unet  # noqa: F401
        yield library
    finally:
        sys.path.remove(TREE)
        for name in [n for n in sys.modules if n == "library" or n.startswith("library.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def two_steps(model, fn, autocast):
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    out = []
    for _ in range(2):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = fn(m)
        y.float().pow(2).mean().backward()
        out.append((y.detach().float(), [p.grad.clone() for p in m.parameters() if p.grad is not None]))
        opt.step()
    return out


def compare(model, fn, autocast=False):
    lib_attn.reset()
    want = two_steps(model, fn, autocast)
    routing = sd_scripts.route()
    try:
        got = two_steps(model, fn, autocast)
        calls, again = sum(routing.recording.calls.values()), sum(routing.recording.recomputed.values())
    finally:
        routing.undo(report=False)
    tol = 1e-2 if autocast else 1e-5
    for (y, grads), (y0, grads0) in zip(got, want):
        assert len(grads) == len(grads0) > 0 and rel(y, y0) < tol
        for g, g0 in zip(grads, grads0):
            assert rel(g, g0) < tol
    return calls, again


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
def test_flux_blocks(library, ckpt, masked, autocast):
    fm = library.flux_models
    torch.manual_seed(0)
    hidden, b, txt, img = 64, 2, 5, 12
    ids = torch.zeros(b, txt + img, 3)
    ids[:, txt:, 1] = torch.arange(img) // 4
    ids[:, txt:, 2] = torch.arange(img) % 4
    pe = fm.EmbedND(hidden, 10000, [8, 12, 12])(ids)
    t5 = torch.ones(b, txt, dtype=torch.long)
    t5[1, 2:] = 0
    model = torch.nn.ModuleList([fm.DoubleStreamBlock(hidden, 2, 2.0), fm.SingleStreamBlock(hidden, 2, 2.0)]).train()
    if ckpt:
        for blk in model:
            blk.enable_gradient_checkpointing()
    img_x, txt_x, vec = torch.randn(b, img, hidden), torch.randn(b, txt, hidden), torch.randn(b, hidden)

    def fn(m):
        image, text = m[0](img_x, txt_x, vec, pe, t5 if masked else None)
        return m[1](torch.cat([text, image], 1), vec, pe, t5 if masked else None)

    assert compare(model, fn, autocast) == ((8, 4) if ckpt else (4, 0))


@pytest.mark.parametrize("unet", ["original_unet", "sdxl_original_unet"])
@pytest.mark.parametrize("path", ["sdpa", "default", "upcast"])
@pytest.mark.parametrize("autocast", [False, True])
def test_cross_attention(library, unet, path, autocast):
    torch.manual_seed(0)
    module = getattr(library, unet).CrossAttention(32, 24, heads=2, dim_head=16, upcast_attention=path == "upcast")
    module.set_use_sdpa(path == "sdpa")
    x, ctx = torch.randn(2, 20, 32), torch.randn(2, 7, 24)
    assert compare(module, lambda m: m(x, ctx), autocast) == (2, 0)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("lengths", [(3, 5), (4, 4)])
def test_unified_attention_torch_mode(library, split, lengths):
    la = library.attention
    torch.manual_seed(0)
    text_mask = torch.zeros(2, 5, dtype=torch.long)
    for i, n in enumerate(lengths):
        text_mask[i, :n] = 1
    x = torch.randn(2, 11, 16)

    def fn(m):
        qkv = m(x).reshape(2, 11, 3, 2, 8)
        params = la.AttentionParams.create_attention_params_from_mask("torch", split, 6, text_mask)
        return la.attention([qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]], attn_params=params)

    assert compare(torch.nn.Linear(16, 48), fn)[0] == (4 if split else 2)


@pytest.mark.parametrize("x_block_self_attn", [False, True])
@pytest.mark.parametrize("ckpt", [False, True])
def test_sd3_mmdit_block(library, x_block_self_attn, ckpt):
    torch.manual_seed(0)
    block = library.sd3_models.MMDiTBlock(64, 4, 2.0, "torch", True, pre_only=False, rmsnorm=False,
                                          scale_mod_only=False, swiglu=False, qk_norm="rms",
                                          x_block_self_attn=x_block_self_attn).train()
    with torch.no_grad():  # the block's tensors are left unset; sd-scripts' MMDiT initialises them
        for p in block.parameters():
            p.normal_(0, 0.05)
    if ckpt:
        block.enable_gradient_checkpointing()
    ctx, x, c = torch.randn(2, 5, 64), torch.randn(2, 12, 64), torch.randn(2, 64)
    calls, again = compare(block, lambda m: torch.cat(m(ctx, x, c), 1))
    per_step = 2 if x_block_self_attn else 1
    assert (calls, again) == (2 * per_step * (2 if ckpt else 1), 2 * per_step if ckpt else 0)
