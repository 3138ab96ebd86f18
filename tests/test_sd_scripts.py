"""sd-scripts' attention routed through the engine (``lib_attn.integrations.sd_scripts``), against sd-scripts'
own functions: outputs and every gradient equal within 1e-5 relative in fp32 (1e-2 under bf16 autocast), two
training steps, with gradient checkpointing; every call counted; nothing left patched after ``undo``.

sd-scripts' ``library`` is its double (tests/doubles/sd_scripts, written from sd-scripts at 48d368fa)."""
from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import lib_attn
from lib_attn.integrations import sd_scripts
from tests.engine_helpers import rel_err

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOUBLE = os.path.join(ROOT, "tests", "doubles", "sd_scripts")


def _drop_library():
    for name in [n for n in sys.modules if n == "library" or n.startswith("library.")]:
        del sys.modules[name]


@pytest.fixture
def library():
    _drop_library()
    sys.path.insert(0, DOUBLE)
    lib_attn.reset()
    try:
        import library.attention
        import library.flux_models
        import library.original_unet
        import library.sd3_models
        import library.sdxl_original_unet  # noqa: F401
        yield library
    finally:
        sys.path.remove(DOUBLE)
        _drop_library()
        lib_attn.reset()


def steps(model_fn, params, inputs, n=2, autocast=False, lr=1e-2):
    """``n`` SGD steps of ``loss = model_fn(*inputs).pow(2).mean()``: every output and gradient on the way."""
    params = [p.detach().clone().requires_grad_() for p in params]
    outs, grads = [], []
    for _ in range(n):
        for p in params:
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model_fn(params, *inputs)
        out.float().pow(2).mean().backward()
        outs.append(out.detach().float())
        grads.append([p.grad.clone() for p in params])
        with torch.no_grad():
            for p in params:
                p -= lr * p.grad
    return outs, grads


def assert_same(got, want, tol):
    for step, (a, b) in enumerate(zip(got[0], want[0])):
        assert rel_err(a, b) < tol, ("output", step, rel_err(a, b))
    for step, (ga, gb) in enumerate(zip(got[1], want[1])):
        for i, (a, b) in enumerate(zip(ga, gb)):
            assert rel_err(a, b) < tol, ("grad", step, i, rel_err(a, b))


def compare(run, params, inputs, tol, **kw):
    """``run`` unrouted, then routed: the same outputs and gradients, and the routed calls counted."""
    want = steps(run, params, inputs, **kw)
    routing = sd_scripts.route()
    try:
        got = steps(run, params, inputs, **kw)
        calls = sum(routing.recording.calls.values())
    finally:
        routing.undo(report=False)
    assert_same(got, want, tol)
    return calls, routing


# --- Flux (and Chroma) -------------------------------------------------------------------------------

def flux_block(library, heads=2, dim=32, ckpt=False, masked=True, chroma=False):
    """A tiny double-stream step: text then image tokens, rotary positions, the T5 mask as sd-scripts builds it."""
    torch.manual_seed(0)
    b, txt, img, d = 2, 6, 10, dim // heads
    params = [torch.randn(dim, 3 * dim) * 0.2, torch.randn(dim, dim) * 0.2]
    x = torch.randn(b, txt + img, dim)
    pos = torch.arange(txt + img, dtype=torch.float64)[None, :, None].expand(b, -1, 1)
    pe = library.flux_models.rope(pos[..., 0], d, 10000)[:, None]
    t5 = torch.ones(b, txt, dtype=torch.long)
    t5[0, 4:] = 0
    t5[1, 2:] = 0

    def body(params, x):
        w_qkv, w_out = params
        qkv = (x @ w_qkv).reshape(b, txt + img, 3, heads, d).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        mask = library.flux_models.t5_attn_mask(t5, img, heads, txt + img) if masked else None
        if chroma:
            attn = library.chroma_models.call_attention(q, k, v, pe, attn_mask=mask)
        else:
            attn = library.flux_models.attention(q, k, v, pe=pe, attn_mask=mask)
        return x + attn @ w_out

    def run(params, x):
        h = x
        for _ in range(2):  # two blocks, same weights
            h = checkpoint(body, params, h, use_reentrant=False) if ckpt else body(params, h)
        return h

    return run, params, (x,)


@pytest.mark.parametrize("masked", [False, True], ids=["no mask", "t5 mask"])
@pytest.mark.parametrize("ckpt", [False, True], ids=["", "checkpointing"])
def test_flux_attention_trains_as_sd_scripts(library, masked, ckpt):
    run, params, inputs = flux_block(library, ckpt=ckpt, masked=masked)
    calls, routing = compare(run, params, inputs, 1e-5)
    assert calls == 2 * 2 * (2 if ckpt else 1)  # every call: 2 steps x 2 blocks, recomputed ones too
    assert sum(routing.recording.recomputed.values()) == (4 if ckpt else 0)


def test_flux_under_bf16_autocast(library):
    run, params, inputs = flux_block(library, ckpt=True)
    compare(run, params, inputs, 1e-2, autocast=True)


def test_the_t5_mask_reaches_the_engine_as_key_padding(library, monkeypatch):
    seen = []
    real = sd_scripts._engine
    monkeypatch.setattr(sd_scripts, "_engine", lambda *a, **kw: seen.append(kw.get("mask")) or real(*a, **kw))
    run, params, inputs = flux_block(library)
    with sd_scripts.route(report_every=None) as routing:
        run(params, *inputs)
        report = routing.report()
    assert seen and all(m.shape == (2, 1, 1, 16) and m.dtype == torch.bool for m in seen)
    q = torch.randn(2, 2, 16, 16, dtype=torch.float16)
    assert lib_attn.explain(q, q, q, mask=seen[0], role="dit").spec.mask == "key-padding"
    assert report.total("dit") == 2


def test_chroma_imports_the_routed_attention_by_name(library):
    flux, params, inputs = flux_block(library)
    want = steps(flux, params, inputs)  # sd-scripts' Chroma calls Flux's own function
    run, params, inputs = flux_block(library, chroma=True)
    routing = sd_scripts.route()
    try:
        import library.chroma_models  # loaded while routed: the import hook routes its name too
        got = steps(run, params, inputs)
        assert sum(routing.recording.calls.values()) == 4
    finally:
        routing.undo(report=False)
    assert_same(got, want, 1e-5)
    assert not hasattr(library.chroma_models.attention, sd_scripts.ORIGINAL)


# --- SD1 / SDXL CrossAttention -----------------------------------------------------------------------------

PATHS = {"sdpa": dict(sdpa=True), "default": dict(), "default upcast": dict(upcast=True), "xformers": dict(xformers=True)}


@pytest.mark.parametrize("unet", ["original_unet", "sdxl_original_unet"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_cross_attention_paths(library, unet, path, autocast):
    opts = PATHS[path]
    torch.manual_seed(0)
    module = getattr(library, unet).CrossAttention(32, 32, heads=2, dim_head=16, upcast_attention=opts.get("upcast", False))
    module.set_use_sdpa(opts.get("sdpa", False))
    module.set_use_memory_efficient_attention(opts.get("xformers", False), False)
    names = [n for n, _ in module.named_parameters()]
    x, ctx = torch.randn(2, 20, 32), torch.randn(2, 7, 32)

    def run(params, x, ctx):
        m = copy.copy(module)
        m._parameters, m._modules = {}, {k: copy.copy(v) for k, v in module._modules.items()}
        m._modules["to_out"] = torch.nn.ModuleList([copy.copy(module.to_out[0])])
        for name, p in zip(names, params):
            owner, attr = m, name
            *path_, attr = name.split(".")
            for part in path_:
                owner = owner[int(part)] if part.isdigit() else getattr(owner, part)
            owner._parameters = dict(owner._parameters)
            owner._parameters[attr] = p
        return m(x, ctx) + m(x)  # cross- and self-attention

    calls, _ = compare(run, [p.detach() for p in module.parameters()], (x, ctx), 1e-2 if autocast else 1e-5,
                       autocast=autocast)
    assert calls == 4


def test_cross_attention_calls_lora_replaced_forwards_and_the_processor_first(library):
    module = library.original_unet.CrossAttention(32, heads=2, dim_head=16)
    module.set_use_sdpa(True)
    called = []
    for name in ("to_q", "to_k", "to_v"):
        layer = getattr(module, name)
        layer.forward = (lambda base: lambda t: called.append(1) or base(t) * 1.5)(layer.forward)
    x = torch.randn(1, 8, 32)
    want = module(x)
    with sd_scripts.route(report_every=None) as routing:
        got = module(x)
        assert len(called) == 6 and routing.report().total("unet") == 1
        module.processor = lambda attn, hidden_states, **kw: hidden_states * 0 + 7
        assert float(module(x).mean()) == 7  # the processor hook runs first, as in sd-scripts
    assert rel_err(got, want) < 1e-5


# --- library/attention.py (HunyuanImage, Anima) --------------------------------------------------------------

def unified_case(library, mode, split, lengths, as_list=True, by_name=False):
    torch.manual_seed(0)
    b, img, txt, h, d = len(lengths), 6, 5, 2, 8
    params = [torch.randn(16, 3 * h * d) * 0.3]
    x = torch.randn(b, img + txt, 16)
    text_mask = torch.zeros(b, txt, dtype=torch.long)
    for i, n in enumerate(lengths):
        text_mask[i, :n] = 1

    def run(params, x):
        qkv = (x @ params[0]).reshape(b, img + txt, 3, h, d)
        ap = library.attention.AttentionParams.create_attention_params_from_mask(mode, split, img, text_mask)
        args = [qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]]
        if by_name:
            import library.hunyuan_image_modules as hy
            return hy.call_attention(args, ap)
        return library.attention.attention(args if as_list else args[0], *([] if as_list else args[1:]), attn_params=ap)

    valid = torch.zeros(b, img + txt, 1, dtype=torch.bool)
    for i, n in enumerate(lengths):
        valid[i, :img + n] = True
    return run, params, (x,), valid


@pytest.mark.parametrize("split", [False, True], ids=["batched", "split_attn"])
@pytest.mark.parametrize("lengths", [(3, 5), (4, 4)], ids=["varlen", "equal lengths"])
def test_unified_attention_torch_mode(library, split, lengths):
    run, params, inputs, _ = unified_case(library, "torch", split, lengths)
    calls, _ = compare(run, params, inputs, 1e-5)
    assert calls == 2 * (len(lengths) if split else 1)


@pytest.mark.parametrize("split", [False, True], ids=["varlen", "split_attn"])
def test_unified_attention_flash_mode_equals_on_valid_rows(library, split):
    run, params, inputs, valid = unified_case(library, "flash", split, (3, 5))
    masked = lambda p, x: run(p, x) * valid  # noqa: E731 - the loss sees the valid rows only
    compare(masked, params, inputs, 1e-5)
    torch_run, *_ = unified_case(library, "torch", split, (3, 5))
    with sd_scripts.route(report_every=None):
        routed_flash, routed_torch = run(params, *inputs), torch_run(params, *inputs)
    # The padding rows, which no valid token attends to, are the torch mode's.
    assert rel_err(routed_flash, routed_torch) < 1e-6


def test_unified_attention_clears_the_list_and_serves_hunyuan_by_name(library):
    q = torch.randn(1, 6, 2, 8)
    args = [q, q.clone(), q.clone()]
    with sd_scripts.route(report_every=None) as routing:
        out = library.attention.attention(args)
        assert args == [] and out.shape == (1, 6, 16)
        run, params, inputs, _ = unified_case(library, "torch", False, (3, 5), by_name=True)
        run(params, *inputs)
        assert routing.report().total("dit") == 2


def test_unified_attention_dropout_runs_sd_scripts_own_code_counted(library):
    q = torch.randn(1, 6, 2, 8)
    with sd_scripts.route(report_every=None) as routing:
        library.attention.attention(q, q, q, drop_rate=0.1)
        report = routing.report()
    assert report.fallbacks == {("dit", sd_scripts.PASSED_OVER, "attention dropout"): 1}
    assert report.total() == 0


# --- SD3 ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["torch", "xformers"])
def test_sd3_attention(library, mode):
    torch.manual_seed(0)
    b, n, ctx, h, d = 2, 12, 5, 2, 8
    params = [torch.randn(16, 3 * h * d) * 0.3, torch.randn(16, 3 * h * d) * 0.3]
    x, c = torch.randn(b, n, 16), torch.randn(b, ctx, 16)

    def run(params, x, c):
        # joint attention (context first), then SD3.5's extra self-attention on x alone
        qx, kx, vx = (x @ params[0]).chunk(3, dim=-1)
        qc, kc, vc = (c @ params[1]).chunk(3, dim=-1)
        joint = library.sd3_models.attention(torch.cat([qc, qx], 1), torch.cat([kc, kx], 1).double(),
                                             torch.cat([vc, vx], 1), d, mode=mode)
        extra = library.sd3_models.attention(qx, kx, vx, d, mode=mode)
        return joint[:, ctx:] + extra

    calls, _ = compare(run, params, (x, c), 1e-5)
    assert calls == 4


# --- undo, the report, the launcher ------------------------------------------------------------------------------

def _bindings(library):
    return {
        "flux": library.flux_models.attention, "unified": library.attention.attention,
        "sd3": library.sd3_models.attention,
        "sd1": library.original_unet.CrossAttention.__dict__["forward"],
        "sdxl": library.sdxl_original_unet.CrossAttention.__dict__["forward"],
    }


def test_undo_leaves_nothing_patched(library):
    st = pytest.importorskip("safetensors.torch")

    before, save_file, hooks = _bindings(library), st.save_file, list(sys.meta_path)
    routing = sd_scripts.route()
    routed = _bindings(library)
    assert all(hasattr(f, sd_scripts.ORIGINAL) and routed[k] is not before[k] for k, f in routed.items())
    kept = routed["flux"]  # as a module that imported the routed function by name would keep it
    routing.undo(report=False)
    routing.undo(report=False)  # twice is once
    assert _bindings(library) == before and st.save_file is save_file and sys.meta_path == hooks
    q = torch.randn(1, 2, 8, 16)
    pe = library.flux_models.rope(torch.arange(8, dtype=torch.float64)[None], 16, 10000)[:, None]
    with lib_attn.recording() as rec:
        assert torch.equal(kept(q, q, q, pe), before["flux"](q, q, q, pe))
    assert rec.total() == 0  # sd-scripts' own code ran


def test_report_goes_to_the_log_and_into_saved_metadata(library, tmp_path, caplog):
    st = pytest.importorskip("safetensors.torch")
    from safetensors import safe_open

    run, params, inputs = flux_block(library, ckpt=True)
    caplog.set_level(logging.INFO, logger="lib_attn")
    routing = sd_scripts.route(report_every=0.05)
    try:
        steps(run, params, inputs)
        import time
        time.sleep(0.3)
        st.save_file({"w": torch.zeros(2)}, str(tmp_path / "lora.safetensors"), {"ss_network_dim": "4"})
        st.save_file({"w": torch.zeros(2)}, str(tmp_path / "other.safetensors"), {"format": "pt"})
    finally:
        routing.undo()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention")]
    assert len(lines) >= 2 and lines[-1].startswith("attention at the end: dit: ")
    assert "4 forward + 4 recomputed" in lines[-1]
    with safe_open(str(tmp_path / "lora.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["ss_network_dim"] == "4"
    report = lib_attn.Report.from_dict(json.loads(meta[sd_scripts.METADATA_KEY]))
    assert report.total("dit") == 8 and sum(report.recomputed.values()) == 4
    with safe_open(str(tmp_path / "other.safetensors"), "pt") as f:
        assert sd_scripts.METADATA_KEY not in f.metadata()


TRAINER = """
import sys, torch
from safetensors.torch import save_file
from torch.utils.checkpoint import checkpoint
import library.flux_models as fm
from library import train_util

args = train_util.parse(sys.argv[1:])
if args.console_log_file:  # as sd-scripts' setup_logging does with --console_log_file
    import logging
    logging.basicConfig(filename=args.console_log_file, level=logging.INFO)
torch.manual_seed(0)
w = torch.nn.Parameter(torch.randn(16, 48) * 0.2)
opt = torch.optim.SGD([w], lr=0.01)
pe = fm.rope(torch.arange(12, dtype=torch.float64)[None].expand(2, -1), 8, 10000)[:, None]
x = torch.randn(2, 12, 16)
mask = torch.ones(2, 4, dtype=torch.long)
mask[1, 2:] = 0
def block(x):
    q, k, v = (x @ w).reshape(2, 12, 3, 2, 8).permute(2, 0, 3, 1, 4)
    return x + fm.attention(q, k, v, pe=pe, attn_mask=fm.t5_attn_mask(mask, 8, 2, 12))
for step in range(args.steps):
    opt.zero_grad()
    checkpoint(block, x, use_reentrant=False).pow(2).mean().backward()
    opt.step()
save_file({"w": w.detach()}, args.out, {"ss_network_module": "networks.lora", "ss_steps": str(args.steps)})
print("trained", w.grad is not None)
"""

TRAIN_UTIL = """
import argparse
def parse(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int)
    p.add_argument("--out")
    p.add_argument("--console_log_file")
    return p.parse_args(argv)
"""


def test_the_launcher_runs_a_trainer_routed(tmp_path):
    """``python -m lib_attn.integrations.sd_scripts [engine options] trainer.py [its options]`` in a fresh
    process, as ``accelerate launch -m`` runs it: the trainer's own argv, its directory on sys.path first."""
    pytest.importorskip("safetensors")
    tree = tmp_path / "sd-scripts"
    (tree / "library").mkdir(parents=True)
    for name in ("__init__.py", "flux_models.py"):
        (tree / "library" / name).write_text(open(os.path.join(DOUBLE, "library", name)).read())
    (tree / "library" / "train_util.py").write_text(textwrap.dedent(TRAIN_UTIL))
    (tree / "tiny_train_network.py").write_text(textwrap.dedent(TRAINER))
    out = tmp_path / "lora.safetensors"
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-m", "lib_attn.integrations.sd_scripts", "--attn-backend", "math,sdpa",
                           "--report-every", "0", str(tree / "tiny_train_network.py"), "--steps", "3",
                           "--out", str(out)], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "trained True" in proc.stdout
    assert "attention at the end: dit: math" in proc.stderr and "3 forward + 3 recomputed" in proc.stderr
    # A trainer that sets up its log gets the report there, not on stderr.
    train_log = tmp_path / "train.log"
    proc = subprocess.run([sys.executable, "-m", "lib_attn.integrations.sd_scripts", "--report-every", "0",
                           str(tree / "tiny_train_network.py"), "--steps", "1", "--out", str(tmp_path / "b.safetensors"),
                           "--console_log_file", str(train_log)], cwd=str(tmp_path), env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "attention at the end: dit:" in train_log.read_text() and "attention at the end" not in proc.stderr
    from safetensors import safe_open
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    report = json.loads(meta[sd_scripts.METADATA_KEY])
    assert meta["ss_steps"] == "3" and report["calls"][0]["backend"] == "math" and report["calls"][0]["count"] == 6
    assert report["recomputed"] == [{"role": "dit", "backend": "math", "count": 3}]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_ddp_routes_on_every_rank_without_a_collective():
    """Two real ranks on gloo: each routes its own calls, trains as sd-scripts' own attention does, the ranks
    stay in step (DDP's reducer is untouched) and the routing calls no torch.distributed function."""
    from lib_attn.parallel import launch

    ranks = launch.run_ranks(2, [os.path.join(ROOT, "tests", "sd_scripts_ddp_case.py")], timeout=180)
    for r in ranks:
        assert r["returncode"] == 0 and r["result"], r["output"]
        res = r["result"]
        assert res["err"] < 1e-5 and res["ranks_agree"], res
        assert res["calls"] == 8 and res["recomputed"] == 4 and res["collectives"] == 0, res
