"""ComfyUI's attention calls as power users' setups make them, against the ComfyUI double: every keyword
an attention function is given (honoured or refused by name), packs that call ComfyUI's function by name
(loaded before or after this package), a guider's second model, the VAE's precision under
``--force-upcast-attention``, batches over ComfyUI's split limit, and the precision cache of rebound names."""
import asyncio
import inspect
import sys

import pytest
import torch

import lib_attn
from tests.doubles.comfy_fixtures import comfy_factory  # noqa: F401
from tests.test_comfy import BACKEND, load_extras, loaded, node, rel_err, sample, unet_patcher
from host_attn import voice


@pytest.fixture(autouse=True)
def fresh_log(monkeypatch):
    monkeypatch.setattr(voice, "_said", set())


def reference(q, k, v, scale=None):
    """Attention in float64 over (b, h, n, d), k and v with h or fewer heads (grouped as SDPA groups them)."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1) @ v


def override_options(role="dit"):
    from comfy_attn import route
    return {"optimized_attention_override": route.make_override(role)}


# --- keywords ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scale", [1.0, 0.05])
@pytest.mark.parametrize("skip_reshape", [False, True])
def test_scale_is_honoured_as_wrap_attn_calls_an_override(comfy_factory, scale, skip_reshape):
    loaded(comfy_factory)
    from comfy.ldm.modules import attention
    torch.manual_seed(0)
    heads, d = 4, 16
    q, k, v = (torch.randn(2, heads, n, d) for n in (12, 10, 10))
    ref = reference(q, k, v, scale)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
    args = (q, k, v) if skip_reshape else (t.transpose(1, 2).reshape(2, -1, heads * d) for t in (q, k, v))
    with lib_attn.recording() as rec:
        out = attention.optimized_attention(*args, heads, skip_reshape=skip_reshape, skip_output_reshape=True,
                                            scale=scale, transformer_options=override_options())
    assert rec.calls == {("dit", "sdpa"): 1}
    assert (out - sdpa).abs().max() <= 1e-4 and rel_err(out, ref) <= 1e-5
    assert (out.double() - reference(q, k, v)).abs().max() > 1e-2          # the scale made a difference


@pytest.mark.parametrize("skip_reshape", [False, True])
def test_enable_gqa_equals_attention_with_grouped_heads(comfy_factory, skip_reshape):
    loaded(comfy_factory)
    from comfy.ldm.modules import attention
    torch.manual_seed(1)
    heads, kv_heads, d = 8, 2, 16
    q = torch.randn(2, heads, 12, d)
    k, v = (torch.randn(2, kv_heads, 10, d) for _ in range(2))
    ref = reference(q, k, v)
    args = (q, k, v) if skip_reshape else (t.transpose(1, 2).flatten(2) for t in (q, k, v))
    with lib_attn.recording() as rec:
        out = attention.optimized_attention(*args, heads, skip_reshape=skip_reshape, skip_output_reshape=True,
                                            enable_gqa=True, transformer_options=override_options())
    assert rec.calls == {("dit", "sdpa"): 1}
    assert out.shape == q.shape and rel_err(out, ref) <= 1e-5
    if "enable_gqa" in torch.nn.functional.scaled_dot_product_attention.__doc__:   # torch 2.5 and later
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        assert (out - sdpa).abs().max() <= 1e-4


def test_enable_gqa_with_heads_that_do_not_group_is_refused_naming_it(comfy_factory):
    loaded(comfy_factory)
    from comfy.ldm.modules import attention
    q, k, v = torch.randn(1, 8, 6, 16), torch.randn(1, 3, 6, 16), torch.randn(1, 3, 6, 16)
    with pytest.raises(ValueError, match=r"enable_gqa=True.*\(8\).*\(3, 3\)"):
        attention.optimized_attention(q, k, v, 8, skip_reshape=True, enable_gqa=True,
                                      transformer_options=override_options())


def test_a_keyword_the_engine_does_not_take_goes_to_comfyuis_function_and_is_named(comfy_factory):
    _, nodes = loaded(comfy_factory)
    from comfy.ldm.modules import attention
    from comfy_attn import route, run
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 12, 64) for _ in range(3))
    own = attention.optimized_attention(q, k, v, 4, window=3)                 # ComfyUI's, without an override
    with lib_attn.recording() as rec:
        out = attention.optimized_attention(q, k, v, 4, window=3, transformer_options=override_options())
    assert not rec.calls and torch.equal(out, own)
    assert any("window" in n and "attention_sub_quad" in n for n in run.current_report().notes)
    with pytest.raises(TypeError, match="'window'"):                          # the engine's function itself
        route.function("dit")(q, k, v, 4, window=3)


@pytest.mark.parametrize("skip_reshape", [False, True])
def test_heads_passed_by_keyword_as_wan_passes_it_reach_the_engine(comfy_factory, skip_reshape):
    # Wan (and other ComfyUI model files) call optimized_attention(q, k, v, heads=n, transformer_options=...):
    # wrap_attn hands the override heads among the keywords; it is the function's own parameter, not a keyword
    # the engine cannot take, so the call is the engine's, and no note says ComfyUI's function ran it.
    _, nodes = loaded(comfy_factory)
    from comfy.ldm.modules import attention
    from comfy_attn import run
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 4, 12, 16) for _ in range(3))
    args = (q, k, v) if skip_reshape else tuple(t.transpose(1, 2).reshape(2, 12, 64) for t in (q, k, v))
    with lib_attn.recording() as rec:
        out = attention.optimized_attention(*args, heads=4, skip_reshape=skip_reshape,
                                            transformer_options=override_options())
    assert rec.calls == {("dit", "sdpa"): 1}
    want = reference(q, k, v).transpose(1, 2).reshape(2, 12, 64)
    assert rel_err(out, want) <= 1e-5
    report = run.current_report()                                             # None: nothing noted
    assert report is None or not any("ran on ComfyUI's own function" in n for n in report.notes)


# --- packs that call ComfyUI's function by name -------------------------------------------------------------

PACK = '''
from comfy.ldm.modules.attention import optimized_attention
from comfy.ldm.modules.attention import optimized_attention as attention_fn

NODE_CLASS_MAPPINGS = {}


def cross_attention(q, k, v, ip_k, ip_v, extra_options):
    """As IPAdapter_plus's attn2 replacement: the text's and the image's cross-attention, no options."""
    out = optimized_attention(q, k, v, extra_options["n_heads"])
    return out + attention_fn(q, ip_k, ip_v, extra_options["n_heads"]) * 0.5   # the same, imported under its own name
'''


def load_pack(tmp_path, source=PACK):
    import nodes
    folder = tmp_path / "custom_nodes" / "ComfyUI_IPAdapter_plus"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "__init__.py").write_text(source)
    assert asyncio.run(nodes.load_custom_node(str(folder)))
    return sys.modules[str(folder).replace(".", "_x_")]


class PackUNet(torch.nn.Module):
    """A UNet whose cross-attention the pack replaced (two calls of its by-name function per model call)."""

    def __init__(self):
        super().__init__()
        self.proj_in, self.to_q = torch.nn.Linear(4, 32), torch.nn.Linear(32, 32)
        self.to_kv, self.to_ip = torch.nn.Linear(32, 64), torch.nn.Linear(32, 64)
        self.proj_out = torch.nn.Linear(32, 4)
        self.pack = None

    def forward(self, x, timesteps=None, context=None, transformer_options={}, **kwargs):
        b, c, h, w = x.shape
        t = self.proj_in(x.flatten(2).transpose(1, 2))
        k, v = self.to_kv(context).chunk(2, dim=-1)
        ip_k, ip_v = self.to_ip(context[:, :3]).chunk(2, dim=-1)
        t = t + self.pack.cross_attention(self.to_q(t), k, v, ip_k, ip_v, {"n_heads": 4})
        return self.proj_out(t).transpose(1, 2).reshape(b, c, h, w)


def pack_patcher(pack, seed=0):
    from comfy.model_base import BaseModel
    from comfy.model_patcher import ModelPatcher
    torch.manual_seed(seed)
    model = PackUNet()
    model.pack = pack
    return ModelPatcher(BaseModel(model))


@pytest.mark.parametrize("when", ["before this package", "after this package", "after the node ran"])
def test_a_packs_calls_through_comfyuis_function_by_name_reach_the_node(comfy_factory, tmp_path, when):
    comfy = comfy_factory(argv=("--cpu",))
    pack = load_pack(tmp_path) if when == "before this package" else None
    assert comfy.load_node()
    import nodes
    if when == "after this package":
        pack = load_pack(tmp_path)
    (routed,) = node(nodes, "FlashAttentionBackend", model=pack_patcher(pack), tune="auto", **BACKEND)
    if when == "after the node ran":
        pack = routed.model.diffusion_model.pack = load_pack(tmp_path)
    ref = sample(pack_patcher(pack))
    with lib_attn.recording() as rec:
        out = sample(routed, steps=2)
    assert rel_err(out, ref) <= 1e-5
    assert rec.calls == {("dit", "sdpa"): 2 * 2}                               # 2 steps x the pack's 2 calls
    with lib_attn.recording() as rec:                                           # not sampling: ComfyUI's own
        sample(pack_patcher(pack))
    assert not rec.calls


@pytest.mark.parametrize("before", [True, False])
def test_under_the_global_route_a_packs_calls_are_routed_whatever_the_load_order(comfy_factory, tmp_path, before):
    comfy = comfy_factory(argv=("--cpu",), env={"ATTN_COMFY_ROUTE": "auto"})
    pack = load_pack(tmp_path) if before else None
    assert comfy.load_node()
    pack = pack or load_pack(tmp_path)
    with lib_attn.recording() as rec:
        sample(pack_patcher(pack), steps=2)
    assert rec.calls == {("dit", "sdpa"): 4}
    q, k, v = (torch.randn(1, 5, 32) for _ in range(3))
    with lib_attn.recording() as rec:                  # outside a model call: as ComfyUI's attention module's calls
        pack.optimized_attention(q, k, v, 4)
    assert rec.calls == {("unet", "sdpa"): 1}


HOLDING_PACK = '''
from comfy.ldm.modules.attention import optimized_attention

NODE_CLASS_MAPPINGS = {}
KERNELS = {"comfy": optimized_attention}              # a pack's table of attention functions, read per call
SIZES = {"comfy": 1, "other": 2}                      # a dict holding no function


class Attention:
    kernel = staticmethod(optimized_attention)        # kept on a class


def cross_attention(q, k, v, ip_k, ip_v, extra_options):
    out = KERNELS["comfy"](q, k, v, extra_options["n_heads"])
    return out + Attention.kernel(q, ip_k, ip_v, extra_options["n_heads"]) * 0.5
'''


@pytest.mark.parametrize("when", ["before this package", "after the node ran"])
def test_a_packs_copy_in_a_dict_or_class_attribute_is_named_in_the_report_where_it_is_not_reached(
        comfy_factory, tmp_path, when):
    """A pack loaded before this package keeps ComfyUI's own function in a dict or on a class, which no
    rebinding of a module's name reaches: its calls run on ComfyUI's attention, and the report names where
    the copies are. A pack loaded later copies the rebound name: its calls reach the node, and nothing is said."""
    comfy = comfy_factory(argv=("--cpu",))
    pack = load_pack(tmp_path, HOLDING_PACK) if when == "before this package" else None
    assert comfy.load_node()
    import nodes
    if pack is None:
        (routed,) = node(nodes, "FlashAttentionBackend", model=pack_patcher(None), tune="auto", **BACKEND)
        pack = routed.model.diffusion_model.pack = load_pack(tmp_path, HOLDING_PACK)
    else:
        (routed,) = node(nodes, "FlashAttentionBackend", model=pack_patcher(pack), tune="auto", **BACKEND)
    ref = sample(pack_patcher(pack))
    with lib_attn.recording() as rec:
        out = sample(routed, steps=2)
    assert rel_err(out, ref) <= 1e-5
    text = node(nodes, "FlashAttentionReport", images=out)["ui"]["text"]
    said = [line for line in text if "cannot put its own" in line]
    if when == "after the node ran":
        assert rec.calls == {("dit", "sdpa"): 2 * 2} and not said
        return
    assert not rec.calls                                                            # ComfyUI's own, as it says
    (line,) = said
    assert "ComfyUI_IPAdapter_plus.KERNELS['comfy']" in line and "ComfyUI_IPAdapter_plus.Attention.kernel" in line
    assert "SIZES" not in line


#: A pack whose module also holds what a read for copies must pass over without asking it anything: an object
#: whose class cannot be asked (a context-local proxy outside its context), a class attribute that raises on
#: any attribute, and a table far larger than a registry whose first entries hold no function.
AWKWARD_PACK = HOLDING_PACK + '''

class _Unbound:
    @property
    def __class__(self):
        raise RuntimeError("working outside of a request context")


class _Lazy:
    def __getattr__(self, name):
        raise RuntimeError(f"not loaded: {name}")


request = _Unbound()
Attention.loader = _Lazy()
TABLE = dict.fromkeys(range(2_000_000), 0)
TABLE["late"] = optimized_attention
'''


def test_a_packs_awkward_values_neither_stop_the_sampling_nor_hide_its_copies(comfy_factory, tmp_path):
    """Reading a pack's module for copies asks its values nothing they could raise on, and reads a dict's first
    entries only (``MAX_HELD``), not the whole table: the sampling runs and the report names the copies."""
    comfy = comfy_factory(argv=("--cpu",))
    pack = load_pack(tmp_path, AWKWARD_PACK)
    assert comfy.load_node()
    import nodes
    (routed,) = node(nodes, "FlashAttentionBackend", model=pack_patcher(pack), tune="auto", **BACKEND)
    sample(routed, steps=1)
    out = sample(routed, steps=1)
    (line,) = [line for line in node(nodes, "FlashAttentionReport", images=out)["ui"]["text"]
               if "cannot put its own" in line]
    assert "KERNELS['comfy']" in line and "Attention.kernel" in line
    assert "TABLE" not in line and "loader" not in line and "request" not in line


@pytest.mark.parametrize("before", [True, False])
def test_under_the_global_route_a_packs_unreachable_copies_are_named_in_each_samplings_report(comfy_factory,
                                                                                             tmp_path, before):
    comfy = comfy_factory(argv=("--cpu",), env={"ATTN_COMFY_ROUTE": "auto"})
    pack = load_pack(tmp_path, HOLDING_PACK) if before else None
    assert comfy.load_node()
    pack = pack or load_pack(tmp_path, HOLDING_PACK)
    comfy.server.client_id = "page-1"
    with lib_attn.recording() as rec:
        sample(pack_patcher(pack), steps=2)
    (data,) = [data for event, data, _ in comfy.server.sent if event == "flash-attention.report"]
    named = any("KERNELS['comfy']" in line and "Attention.kernel" in line for line in data["text"])
    assert (named, dict(rec.calls)) == ((True, {}) if before else (False, {("dit", "sdpa"): 4})), data["text"]


# --- the serving marker belongs to the model being sampled -----------------------------------------------------

class GuidedPair(torch.nn.Module):
    """The diffusion model of a sampled model whose guider also calls a second model (its own ``BaseModel``,
    its own options), as dual-model guiders do."""

    def __init__(self, first, second, second_options=None):
        super().__init__()
        self.first, self.second, self.second_options = first, second, second_options or {}

    def forward(self, x, timesteps=None, context=None, transformer_options={}, **kwargs):
        own = self.first(x, timesteps=timesteps, context=context, transformer_options=transformer_options)
        return own + self.second.apply_model(x, timesteps, c_crossattn=context,
                                             transformer_options=dict(self.second_options))


def test_another_model_a_guider_calls_runs_on_comfyuis_attention_not_the_nodes(comfy_factory):
    _, nodes = loaded(comfy_factory)
    from comfy.ldm.pixart.pixartms import PixArtMS
    from comfy.model_base import BaseModel
    from comfy.model_patcher import ModelPatcher
    torch.manual_seed(3)
    first, second = PixArtMS(), BaseModel(PixArtMS())
    patcher = ModelPatcher(BaseModel(GuidedPair(first, second)))
    ref = sample(patcher)
    (routed,) = node(nodes, "FlashAttentionBackend", model=patcher, tune="auto", **BACKEND)
    with lib_attn.recording() as rec:
        out = sample(routed, steps=2)
    assert rel_err(out, ref) <= 1e-5
    assert rec.calls == {("dit", "sdpa"): 2 * 4}                               # the first model's calls only


def test_another_model_a_guider_calls_runs_on_its_own_nodes_settings(comfy_factory):
    _, nodes = loaded(comfy_factory)
    from comfy.ldm.flux.model import Flux
    from comfy.model_base import BaseModel
    from comfy.model_patcher import ModelPatcher
    torch.manual_seed(5)
    (second,) = node(nodes, "FlashAttentionBackend", model=unet_patcher(), tune="auto",
                     **dict(BACKEND, backend="sdpa-math"))
    options = second.model_options["transformer_options"]
    patcher = ModelPatcher(BaseModel(GuidedPair(Flux(), second.model, options)))
    (routed,) = node(nodes, "FlashAttentionBackend", model=patcher, tune="auto", **BACKEND)
    with lib_attn.recording() as rec:
        sample(routed, steps=2)
    assert rec.calls == {("dit", "sdpa"): 2, ("unet", "sdpa-math"): 4}        # each model on its own node's


@pytest.mark.parametrize("put_on", ["ComfyUI's Model Attention Backend", "a patch node's own kernel"])
def test_an_override_put_on_after_the_node_is_named_in_the_report_with_the_calls_it_took(comfy_factory, put_on):
    _, nodes = loaded(comfy_factory)
    from comfy.ldm.modules import attention
    (routed,) = node(nodes, "FlashAttentionBackend", model=unet_patcher(), tune="auto", **BACKEND)
    later = routed.clone()
    ran = []
    if put_on.startswith("ComfyUI"):
        later.set_model_optimized_attention(lambda *a, **kw: ran.append(1) or attention.attention_pytorch(*a, **kw))
    else:
        def own_kernel(func, *args, **kwargs):
            ran.append(1)
            return attention.attention_pytorch(*args, **kwargs)
        later.model_options["transformer_options"]["optimized_attention_override"] = own_kernel
    with lib_attn.recording() as rec:
        out = sample(later)
    assert len(ran) == 4 and not rec.calls
    text = node(nodes, "FlashAttentionReport", images=out)["ui"]["text"]
    assert any("4 attention calls were computed by" in line and "put on after this node" in line
               for line in text), text
    kept = later.model_options["transformer_options"]["optimized_attention_override"]
    assert kept.__name__ != "counted"                                            # the model's own options untouched


def test_the_node_over_comfyuis_sparse_node_over_model_attention_backend_names_what_it_replaced(comfy_factory):
    """ComfyUI's Model Attention Backend, then its Model Sparse Attention node (which hands what it declines to
    the backend's override), then this node: the backend's kernel is what the node drops, and the report says so."""
    _, nodes = loaded(comfy_factory)
    from comfy.ldm.modules import attention
    sparse = load_extras("nodes_sparse_attention")
    original = unet_patcher()
    original.set_model_optimized_attention(attention.attention_pytorch)
    sparse.install_override(sparse.SparseAttnPatch(min_tokens=1), original.model_options["transformer_options"])
    (routed,) = node(nodes, "FlashAttentionBackend", model=original, tune="auto", **BACKEND)
    with lib_attn.recording() as rec:
        out = sample(routed)
    assert rec.calls == {("unet", "sdpa"): 4}
    text = node(nodes, "FlashAttentionReport", images=out)["ui"]["text"]
    assert any("set_model_optimized_attention.<locals>.optimized_attention_override, under" in line
               and "make_attention_override.<locals>.override" in line and "this node replaced it" in line
               for line in text), text


def test_the_node_twice_with_the_sparse_node_between_samples_on_the_later_nodes_settings(comfy_factory):
    _, nodes = loaded(comfy_factory)
    sparse = load_extras("nodes_sparse_attention")
    (first,) = node(nodes, "FlashAttentionBackend", model=unet_patcher(), tune="auto",
                    **dict(BACKEND, backend="sdpa-math"))
    between = first.clone()
    sparse.install_override(sparse.SparseAttnPatch(min_tokens=10 ** 6), between.model_options["transformer_options"])
    (later,) = node(nodes, "FlashAttentionBackend", model=between, tune="auto", **BACKEND)
    with lib_attn.recording() as rec:
        sample(later)
    assert rec.calls == {("unet", "sdpa"): 4}                                   # none on the first node's sdpa-math


# --- the VAE's precision, batches over ComfyUI's limit, the precision cache --------------------------------------

def test_vae_attention_keeps_comfyuis_precision_under_force_upcast_attention(comfy_factory, monkeypatch):
    _, nodes = loaded(comfy_factory, argv=("--cpu", "--force-upcast-attention"))
    from comfy.ldm.modules import attention
    from comfy_attn import route
    assert attention.get_attn_precision(None, torch.float16) == torch.float32   # ComfyUI's rule is on
    seen = []
    engine = lib_attn.attention

    def spy(q, k, v, **kwargs):
        seen.append(q.dtype)
        return engine(q, k, v, **kwargs)
    monkeypatch.setattr(lib_attn, "attention", spy)
    q, k, v = (torch.randn(1, 32, 4, 4, dtype=torch.float16) for _ in range(3))
    out = route.function("vae")(q, k, v)
    assert seen == [torch.float16] and out.dtype == torch.float16               # as ComfyUI's VAE attention
    route.function("dit")(*(t.flatten(2).transpose(1, 2) for t in (q, k, v)), 4)
    assert seen[-1] == torch.float32                                            # the model's calls: its rule


@pytest.mark.parametrize("mask_batch", [None, 1, 7])
@pytest.mark.parametrize("skip_reshape", [False, True])
def test_batches_over_comfyuis_limit_are_split_as_comfyui_splits_them(comfy_factory, monkeypatch, mask_batch,
                                                                      skip_reshape):
    loaded(comfy_factory)
    from comfy.ldm.modules import attention
    torch.manual_seed(4)
    q, k, v = (torch.randn(7, 6, 32) for _ in range(3))
    if skip_reshape:
        q, k, v = (t.view(7, 6, 4, 8).transpose(1, 2) for t in (q, k, v))
    mask = None if mask_batch is None else torch.randn(mask_batch, 6, 6)
    form = dict(skip_reshape=skip_reshape, skip_output_reshape=skip_reshape)
    ref = attention.attention_pytorch(q, k, v, 4, mask, **form)
    monkeypatch.setattr(attention, "SDP_BATCH_LIMIT", 3)
    assert torch.allclose(attention.attention_pytorch(q, k, v, 4, mask, **form), ref, atol=1e-6)   # ComfyUI's split
    with lib_attn.recording() as rec:
        out = attention.optimized_attention(q, k, v, 4, mask, transformer_options=override_options(), **form)
    assert rec.calls == {("dit", "sdpa"): 3}                                     # 3 + 3 + 1
    assert out.shape == ref.shape and (out - ref).abs().max() <= 1e-5


def test_the_precision_check_of_a_rebound_name_is_looked_up_once(comfy_factory, monkeypatch):
    _, nodes = loaded(comfy_factory)
    node(nodes, "FlashAttentionBackend", model=unet_patcher(), tune="auto", **BACKEND)
    from comfy.ldm.flux import math as flux_math
    from comfy_attn import route
    rebound = flux_math.optimized_attention.__wrapped__
    assert route.consults_precision(rebound)                                     # sub-quadratic asks the rule
    monkeypatch.setattr(inspect, "unwrap", lambda f: pytest.fail("read again"))
    assert route.consults_precision(rebound)


# --- a bad value, once, on its input -------------------------------------------------------------------------

BAD_VALUES = [
    (dict(chain="flash-atn"), "chain", ["unknown backend id 'flash-atn'", "valid ids"]),
    (dict(schedule="0-50%: sdpa; 50-100%: flahs"), "schedule", ["schedule rule 2", "'flahs'"]),
    (dict(sparse="sol, budget=1.5"), "sparse", ["sparse budget '1.5'"]),
]


@pytest.mark.parametrize("inputs,where,words", BAD_VALUES)
def test_a_bad_value_is_refused_before_the_graph_runs_naming_the_input_that_holds_it(comfy_factory, inputs, where,
                                                                                       words):
    """The shipped graph's inputs, all present, one of them bad: ComfyUI reports the check's text on every
    input the check takes (the page keeps it on the input it names: test_comfy_web); the text names that
    input on a line of its own, and the node refuses it again when it runs (the API can skip the page)."""
    _, nodes = loaded(comfy_factory)
    import execution
    cls = nodes.NODE_CLASS_MAPPINGS["FlashAttentionBackend"]
    values = {**dict(model=None, tune="auto", guard="on", schedule="", sparse=""), **BACKEND, **inputs}
    ok, errors = execution.validate(cls, values)
    assert not ok and [e["extra_info"]["input_name"] for e in errors] == ["chain", "schedule", "sparse"]
    for error in errors:
        (line,) = error["details"].split(" - ", 1)[1].split("\n")
        assert line.startswith((f"{where} ", f"{where}: ")) and all(w in line for w in words), line
    with pytest.raises(ValueError) as raised:
        execution.execute(cls, dict(values, model=unet_patcher()))
    assert all(w in str(raised.value) for w in words)


def test_every_bad_value_has_its_own_line_and_a_link_is_checked_when_the_node_runs(comfy_factory):
    _, nodes = loaded(comfy_factory)
    import execution
    cls = nodes.NODE_CLASS_MAPPINGS["FlashAttentionBackend"]
    bad = {k: v for inputs, _, _ in BAD_VALUES for k, v in inputs.items()}
    values = {**dict(model=None, tune="auto", guard="on"), **BACKEND, **bad}
    ok, errors = execution.validate(cls, values)
    lines = errors[0]["details"].split(" - ", 1)[1].split("\n")
    assert [line.split(" ")[0].rstrip(":") for line in lines] == ["chain", "schedule", "sparse"]
    # a value linked from another node reaches the check as None (ComfyUI knows it only when the node runs)
    assert cls.VALIDATE_INPUTS(chain=None, schedule=None, sparse=None) is True
    # a graph saved before the schedule and sparse inputs existed: the check is given the chain alone
    assert execution.validate(cls, {**dict(model=None, tune="auto"), **BACKEND}) == (True, [])


# --- the global route's report --------------------------------------------------------------------------------

def test_the_global_route_sends_each_samplings_and_decodes_report_and_the_cache_note(comfy_factory):
    comfy = comfy_factory(argv=("--cpu",), env={"ATTN_COMFY_ROUTE": "auto"})
    assert comfy.load_node()
    import nodes
    from comfy.sd import VAE
    from comfy_execution.utils import CurrentNodeContext
    comfy.server.client_id = "page-1"                                          # the page that queued p1
    latent = sample(unet_patcher(), prompt_id="p1")
    with CurrentNodeContext("p1", "8"):
        images = VAE().decode(latent)
    sent = [(data, sid) for event, data, sid in comfy.server.sent if event == "flash-attention.report"]
    assert len(sent) == 2 and all(data["prompt_id"] == "p1" and sid == "page-1" for data, sid in sent)
    assert {(c["role"], c["count"]) for c in sent[0][0]["calls"]} == {("unet", 4)}
    assert {(c["role"], c["count"]) for c in sent[1][0]["calls"]} == {("unet", 4), ("vae", 1)}
    sample(unet_patcher(), prompt_id="p2")                                     # other work in between
    text = node(nodes, "FlashAttentionReport", prompt_id="p3", images=images)["ui"]["text"]  # p1's, from the cache
    assert text[0].endswith("×4") and text[1].startswith("VAE: sdpa")
    assert "these images come from ComfyUI's cache" in text[-1] and "(prompt p1)" in text[-1]


class _Decoder:
    """A sampler and a VAE decode in one node (a seed in, images out), as KSampler then VAEDecode make them."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 1})}}

    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "run"

    def run(self, seed):
        from comfy.sd import VAE
        from comfy_attn import run
        return (VAE().decode(sample(unet_patcher(seed), prompt_id=run.prompt_id())),)


class _Save:
    """SaveImage's place: an output node with images in and nothing out."""
    saved = []

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"images": ("IMAGE",), "filename_prefix": ("STRING", {"default": "x"})}}

    RETURN_TYPES = ()
    FUNCTION = "save"
    OUTPUT_NODE = True

    def save(self, images, filename_prefix):
        self.saved.append(filename_prefix)
        return {"ui": {"images": [filename_prefix]}, "result": ()}


def test_under_the_global_route_a_cached_prompt_without_a_report_node_sends_the_cache_note(comfy_factory,
                                                                                           monkeypatch):
    """A prompt queued again (or with only a save node's input changed) runs no sampling and no decode: when
    it ends, the report of the prompt that made its images goes to the page that queued it, with the note."""
    comfy = comfy_factory(argv=("--cpu",), env={"ATTN_COMFY_ROUTE": "auto"})
    assert comfy.load_node()
    import execution
    import nodes
    monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, "TestDecoder", _Decoder)
    monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, "TestSave", _Save)
    monkeypatch.setattr(_Save, "saved", [])

    def prompt(seed=1, prefix="a", report=False):
        graph = {"1": {"class_type": "TestDecoder", "inputs": {"seed": seed}},
                 "2": {"class_type": "TestSave", "inputs": {"images": ["1", 0], "filename_prefix": prefix}}}
        if report:
            graph["3"] = {"class_type": "FlashAttentionReport", "inputs": {"images": ["1", 0]}}
        return graph

    executor = execution.PromptExecutor(comfy.server)

    def reports(prompt_id):
        return [(data, sid) for event, data, sid in comfy.server.sent
                if event == "flash-attention.report" and data["prompt_id"] == prompt_id]

    executor.execute(prompt(), "p1", {"client_id": "page-1"})
    assert executor.ran == ["1", "2"] and len(reports("p1")) == 2                  # its sampling and its decode
    executor.execute(prompt(seed=2), "p2", {"client_id": "page-1"})                 # another prompt in between
    for again, prefix in (("p3", "a"), ("p4", "b")):                                # all cached; the save runs
        executor.execute(prompt(prefix=prefix), again, {"client_id": "page-2"})
        assert executor.ran == ([] if prefix == "a" else ["2"])
        ((data, sid),) = reports(again)
        assert sid == "page-2"                                                     # to the page that queued it
        assert {(c["role"], c["count"]) for c in data["calls"]} == {("unet", 4), ("vae", 1)}
        assert "these images come from ComfyUI's cache" in data["text"][-1] and "(prompt p1)" in data["text"][-1]
    sent = len(comfy.server.sent)
    executor.execute(prompt(seed=3, report=True), "p5", {"client_id": "page-1"})    # ran: its own reports only
    assert len(reports("p5")) == 3 and len(comfy.server.sent) == sent + 3
    executor.execute(prompt(seed=3, prefix="c", report=True), "p6", {"client_id": "page-1"})
    ((data, _),) = reports("p6")                                                     # its report node was cached
    assert "(prompt p5)" in data["text"][-1]


def test_under_the_global_route_a_pack_timing_each_prompt_neither_unroutes_nor_silences_it(comfy_factory,
                                                                                            monkeypatch):
    """A pack loaded after this package wraps ``PromptExecutor.execute`` (to time each prompt, as packs do):
    attention is still routed and said to be (the status route's ``routing``), a cached prompt still sends the
    cache note, and the pack's wrapper keeps working after this package's undo."""
    comfy = comfy_factory(argv=("--cpu",), env={"ATTN_COMFY_ROUTE": "auto"})
    assert comfy.load_node()
    import execution
    import nodes
    from comfy_attn import route
    monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, "TestDecoder", _Decoder)
    timed = []
    inner = execution.PromptExecutor.execute

    def execute(self, prompt, prompt_id, *args, **kwargs):     # the pack's wrapper
        timed.append(prompt_id)
        return inner(self, prompt, prompt_id, *args, **kwargs)

    monkeypatch.setattr(execution.PromptExecutor, "execute", execute)
    assert route.routing().routed
    executor = execution.PromptExecutor(comfy.server)
    graph = {"1": {"class_type": "TestDecoder", "inputs": {"seed": 1}}}
    executor.execute(graph, "p1", {"client_id": "page-1"})
    executor.execute(graph, "p2", {"client_id": "page-1"})
    assert executor.ran == [] and timed == ["p1", "p2"]
    (data,) = [data for event, data, _ in comfy.server.sent if event == "flash-attention.report"
               and data["prompt_id"] == "p2"]
    assert "(prompt p1)" in data["text"][-1]
    route.undo()
    executor.execute(graph, "p3", {"client_id": "page-1"})
    assert timed[-1] == "p3"


def test_a_prompt_ended_outside_the_global_route_sends_nothing_more(comfy_factory, monkeypatch):
    comfy = comfy_factory(argv=("--cpu",))
    assert comfy.load_node()
    import execution
    import nodes
    monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, "TestDecoder", _Decoder)
    executor = execution.PromptExecutor(comfy.server)
    graph = {"1": {"class_type": "TestDecoder", "inputs": {"seed": 1}}}
    executor.execute(graph, "p1", {"client_id": "page-1"})
    executor.execute(graph, "p2", {"client_id": "page-1"})
    assert executor.ran == [] and not [e for e, _, _ in comfy.server.sent if e == "flash-attention.report"]


def test_under_the_global_route_a_prompt_that_ran_no_attention_never_claims_comfyuis_own(comfy_factory):
    # Seen in ComfyUI 0.19.3 under ATTN_COMFY_ROUTE=auto: a prompt whose decode came from ComfyUI's cache and
    # whose report node was given an inverted copy of those images said "ComfyUI's own attention".
    comfy = comfy_factory(argv=("--cpu",), env={"ATTN_COMFY_ROUTE": "auto"})
    assert comfy.load_node()
    import nodes
    from comfy.sd import VAE
    from comfy_execution.utils import CurrentNodeContext
    comfy.server.client_id = "page-1"
    latent = sample(unet_patcher(), prompt_id="p1")
    with CurrentNodeContext("p1", "8"):
        images = VAE().decode(latent)
    inverted = 1.0 - images                                                    # ImageInvert in p2, the rest cached
    text = node(nodes, "FlashAttentionReport", prompt_id="p2", images=inverted)["ui"]["text"]
    assert not any("ComfyUI's own attention" in line for line in text)
    assert text[0] == "no attention calls"
    assert "no sampling or VAE pass of this prompt ran attention" in text[-1] and "ComfyUI's history" in text[-1]
    event, data, sid = comfy.server.sent[-1]
    assert event == "flash-attention.report" and data["text"] == text and data["prompt_id"] == "p2"
