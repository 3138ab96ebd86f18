"""The ComfyUI custom node against the ComfyUI 0.8.0 double: the loader's contract, the nodes' inputs
and errors, output equality with ComfyUI's own attention in fp32 for every call form the models use,
call counts per role, the VAE route and its undo, the report, the global route and ComfyUI's own
flags, and the status route."""
import asyncio
import json
import os
import subprocess
import sys

import re

import pytest
import torch

import lib_attn
from tests.doubles.comfy_fixtures import COMFY_ROOT, REPO_ROOT, comfy_factory  # noqa: F401
from tests.engine_helpers import sage_on_cpu  # noqa: F401
from host_attn import voice

FP32 = 1e-5


@pytest.fixture(autouse=True)
def fresh_log(monkeypatch):
    monkeypatch.setattr(voice, "_said", set())


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def loaded(comfy_factory, argv=("--cpu",), env=None, prestartup=True):
    comfy = comfy_factory(argv=argv, env=env, prestartup=prestartup)
    assert comfy.load_node()
    import nodes
    return comfy, nodes


def node(nodes, name, prompt_id="p1", **inputs):
    import execution
    cls = nodes.NODE_CLASS_MAPPINGS[name]
    ok, errors = execution.validate(cls, inputs)
    assert ok, errors
    return execution.execute(cls, inputs, prompt_id=prompt_id)


def unet_patcher(seed=0):
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
    from comfy.model_base import BaseModel
    from comfy.model_patcher import ModelPatcher
    torch.manual_seed(seed)
    return ModelPatcher(BaseModel(UNetModel()))


def flux_patcher(seed=0):
    from comfy.ldm.flux.model import Flux
    from comfy.model_base import BaseModel
    from comfy.model_patcher import ModelPatcher
    torch.manual_seed(seed)
    return ModelPatcher(BaseModel(Flux()))


def sample(patcher, prompt_id="p1", steps=2, dtype=torch.float32):
    """KSampler's work, as node ``prompt_id``'s sampler would do it (``dtype``: the model's and the
    inputs', for a float64 reference)."""
    from comfy import samplers
    from comfy_execution.utils import CurrentNodeContext
    gen = torch.Generator().manual_seed(1)
    noise = torch.randn(1, 4, 8, 8, generator=gen, dtype=torch.float64).to(dtype)
    context = torch.randn(1, 7, 32, generator=gen, dtype=torch.float64).to(dtype)
    patcher.model.to(dtype)
    with CurrentNodeContext(prompt_id, "3"):
        return samplers.sample(patcher, noise, torch.linspace(1.0, 0.1, steps + 1, dtype=dtype), context)


BACKEND = dict(backend="auto", chain="", strict=False, fp32="auto")


# --- the loader's contract ----------------------------------------------------------------------------

def test_loads_as_a_custom_node_package(comfy_factory):
    comfy, nodes = loaded(comfy_factory)
    assert set(nodes.NODE_CLASS_MAPPINGS) >= {"FlashAttentionBackend", "FlashAttentionVAEBackend", "FlashAttentionReport"}
    assert nodes.NODE_DISPLAY_NAME_MAPPINGS["FlashAttentionBackend"] == "Attention backend"
    web = nodes.EXTENSION_WEB_DIRS["sd-webui-flash-attention"]
    assert os.path.realpath(web) == os.path.join(os.path.realpath(REPO_ROOT), "web")
    assert os.path.isfile(os.path.join(web, "flash_attention.js"))
    assert comfy.node_dir not in sys.path


def test_loads_in_a_fresh_comfyui_where_nothing_of_it_is_on_sys_path(tmp_path):
    """ComfyUI does not put the folder on sys.path: the package loads its own packages itself."""
    custom = tmp_path / "custom_nodes"
    custom.mkdir()
    os.symlink(REPO_ROOT, custom / "sd-webui-flash-attention")
    code = (
        "import asyncio, sys\n"
        f"sys.path = [p for p in sys.path if p not in ({REPO_ROOT!r}, '')]\n"
        f"sys.path.insert(0, {COMFY_ROOT!r})\n"
        "import comfy.cli_args, server\n"
        "server.PromptServer()\n"
        "import nodes\n"
        f"ok = asyncio.run(nodes.load_custom_node({str(custom / 'sd-webui-flash-attention')!r}))\n"
        "import lib_attn\n"
        "print(ok, lib_attn.__file__, sorted(nodes.NODE_CLASS_MAPPINGS))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr
    ok, path, names = out.stdout.strip().splitlines()[-1].split(" ", 2)
    assert ok == "True" and os.path.realpath(path).startswith(os.path.realpath(REPO_ROOT))
    assert "FlashAttentionBackend" in names


# --- the Attention backend node -----------------------------------------------------------------------

@pytest.mark.parametrize("node_name", ["FlashAttentionBackend", "FlashAttentionVAEBackend"])
@pytest.mark.parametrize("inputs,where,words", [
    (dict(backend="nope"), "backend", ["'nope'", "'flash-attn'", "'sdpa'"]),
    (dict(chain="sdpa, flahs-attn"), "chain", ["'flahs-attn'", "valid ids", "flash-attn"]),
    (dict(fp32="sideways"), "fp32", ["'sideways'", "'cast'", "'keep'"]),
])
def test_one_message_per_bad_value_on_its_input(comfy_factory, node_name, inputs, where, words):
    _, nodes = loaded(comfy_factory)
    import execution
    cls = nodes.NODE_CLASS_MAPPINGS[node_name]
    values = dict(model=None, vae=None, tune="auto", **{**BACKEND, **inputs})
    values = {k: v for k, v in values.items() if k in cls.INPUT_TYPES()["required"]}
    ok, errors = execution.validate(cls, values)
    assert not ok and len(errors) == 1, errors
    assert errors[0]["extra_info"]["input_name"] == where
    assert all(w in errors[0]["details"] for w in words), errors[0]["details"]


@pytest.mark.parametrize("inputs,words", [
    (dict(backend="nope"), ["'nope'", "valid ids", "flash-attn"]),
    (dict(chain="sdpa, flahs-attn"), ["'flahs-attn'", "valid ids"]),
    (dict(fp32="sideways"), ["'sideways'", "cast", "keep"]),
])
def test_bad_values_are_refused_again_when_the_node_runs(comfy_factory, inputs, words):
    """The API can skip the page; the node says the same when it runs."""
    _, nodes = loaded(comfy_factory)
    import execution
    values = dict(tune="auto", **{**BACKEND, **inputs})
    with pytest.raises(ValueError) as raised:
        execution.execute(nodes.NODE_CLASS_MAPPINGS["FlashAttentionBackend"], dict(values, model=unet_patcher()))
    assert all(w in str(raised.value) for w in words)


def test_choices_list_only_valid_values(comfy_factory):
    _, nodes = loaded(comfy_factory)
    required = nodes.NODE_CLASS_MAPPINGS["FlashAttentionBackend"].INPUT_TYPES()["required"]
    assert required["backend"][0] == ["auto", *lib_attn.BACKEND_IDS]                  # the stored values: ids
    tooltip = required["backend"][1]["tooltip"]
    from host_attn import status
    assert tooltip.endswith(status.unavailable_text())                                 # what cannot run here, grouped
    for info in lib_attn.backends():
        named = re.findall(rf"(?<![\w-]){re.escape(info.id)}(?![\w-])", tooltip.split("Not available here:")[-1])
        assert len(named) == (0 if info.available or info.id in status.SITUATIONAL else 1), info.id
    assert required["fp32"][0] == ["auto", "cast", "keep"] and required["tune"][0] == ["auto", "on", "off"]


@pytest.mark.parametrize("make,role,per_step", [(unet_patcher, "unet", 2), (flux_patcher, "dit", 1)])
def test_model_through_the_node_matches_comfyui_and_is_counted(comfy_factory, make, role, per_step):
    _, nodes = loaded(comfy_factory)
    from comfy.ldm.modules import attention
    assert attention.optimized_attention.__wrapped__.__name__ == "attention_sub_quad"   # ComfyUI on CPU
    original = make()
    ref = sample(original)
    (routed,) = node(nodes, "FlashAttentionBackend", model=original, tune="auto", **BACKEND)
    assert routed is not original and routed.model is original.model                 # a clone, same weights
    assert "optimized_attention_override" not in original.model_options["transformer_options"]
    assert not original.wrappers
    with lib_attn.recording() as rec:
        out = sample(routed, steps=2)
    assert rel_err(out, ref) <= FP32
    assert rec.calls == {(role, "sdpa"): 2 * per_step}
    assert rel_err(sample(original), ref) <= 1e-12                                    # the original is ComfyUI's


@pytest.mark.parametrize("form", ["plain", "skip_reshape", "skip_output_reshape", "both"])
@pytest.mark.parametrize("kind", ["none", "additive-2d", "additive-3d", "additive-4d", "bool-2d", "bool-3d", "bool-4d"])
def test_every_call_form_through_the_override_matches_attention_pytorch(comfy_factory, form, kind):
    _, _ = loaded(comfy_factory)
    from comfy.ldm.modules import attention
    from comfy_attn import route
    heads, d, n, m = 4, 16, 12, 10
    q = torch.randn(2, n, heads * d, dtype=torch.float64)
    k, v = (torch.randn(2, m, heads * d, dtype=torch.float64) for _ in range(2))
    skip_reshape = form in ("skip_reshape", "both")
    skip_output_reshape = form in ("skip_output_reshape", "both")
    if skip_reshape:
        q, k, v = (t.view(2, -1, heads, d).transpose(1, 2) for t in (q, k, v))
    mask = None
    if kind.startswith("bool"):
        mask = torch.rand({"bool-2d": (n, m), "bool-3d": (2, n, m), "bool-4d": (2, heads, n, m)}[kind]) > 0.3
        mask[..., 0] = True
    elif kind != "none":
        mask = torch.randn({"additive-2d": (n, m), "additive-3d": (2, n, m), "additive-4d": (2, heads, n, m)}[kind],
                           dtype=torch.float64)
    ref = attention.attention_pytorch(q, k, v, heads, mask, skip_reshape=skip_reshape,
                                      skip_output_reshape=skip_output_reshape)
    options = {"optimized_attention_override": route.make_override("dit")}
    f = None if mask is None else (mask if mask.dtype == torch.bool else mask.float())
    with lib_attn.recording() as rec:
        out = attention.optimized_attention(q.float(), k.float(), v.float(), heads, f, skip_reshape=skip_reshape,
                                            skip_output_reshape=skip_output_reshape, transformer_options=options)
    assert out.shape == ref.shape and rel_err(out, ref) <= FP32
    assert rec.calls == {("dit", "sdpa"): 1}


def _declining_override(previous, taken):
    """An override as ComfyUI's Model Sparse Attention node puts one on a model: it serves the calls it
    takes with its own kernel (here, self-attention, on ComfyUI's PyTorch attention; counted in ``taken``)
    and sends the others to the override that was there before it, or to ComfyUI's function."""
    from comfy.ldm.modules import attention

    def override(func, q, k, v, heads, *args, **kwargs):
        if q.shape == k.shape:
            taken.append(tuple(q.shape))
            return attention.attention_pytorch(q, k, v, heads, *args, **kwargs)
        if previous is not None:
            return previous(func, q, k, v, heads, *args, **kwargs)
        return func(q, k, v, heads, *args, **kwargs)
    return override


def test_an_override_put_on_after_the_node_sends_what_it_declines_to_the_engine(comfy_factory):
    _, nodes = loaded(comfy_factory)
    original = unet_patcher()
    ref = sample(original)
    (routed,) = node(nodes, "FlashAttentionBackend", model=original, tune="auto", **BACKEND)
    options = routed.model_options["transformer_options"]
    taken = []
    options["optimized_attention_override"] = _declining_override(options["optimized_attention_override"], taken)
    with lib_attn.recording() as rec:
        out = sample(routed)
    assert rel_err(out, ref) <= FP32
    assert len(taken) == 2 and rec.calls == {("unet", "sdpa"): 2}   # self-attention its own, cross the engine's


def load_extras(name):
    """A file of ComfyUI's ``comfy_extras``, loaded as ComfyUI loads it (named by its path less ``.py``)."""
    import nodes
    path = os.path.join(os.path.dirname(os.path.realpath(nodes.__file__)), "comfy_extras", name + ".py")
    asyncio.run(nodes.load_custom_node(path, module_parent="comfy_extras"))   # its nodes: not in the double
    return sys.modules[os.path.splitext(path)[0]]


def test_comfyuis_sparse_node_before_the_node_keeps_its_place_and_declines_to_the_engine(comfy_factory):
    _, nodes = loaded(comfy_factory)
    sparse = load_extras("nodes_sparse_attention")
    original = unet_patcher()
    ref = sample(original)
    patch = sparse.SparseAttnPatch(min_tokens=1)
    sparse.install_override(patch, original.model_options["transformer_options"])
    (routed,) = node(nodes, "FlashAttentionBackend", model=original, tune="auto", **dict(BACKEND, backend="sdpa-math"))
    with lib_attn.recording() as rec:
        out = sample(routed)
    assert rel_err(out, ref) <= FP32
    assert len(patch.taken) == 2 and rec.calls == {("unet", "sdpa-math"): 2}   # self-attention its own, cross ours
    text = node(nodes, "FlashAttentionReport", images=out)["ui"]["text"]
    assert any("override put on before this node" in line and "make_attention_override.<locals>.override" in line
               and "not by this node's backend" in line for line in text), text
    (again,) = node(nodes, "FlashAttentionBackend", model=routed, tune="auto", **BACKEND)
    patch.taken.clear()
    with lib_attn.recording() as rec:
        sample(again)
    assert len(patch.taken) == 2 and rec.calls == {("unet", "sdpa"): 2}     # the node twice: the later wins, once


@pytest.mark.parametrize("first_fp32", ["auto", "cast"])
def test_the_node_twice_with_the_sparse_node_between_runs_as_the_later_node_says(comfy_factory, monkeypatch,
                                                                                first_fp32):
    """The first node's override stays under the sparse node's, which hands it the later node's engine
    function as ``func``: that function runs (its upcast where ComfyUI's own function upcasts, its fp32)."""
    _, nodes = loaded(comfy_factory)
    from comfy.ldm.modules import attention
    from host_attn import convention
    sparse = load_extras("nodes_sparse_attention")
    seen = []
    engine = lib_attn.attention
    monkeypatch.setattr(convention.lib_attn, "attention",
                        lambda q, k, v, **kw: seen.append((q.dtype, kw.get("fp32"))) or engine(q, k, v, **kw))
    (first,) = node(nodes, "FlashAttentionBackend", model=unet_patcher(), tune="auto", **dict(BACKEND, fp32=first_fp32))
    between = first.clone()
    sparse.install_override(sparse.SparseAttnPatch(min_tokens=10 ** 6), between.model_options["transformer_options"])
    (later,) = node(nodes, "FlashAttentionBackend", model=between, tune="auto", **BACKEND)
    (alone,) = node(nodes, "FlashAttentionBackend", model=unet_patcher(), tune="auto", **BACKEND)
    q, k, v = (torch.randn(1, 12, 64).bfloat16() for _ in range(3))
    for model in (later, alone):
        attention.attention_sub_quad(q, k, v, 4, attn_precision=torch.float32,
                                     transformer_options=model.model_options["transformer_options"])
    assert seen[0] == seen[1] and seen[0][0] == torch.float32


@pytest.mark.parametrize("put_on", ["ComfyUI's Model Attention Backend", "a patch node's own kernel"])
def test_an_override_with_a_kernel_of_its_own_before_the_node_is_replaced_and_said(comfy_factory, put_on):
    """ComfyUI's ``set_model_optimized_attention`` and KJNodes' Patch Sage Attention leave ``func`` unused:
    kept under the node, they would take every call and the node would choose nothing."""
    _, nodes = loaded(comfy_factory)
    from comfy.ldm.modules import attention
    original = unet_patcher()
    ran = []
    if put_on.startswith("ComfyUI"):
        original.set_model_optimized_attention(lambda *a, **kw: ran.append(1) or attention.attention_pytorch(*a, **kw))
    else:
        def own_kernel(func, *args, **kwargs):
            ran.append(1)
            return attention.attention_pytorch(*args, **kwargs)
        original.model_options["transformer_options"]["optimized_attention_override"] = own_kernel
    (routed,) = node(nodes, "FlashAttentionBackend", model=original, tune="auto", **dict(BACKEND, backend="sdpa-math"))
    with lib_attn.recording() as rec:
        out = sample(routed)
    assert not ran and rec.calls == {("unet", "sdpa-math"): 4}
    text = node(nodes, "FlashAttentionReport", images=out)["ui"]["text"]
    assert any("this node replaced it" in line for line in text), text


def test_text_encoders_keep_comfyuis_attention(comfy_factory):
    _, _ = loaded(comfy_factory, env={"ATTN_COMFY_ROUTE": "auto"})
    from comfy.ldm.modules import attention
    fn = attention.optimized_attention_for_device(torch.device("cpu"), small_input=True)
    q = torch.randn(1, 8, 32)
    with lib_attn.recording() as rec:
        fn(q, q, q, 4)
    assert fn is attention.attention_basic and not rec.calls


def test_strict_raises_into_the_sampler_and_the_configuration_comes_back(comfy_factory):
    _, nodes = loaded(comfy_factory)
    flash = {b.id: b for b in lib_attn.backends()}["flash-attn"]
    if flash.available:
        pytest.skip("flash-attn runs here")
    (routed,) = node(nodes, "FlashAttentionBackend", model=unet_patcher(), tune="auto",
                     **dict(BACKEND, backend="flash-attn", strict=True))
    before = lib_attn.config()
    with pytest.raises(lib_attn.AttentionFallbackError, match="flash-attn"):
        sample(routed)
    assert lib_attn.config() == before


# --- the VAE --------------------------------------------------------------------------------------------

def test_vae_route_and_a_later_graph_without_the_node(comfy_factory):
    _, nodes = loaded(comfy_factory)
    from comfy.ldm.wan.vae import AttentionBlock
    from comfy.sd import VAE
    torch.manual_seed(0)
    vae = VAE()
    block = vae.first_stage_model.mid_attn_1
    own = block.optimized_attention
    latent = torch.randn(1, 4, 8, 8)
    ref = vae.decode(latent)
    (routed,) = node(nodes, "FlashAttentionVAEBackend", vae=vae, **BACKEND)
    with lib_attn.recording() as rec:
        out = routed.decode(latent)
        routed.decode_tiled(latent)
    assert rel_err(out, ref) <= FP32 and rec.calls == {("vae", "sdpa"): 2}
    with lib_attn.recording() as rec:                                        # the cached VAE, no node
        again = vae.decode(latent)
    assert not rec.calls and rel_err(again, ref) <= 1e-12
    assert block.optimized_attention is own and "optimized_attention" in type(block).__dict__
    from comfy_attn import route
    holder = torch.nn.Module()
    holder.mid_attn_1 = AttentionBlock(32)                                   # Wan's VAE blocks too
    (routed_wan,) = node(nodes, "FlashAttentionVAEBackend", vae=VAE(first_stage_model=holder), **BACKEND)
    with lib_attn.recording() as rec:
        routed_wan.encode(torch.randn(1, 2, 4, 4, 32))                        # (b, t, h, w, c) pixels
    assert rec.calls == {("vae", "sdpa"): 1}
    route.undo()
    assert "optimized_attention" not in type(block).__dict__ and block.optimized_attention is own


def test_chained_vae_nodes_the_last_wins_with_one_segment_per_decode(comfy_factory):
    comfy, nodes = loaded(comfy_factory)
    from comfy.sd import VAE
    vae = VAE()
    (first,) = node(nodes, "FlashAttentionVAEBackend", vae=vae, **dict(BACKEND, backend="math"))
    (last,) = node(nodes, "FlashAttentionVAEBackend", vae=first, **dict(BACKEND, backend="sdpa-math"))
    sent = len(comfy.server.sent)
    with lib_attn.recording() as rec:
        last.decode(torch.randn(1, 4, 8, 8))
    assert rec.calls == {("vae", "sdpa-math"): 1}
    assert [e for e, _, _ in comfy.server.sent[sent:]] == ["flash-attention.report"]   # one segment
    with lib_attn.recording() as rec:
        first.decode(torch.randn(1, 4, 8, 8))                                     # the first node's VAE keeps its own
    assert rec.calls == {("vae", "math"): 1}


def test_a_report_the_server_cannot_send_ends_neither_the_decode_nor_the_prompt(comfy_factory, monkeypatch, capsys):
    """ComfyUI's send_sync queues onto the server's event loop (call_soon_threadsafe), which raises once the loop
    is closed (shutdown): the decode still returns, and the log says the report did not go out."""
    comfy, nodes = loaded(comfy_factory)
    from comfy.sd import VAE
    (vae,) = node(nodes, "FlashAttentionVAEBackend", vae=VAE(), **dict(BACKEND, backend="math"))

    def closed(event, data, sid=None):
        raise RuntimeError("Event loop is closed")

    monkeypatch.setattr(comfy.server, "client_id", "client-1")
    monkeypatch.setattr(comfy.server, "send_sync", closed)
    with lib_attn.recording() as rec:
        out = vae.decode(torch.randn(1, 4, 8, 8))
    assert out is not None and rec.calls == {("vae", "math"): 1}
    assert "report not sent to the page: RuntimeError('Event loop is closed')" in capsys.readouterr().out


class _ModelLoader:
    """A checkpoint loader as a user's graph has one: the same model object for the same name."""
    loaded = {}

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"ckpt_name": (["tiny.safetensors"],)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load"

    def load(self, ckpt_name):
        if ckpt_name not in self.loaded:
            self.loaded[ckpt_name] = unet_patcher()
        return (self.loaded[ckpt_name],)


class _Sampler:
    """KSampler's place in the graph: a model in, latents out, each run recorded."""
    runs = []

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "steps": ("INT", {"default": 2})}}

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "run"

    def run(self, model, steps):
        with lib_attn.recording() as rec:
            latent = sample(model, steps=steps)
        self.runs.append(dict(rec.calls))
        return (latent,)


def test_a_changed_backend_node_runs_the_sampler_again_and_an_unchanged_graph_comes_from_the_cache(
        comfy_factory, monkeypatch):
    """ComfyUI keys each node's cached outputs on its inputs and on those of every node before it: a
    changed input of the Attention backend node changes the sampler's key, so the sampler runs again on
    the new kernels; the same graph again is served from the cache, nothing running."""
    _, nodes = loaded(comfy_factory)
    import execution
    monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, "TestCheckpointLoader", _ModelLoader)
    monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, "TestSampler", _Sampler)
    monkeypatch.setattr(_Sampler, "runs", [])
    monkeypatch.setattr(_ModelLoader, "loaded", {})

    def prompt(**backend):
        return {"4": {"class_type": "TestCheckpointLoader", "inputs": {"ckpt_name": "tiny.safetensors"}},
                "10": {"class_type": "FlashAttentionBackend",
                       "inputs": {"model": ["4", 0], **BACKEND, "tune": "auto", **backend}},
                "3": {"class_type": "TestSampler", "inputs": {"model": ["10", 0], "steps": 2}}}

    cache = {}
    first, ran = execution.run_prompt(prompt(backend="sdpa-math"), cache)
    assert ran == ["4", "10", "3"] and _Sampler.runs[-1] == {("unet", "sdpa-math"): 4}
    second, ran = execution.run_prompt(prompt(backend="sdpa"), cache)
    assert ran == ["10", "3"] and _Sampler.runs[-1] == {("unet", "sdpa"): 4}       # the loader from the cache
    third, ran = execution.run_prompt(prompt(backend="sdpa", schedule="0-50%: sdpa-math"), cache)
    assert ran == ["10", "3"] and _Sampler.runs[-1] == {("unet", "sdpa-math"): 2, ("unet", "sdpa"): 2}
    again, ran = execution.run_prompt(prompt(backend="sdpa"), cache)
    assert ran == [] and len(_Sampler.runs) == 3 and again["3"][0] is second["3"][0]


# --- the report ---------------------------------------------------------------------------------------------

def test_report_of_a_run_and_of_a_run_without_routed_calls(comfy_factory):
    comfy, nodes = loaded(comfy_factory)
    from comfy.sd import VAE
    (model,) = node(nodes, "FlashAttentionBackend", prompt_id="p1", model=unet_patcher(), tune="auto", **BACKEND)
    (vae,) = node(nodes, "FlashAttentionVAEBackend", prompt_id="p1", vae=VAE(), **BACKEND)
    latent = sample(model, prompt_id="p1")
    from comfy_execution.utils import CurrentNodeContext
    with CurrentNodeContext("p1", "8"):
        images = vae.decode(latent)
    result = node(nodes, "FlashAttentionReport", prompt_id="p1", images=images)
    assert result["result"][0] is images
    text = result["ui"]["text"]
    assert text[0].startswith("UNet: sdpa") and text[0].endswith("×4") and text[1].startswith("VAE: sdpa")
    assert text[1].endswith("×1") and text[2].startswith("time ")
    event, data, sid = comfy.server.sent[-1]
    assert event == "flash-attention.report" and data["text"] == text
    assert data["prompt_id"] == "p1" and sid == "client-1"                  # its prompt, to the page that queued it
    assert {(c["role"], c["backend"], c["count"]) for c in data["calls"]} == {("unet", "sdpa", 4), ("vae", "sdpa", 1)}
    assert [e for e, _, _ in comfy.server.sent].count("flash-attention.report") == 3   # sampling, decode, node
    other = VAE().decode(latent)                                            # ComfyUI's own VAE, no node
    later = node(nodes, "FlashAttentionReport", prompt_id="p2", images=other)
    assert later["ui"]["text"][0] == "ComfyUI's own attention, not through this extension"


def test_a_prompt_no_page_queued_sends_its_report_to_no_page(comfy_factory):
    comfy, nodes = loaded(comfy_factory)
    import execution
    cls = nodes.NODE_CLASS_MAPPINGS["FlashAttentionBackend"]
    (model,) = execution.execute(cls, dict(model=unet_patcher(), tune="auto", **BACKEND), prompt_id="api-1",
                                 client_id=None)                              # an API script's prompt
    sample(model, prompt_id="api-1")
    execution.execute(nodes.NODE_CLASS_MAPPINGS["FlashAttentionReport"], {"images": torch.zeros(1, 8, 8, 3)},
                      prompt_id="api-1", client_id=None)
    assert not [e for e, _, _ in comfy.server.sent if e == "flash-attention.report"]
    from comfy_attn import api
    assert api.status()["last_report"]["calls"][0]["count"] == 4           # the status route still has it


def test_report_on_images_from_the_cache_says_what_ran_when_they_were_made(comfy_factory):
    """A later prompt whose sampler and decode ComfyUI serves from its cache hands the report node the
    very images the earlier prompt made."""
    comfy, nodes = loaded(comfy_factory)
    from comfy.sd import VAE
    from comfy_execution.utils import CurrentNodeContext
    (model,) = node(nodes, "FlashAttentionBackend", prompt_id="p1", model=unet_patcher(), tune="auto", **BACKEND)
    (vae,) = node(nodes, "FlashAttentionVAEBackend", prompt_id="p1", vae=VAE(), **BACKEND)
    with CurrentNodeContext("p1", "8"):
        images = vae.decode(sample(model, prompt_id="p1"))               # no report node in prompt p1
    sample(model, prompt_id="p2")                                            # p2 runs other work
    again = node(nodes, "FlashAttentionReport", prompt_id="p3", images=images)["ui"]["text"]
    assert again[0] == "UNet: sdpa torch " + torch.__version__ + " ×4"       # p1's calls, not p2's
    assert again[1].startswith("VAE: sdpa") and again[1].endswith("×1")
    assert "these images come from ComfyUI's cache" in again[-1] and "(prompt p1)" in again[-1]


@pytest.mark.parametrize("bid", ["fk-nan", "fk-nan3", "fk-drift", "fk-shape", "fk-writes"])
def test_a_faulty_kernel_on_the_node_gives_sdpas_image_and_the_report_says_so(comfy_factory, tmp_path, monkeypatch,
                                                                              bid):
    from lib_attn import tuning_file
    from tests import faulty_backends

    monkeypatch.setenv(tuning_file.ENV_DIR, str(tmp_path))
    tuning_file.forget_memory()
    comfy, nodes = loaded(comfy_factory)
    faulty_backends.register()
    try:
        (good,) = node(nodes, "FlashAttentionBackend", model=unet_patcher(), tune="auto",
                       **dict(BACKEND, backend="sdpa"))
        expected = sample(good, prompt_id="g0")
        (model,) = node(nodes, "FlashAttentionBackend", prompt_id="g1", model=unet_patcher(), tune="auto",
                        **dict(BACKEND, backend=bid))
        assert torch.equal(sample(model, prompt_id="g1"), expected)
        text = node(nodes, "FlashAttentionReport", prompt_id="g1", images=expected)["ui"]["text"]
        said = [line for line in text if line.startswith("guard: ")]  # one per call kind it was caught on
        assert said and all(s.startswith(f"guard: {bid}") and s.endswith("→ sdpa (recomputed)") for s in said)
    finally:
        faulty_backends.unregister()
        tuning_file.forget_memory()


def test_the_guard_input_off_and_a_bad_value(comfy_factory):
    _, nodes = loaded(comfy_factory)
    from tests import faulty_backends
    import execution

    faulty_backends.register()
    try:
        (model,) = node(nodes, "FlashAttentionBackend", model=unet_patcher(), tune="auto", guard="off",
                        **dict(BACKEND, backend="fk-nan"))
        assert sample(model, prompt_id="o1").isnan().all()
        cls = nodes.NODE_CLASS_MAPPINGS["FlashAttentionBackend"]
        assert cls.INPUT_TYPES()["optional"]["guard"][0] == ["on", "full", "off"]
        values = dict(model=unet_patcher(), tune="auto", guard="sometimes", **BACKEND)
        ok, errors = execution.validate(cls, values)
        assert not ok and "'sometimes' not in ['on', 'full', 'off']" in errors[0]["details"]
        with pytest.raises(ValueError, match="guard 'sometimes' is not one of on, full, off"):
            execution.execute(cls, values)
    finally:
        faulty_backends.unregister()


# --- the global route and ComfyUI's own flags -------------------------------------------------------------

def test_global_route_reaches_every_model_and_vae_and_undoes(comfy_factory, capsys):
    _, nodes = loaded(comfy_factory, env={"ATTN_COMFY_ROUTE": "auto"})
    from comfy.ldm.flux import math as flux_math
    from comfy.ldm.modules import attention
    from comfy.sd import VAE
    chosen = attention.attention_sub_quad
    assert flux_math.optimized_attention is not chosen and attention.optimized_attention is not chosen
    assert flux_math.optimized_attention.__wrapped__.__name__ == "lib_attn_dit_attention"
    assert "ATTN_COMFY_ROUTE=auto: every model's attention runs on this extension's engine" in capsys.readouterr().out
    original = unet_patcher()
    with lib_attn.recording() as rec:
        sample(original, prompt_id="g1")
        VAE().decode(torch.randn(1, 4, 8, 8))
    assert rec.calls == {("unet", "sdpa"): 4, ("vae", "sdpa"): 1}
    (routed,) = node(nodes, "FlashAttentionBackend", prompt_id="g1", model=original, tune="auto",
                     **dict(BACKEND, backend="sdpa-math"))
    with lib_attn.recording() as rec:
        sample(routed, prompt_id="g1")
    assert rec.calls == {("unet", "sdpa-math"): 4}                           # the node's override still rules
    from comfy_attn import route
    route.undo()
    assert flux_math.optimized_attention is chosen and attention.optimized_attention is chosen


def test_unknown_id_in_the_switch_is_said_and_nothing_is_rebound(comfy_factory, capsys):
    _, _ = loaded(comfy_factory, env={"ATTN_COMFY_ROUTE": "flash-atn"})
    from comfy.ldm.modules import attention
    assert attention.optimized_attention is attention.attention_sub_quad
    out = capsys.readouterr().out
    assert "ATTN_COMFY_ROUTE='flash-atn': unknown backend id 'flash-atn'" in out and "No global route" in out


def test_comfyuis_flash_flag_without_the_package(comfy_factory, capsys):
    if {b.id: b for b in lib_attn.backends()}["flash-attn"].available:
        pytest.skip("flash-attn is installed here")
    _, _ = loaded(comfy_factory, argv=("--cpu", "--use-flash-attention"))
    from comfy.ldm.modules import attention
    out = capsys.readouterr().out
    assert "--use-flash-attention: flash_attn is not installed" in out
    assert "--use-flash-attention: every model's attention runs on this extension's engine (flash-attn first" in out
    assert lib_attn.config().preference["unet"] == ("flash-attn",)
    with lib_attn.recording() as rec:
        sample(unet_patcher(), prompt_id="f1")
    flash = {b.id: b for b in lib_attn.backends()}["flash-attn"]
    assert rec.calls == {("unet", "sdpa"): 4}
    assert rec.fallbacks == {("unet", "flash-attn", f"not available: {flash.reason}"): 4}
    assert attention.optimized_attention is not attention.attention_flash


def test_without_this_package_comfyuis_flag_stops_it(comfy_factory):
    if {b.id: b for b in lib_attn.backends()}["flash-attn"].available:
        pytest.skip("flash-attn is installed here")
    comfy_factory(argv=("--cpu", "--use-flash-attention"), prestartup=False)
    with pytest.raises(SystemExit):
        import comfy.ldm.modules.attention  # noqa: F401


# --- the status route -------------------------------------------------------------------------------------

def test_status_route_on_comfyuis_server(comfy_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("LIB_ATTN_CACHE_DIR", str(tmp_path / "private-folder"))
    comfy, nodes = loaded(comfy_factory)
    from aiohttp.test_utils import TestClient, TestServer
    (model,) = node(nodes, "FlashAttentionBackend", model=unet_patcher(), tune="auto", **BACKEND)
    sample(model, prompt_id="s1")
    comfy.server.add_routes()

    async def fetch():
        async with TestClient(TestServer(comfy.server.app)) as client:
            response = await client.get("/flash-attention/v1/status")
            return response.status, await response.json()

    status, body = asyncio.run(fetch())
    assert status == 200
    assert set(body) == {"availability", "routing", "tuning", "guard", "last_report"}
    assert body["guard"] == {"mode": "on", "rejected": []}
    assert body["last_report"]["calls"] == [{"role": "unet", "backend": "sdpa", "kernel": body["last_report"]["calls"][0]["kernel"],
                                             "count": 4, "tuned": False}]
    assert body["last_report"]["text"][0].startswith("UNet: sdpa")
    assert body["tuning"]["file"] == "tuning.json" and "private-folder" not in json.dumps(body)
    assert body["routing"]["routed"] is False and "Attention backend" in body["routing"]["hint"]


def test_fallback_line_names_every_backend_passed_over_and_what_ran(comfy_factory):
    _, nodes = loaded(comfy_factory)
    infos = {b.id: b for b in lib_attn.backends()}
    if infos["flash-attn"].available or infos["sdpa-cudnn"].available:
        pytest.skip("flash-attn or cuDNN attention runs here")
    (model,) = node(nodes, "FlashAttentionBackend", prompt_id="c1", model=unet_patcher(), tune="auto",
                    **dict(BACKEND, chain="flash-attn, sdpa-cudnn"))
    sample(model, prompt_id="c1")
    text = node(nodes, "FlashAttentionReport", prompt_id="c1", images=torch.zeros(1, 8, 8, 3))["ui"]["text"]
    (line,) = [t for t in text if t.startswith("fallback ")]
    assert line.startswith(f"fallback UNet flash-attn ×4: not available: {infos['flash-attn'].reason}; ")
    assert f"; then sdpa-cudnn: not available: {infos['sdpa-cudnn'].reason}" in line and line.endswith("; ran sdpa")


# --- schedules ------------------------------------------------------------------------------------------

WINDOWS = "0-50%: sdpa; 50-100%: math"


def in_window(steps, lo, hi):
    """How many of ``steps`` sampler steps fall in the window [lo, hi) of the fraction of steps done."""
    return sum(1 for i in range(steps) if lo <= i / steps < hi)


@pytest.mark.parametrize("make,role,per_step", [(unet_patcher, "unet", 2), (flux_patcher, "dit", 1)])
@pytest.mark.parametrize("steps", [2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_schedule_windows_count_per_step_and_give_the_unscheduled_image(comfy_factory, make, role, per_step, steps,
                                                                        dtype):
    _, nodes = loaded(comfy_factory)
    ref = sample(make(), steps=steps, dtype=torch.float64)                    # ComfyUI's own attention, float64
    bound = 8 * torch.finfo(dtype).eps                                         # measured: about 2 eps for each run
    (plain,) = node(nodes, "FlashAttentionBackend", model=make(), tune="auto", **BACKEND)
    (scheduled,) = node(nodes, "FlashAttentionBackend", model=make(), tune="auto", schedule=WINDOWS, **BACKEND)
    unscheduled = sample(plain, steps=steps, dtype=dtype)
    with lib_attn.recording() as rec:
        out = sample(scheduled, steps=steps, dtype=dtype)
    first, second = in_window(steps, 0, 0.5), in_window(steps, 0.5, 1)
    assert rec.rules == {(WINDOWS, "0-50%", role, "sdpa"): first * per_step,
                         (WINDOWS, "50-100%", role, "math"): second * per_step}
    assert sum(rec.rules.values()) == sum(rec.calls.values()) == steps * per_step
    assert out.dtype == dtype and rel_err(unscheduled, ref) <= bound and rel_err(out, ref) <= bound
    assert lib_attn.config().schedule is None                                  # the node's schedule ends with its run
    from lib_attn.schedule import where
    assert where.progress is None and where.block is None


def test_the_step_is_told_once_per_model_call_from_comfyuis_sigmas(comfy_factory, monkeypatch):
    _, nodes = loaded(comfy_factory)
    from lib_attn import schedule
    told = []
    real = schedule.at_step
    monkeypatch.setattr(schedule, "at_step", lambda *a, **k: (told.append(a), real(*a, **k)))
    (plain,) = node(nodes, "FlashAttentionBackend", model=unet_patcher(), tune="auto", **BACKEND)
    sample(plain, steps=3)
    assert told == []                                                          # no schedule: nothing read
    (model,) = node(nodes, "FlashAttentionBackend", model=unet_patcher(), tune="auto", schedule=WINDOWS, **BACKEND)
    with lib_attn.recording() as rec:
        sample(model, steps=3)
    sigmas = torch.linspace(1.0, 0.1, 4).tolist()
    assert [(i, n) for i, n, _ in told] == [(0, 3), (1, 3), (2, 3)]            # 2 attention calls each
    assert [s for _, _, s in told] == pytest.approx(sigmas[:3])
    assert sum(rec.calls.values()) == 6


def test_step_of_a_sigma_between_two_of_the_samplers(comfy_factory):
    from comfy_attn.steps import step_of
    values = torch.linspace(14.6, 0.0, 11).tolist()                            # 10 steps
    assert [step_of(v, values) for v in values[:-1]] == list(range(10))
    assert step_of((values[3] + values[4]) / 2, values) == 3                   # a second evaluation in step 3
    assert step_of(values[0] * 1.2, values) == 0 and step_of(1e-3, values) == 9


def test_block_rules_follow_comfyuis_unet_blocks(comfy_factory):
    """ComfyUI's UNet runs a block's layers one by one; block rules still see where they run."""
    _, nodes = loaded(comfy_factory)
    patcher = unet_patcher()
    unet = patcher.model.diffusion_model
    text = "blocks 0-2: math"                                                  # self-attention: input block 1
    (model,) = node(nodes, "FlashAttentionBackend", model=patcher, tune="auto", schedule=text, **BACKEND)
    with lib_attn.recording() as rec:
        sample(model, steps=2)
    assert rec.rules == {(text, "blocks 0-2", "unet", "math"): 2, (text, "otherwise", "unet", "sdpa"): 2}
    assert not any(m._forward_pre_hooks for m in unet.modules())              # the hooks go with the sampling


@pytest.mark.parametrize("text,words", [
    ("0-50%: sdpa; 50-100%: flahs", ["schedule rule 2 ('50-100%: flahs')", "unknown backend id 'flahs'",
                                     "valid ids", "sdpa-math"]),
    ("0-150%: sdpa", ["schedule rule 1", "'0-150%'", "within 0-100%"]),
    ("0-50% sdpa", ["schedule rule 1", "no ':'", "example"]),
])
def test_a_bad_schedule_is_refused_before_the_graph_runs_and_when_the_node_runs_naming_it(comfy_factory, text, words):
    _, nodes = loaded(comfy_factory)
    import execution
    cls = nodes.NODE_CLASS_MAPPINGS["FlashAttentionBackend"]
    values = dict(model=None, tune="auto", guard="on", schedule=text, **BACKEND)
    ok, errors = execution.validate(cls, values)                               # before the graph runs
    assert not ok and all(all(w in e["details"] for w in words) for e in errors)
    before = lib_attn.config()
    with pytest.raises(ValueError) as raised:                                  # the API may skip the page
        execution.execute(cls, dict(values, model=unet_patcher()))
    assert all(w in str(raised.value) for w in words) and lib_attn.config() == before


def test_a_schedule_linked_from_another_node_is_checked_when_the_node_runs(comfy_factory):
    _, nodes = loaded(comfy_factory)
    cls = nodes.NODE_CLASS_MAPPINGS["FlashAttentionBackend"]
    assert cls.VALIDATE_INPUTS(chain=None, schedule=None) is True             # ComfyUI gives None for a link
    assert cls.INPUT_TYPES()["optional"]["schedule"][0] == "STRING"
    assert "0-20%: sdpa" in cls.INPUT_TYPES()["optional"]["schedule"][1]["tooltip"]


def test_a_graph_saved_without_the_schedule_input_still_runs(comfy_factory):
    _, nodes = loaded(comfy_factory)
    (model,) = node(nodes, "FlashAttentionBackend", model=unet_patcher(), tune="auto", **BACKEND)  # no schedule
    with lib_attn.recording() as rec:
        sample(model, steps=2)
    assert rec.calls == {("unet", "sdpa"): 4} and not rec.rules


def test_the_report_says_the_calls_per_rule(comfy_factory):
    comfy, nodes = loaded(comfy_factory)
    (model,) = node(nodes, "FlashAttentionBackend", prompt_id="r1", model=unet_patcher(), tune="auto",
                    schedule=WINDOWS, **BACKEND)
    sample(model, prompt_id="r1", steps=4)
    text = node(nodes, "FlashAttentionReport", prompt_id="r1", images=torch.zeros(1, 8, 8, 3))["ui"]["text"]
    assert text[0].startswith("UNet: ") and text[0].endswith("×4")             # sdpa ×4, math ×4
    assert text[1] == "Attention schedule: 0–50%: sdpa ×4 · 50–100%: math ×4"
    event, data, _ = comfy.server.sent[-1]
    assert event == "flash-attention.report" and data["text"] == text
    assert data["schedule"] == WINDOWS
    assert sum(r["count"] for r in data["rules"]) == sum(c["count"] for c in data["calls"]) == 8
    assert {(r["rule"], r["backend"]) for r in data["rules"]} == {("0-50%", "sdpa"), ("50-100%", "math")}


def test_default_schedule_from_the_environment_for_the_global_route_and_empty_nodes(comfy_factory, capsys,
                                                                                    monkeypatch):
    _, nodes = loaded(comfy_factory, env={"ATTN_COMFY_ROUTE": "auto", "ATTN_COMFY_SCHEDULE": WINDOWS})
    assert f"ATTN_COMFY_SCHEDULE: default schedule {WINDOWS!r}" in capsys.readouterr().out
    from lib_attn import schedule
    told = []
    real = schedule.at_step
    monkeypatch.setattr(schedule, "at_step", lambda *a, **k: (told.append(a[:2]), real(*a, **k)))
    with lib_attn.recording() as rec:                                          # no node: the global route
        sample(unet_patcher(), prompt_id="e1", steps=4)
    assert rec.rules == {(WINDOWS, "0-50%", "unet", "sdpa"): 4, (WINDOWS, "50-100%", "unet", "math"): 4}
    assert told == [(i, 4) for i in range(4)]                                 # once per model call
    (inherits,) = node(nodes, "FlashAttentionBackend", model=unet_patcher(), tune="auto", **BACKEND)
    (off,) = node(nodes, "FlashAttentionBackend", model=unet_patcher(), tune="auto", schedule="off", **BACKEND)
    with lib_attn.recording() as rec:
        sample(inherits, prompt_id="e2", steps=2)
    assert rec.rules == {(WINDOWS, "0-50%", "unet", "sdpa"): 2, (WINDOWS, "50-100%", "unet", "math"): 2}
    with lib_attn.recording() as rec:
        sample(off, prompt_id="e3", steps=2)
    assert rec.calls == {("unet", "sdpa"): 4} and not rec.rules
    assert lib_attn.config().schedule.text == WINDOWS                          # still the default afterwards


def test_a_bad_default_schedule_is_said_at_startup_and_not_used(comfy_factory, capsys):
    bad = "0-50%: sdpa; 50-100% math"
    _, _ = loaded(comfy_factory, env={"ATTN_COMFY_ROUTE": "auto", "ATTN_COMFY_SCHEDULE": bad})
    out = capsys.readouterr().out
    assert f"ATTN_COMFY_SCHEDULE={bad!r}: schedule rule 2 ('50-100% math'): no ':'" in out
    assert "No default schedule" in out and "every model's attention runs on this extension's engine" in out
    assert lib_attn.config().schedule is None
    with lib_attn.recording() as rec:
        sample(unet_patcher(), prompt_id="b1", steps=2)
    assert rec.calls == {("unet", "sdpa"): 4} and not rec.rules


# --- calls ComfyUI keeps off 8-bit kernels, and the precision ComfyUI's own function runs in ----------------

def heads_inputs(heads=4, d=16, n=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, heads * d, generator=gen, dtype=torch.float64) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.view(1, n, heads, d).transpose(1, 2) for t in (q, k, v))).transpose(1, 2).reshape(1, n, heads * d)
    return (q.float(), k.float(), v.float()), ref


def test_sage_as_the_global_route_keeps_low_precision_false_calls_exact(comfy_factory, sage_on_cpu):
    from lib_attn.kernels.base import EXACT_ASKED
    _, _ = loaded(comfy_factory, argv=("--cpu", "--use-sage-attention"))
    from comfy.ldm.modules import attention
    assert lib_attn.config().preference["unet"] == ("sage",)
    (q, k, v), ref = heads_inputs()
    with lib_attn.recording() as rec:
        exact = attention.optimized_attention(q, k, v, 4, low_precision_attention=False)   # as Hunyuan3D 2.1 asks
        quantised = attention.optimized_attention(q, k, v, 4)
    assert rel_err(exact, ref) <= FP32 and rel_err(quantised, ref) <= FP32
    assert rec.calls == {("unet", "sdpa"): 1, ("unet", "sage"): 1}
    assert rec.fallbacks == {("unet", "sage", EXACT_ASKED): 1}


def test_sage_on_the_node_keeps_low_precision_false_calls_exact(comfy_factory, sage_on_cpu):
    from lib_attn.kernels.base import EXACT_ASKED
    _, nodes = loaded(comfy_factory)
    from comfy.ldm.modules import attention
    (routed,) = node(nodes, "FlashAttentionBackend", prompt_id="x1", model=unet_patcher(), tune="auto",
                     **dict(BACKEND, backend="sage"))
    options = routed.model_options["transformer_options"]
    (q, k, v), ref = heads_inputs()
    from comfy_attn import run
    from comfy_execution.utils import CurrentNodeContext
    # What the node's sampling wrapper puts in force while its model samples.
    with CurrentNodeContext("x1", "3"), run.segment({"preference": {"unet": ("sage",)}}), lib_attn.recording() as rec:
        for low in (False, True):
            out = attention.optimized_attention(q, k, v, 4, transformer_options=options, low_precision_attention=low)
            assert rel_err(out, ref) <= FP32
    assert rec.calls == {("unet", "sdpa"): 1, ("unet", "sage"): 1}
    assert rec.fallbacks == {("unet", "sage", EXACT_ASKED): 1}
    text = node(nodes, "FlashAttentionReport", prompt_id="x1", images=torch.zeros(1, 8, 8, 3))["ui"]["text"]
    assert any(line.startswith(f"fallback UNet sage ×1: {EXACT_ASKED}") for line in text), text


@pytest.mark.parametrize("fp32,comfy_function,dtype_seen", [
    ("auto", "attention_pytorch", torch.bfloat16),      # ComfyUI's GPU function does not upcast: nor does the node
    ("auto", "attention_sage", torch.bfloat16),
    ("auto", "attention_sub_quad", torch.float32),      # ComfyUI's CPU function upcasts: so does the node
    ("auto", "attention_basic", torch.float32),
    ("keep", "attention_pytorch", torch.float32),       # the node's fp32 setting forces fp32
])
def test_fp32_precision_runs_as_comfyuis_own_function_would(comfy_factory, monkeypatch, fp32, comfy_function,
                                                           dtype_seen):
    _, nodes = loaded(comfy_factory)
    from comfy.ldm.modules import attention
    from host_attn import convention
    seen = []
    engine = lib_attn.attention

    def spy(q, k, v, **kwargs):
        seen.append((q.dtype, kwargs["fp32"]))
        return engine(q, k, v, **kwargs)

    monkeypatch.setattr(convention.lib_attn, "attention", spy)
    (routed,) = node(nodes, "FlashAttentionBackend", model=unet_patcher(), tune="auto", **dict(BACKEND, fp32=fp32))
    options = routed.model_options["transformer_options"]
    (q, k, v), ref = heads_inputs()
    func = getattr(attention, comfy_function)   # the function ComfyUI hands the override is the one it chose
    out = func(*(t.bfloat16() for t in (q, k, v)), 4, attn_precision=torch.float32, transformer_options=options,
               low_precision_attention=True)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) <= 2e-2
    assert seen == [(dtype_seen, None if fp32 != "auto" or dtype_seen != torch.float32 else "keep")]


def test_global_route_runs_fp32_calls_as_comfyuis_chosen_function(comfy_factory, monkeypatch):
    _, _ = loaded(comfy_factory, argv=("--cpu", "--use-pytorch-cross-attention"), env={"ATTN_COMFY_ROUTE": "auto"})
    from comfy.ldm.modules import attention
    from host_attn import convention
    assert attention.optimized_attention.__wrapped__.__name__ == "lib_attn_unet_attention"
    seen = []
    engine = lib_attn.attention
    monkeypatch.setattr(convention.lib_attn, "attention",
                        lambda q, k, v, **kw: seen.append(q.dtype) or engine(q, k, v, **kw))
    (q, k, v), _ = heads_inputs()
    attention.optimized_attention(q.half(), k.half(), v.half(), 4, attn_precision=torch.float32)
    assert seen == [torch.float16]


# --- families whose calls pass no transformer options -------------------------------------------------------

def family_patcher(module, cls, seed=0, **options):
    """ComfyUI's ``ModelPatcher`` over family ``module``'s model class ``cls`` (tiny), with ``options`` in its
    transformer options."""
    import importlib
    from comfy.model_base import BaseModel
    from comfy.model_patcher import ModelPatcher
    torch.manual_seed(seed)
    patcher = ModelPatcher(BaseModel(getattr(importlib.import_module(module), cls)()))
    patcher.model_options["transformer_options"].update(options)
    return patcher


def multitalk_patcher(seed=0):
    """Wan with MultiTalk's audio attention, as its nodes add it: an ``attn2_patch`` and the audio in the
    transformer options."""
    from comfy.ldm.wan.model_multitalk import MultiTalkCrossAttnPatch, SingleStreamAttention
    torch.manual_seed(seed)
    patch = MultiTalkCrossAttnPatch(torch.nn.ModuleList([SingleStreamAttention(32, 16, 4) for _ in range(2)]))
    return family_patcher("comfy.ldm.wan.model", "WanModel", seed, patches={"attn2_patch": [patch]},
                          audio_embeds=torch.randn(2, 5, 16), grid_sizes=(2, 8, 4))


class SAGUNet(torch.nn.Module):
    """A diffusion model whose middle self-attention the SAG node replaced with its own (``attn_and_record``
    of ComfyUI's SAG module, loaded from ``comfy_extras`` as ComfyUI loads it)."""

    def __init__(self):
        super().__init__()
        self.proj_in, self.to_qkv, self.proj_out = torch.nn.Linear(4, 32), torch.nn.Linear(32, 96), torch.nn.Linear(32, 4)

    def forward(self, x, timesteps=None, context=None, transformer_options={}, **kwargs):
        nodes_sag = sag_module()
        b, c, h, w = x.shape
        t = self.proj_in(x.flatten(2).transpose(1, 2))
        q, k, v = self.to_qkv(t).chunk(3, dim=-1)
        t = t + nodes_sag.attn_and_record(q, k, v, {"n_heads": 4, "attn_precision": None})
        return self.proj_out(t).transpose(1, 2).reshape(b, c, h, w)


def sag_patcher(seed=0):
    from comfy.model_base import BaseModel
    from comfy.model_patcher import ModelPatcher
    torch.manual_seed(seed)
    return ModelPatcher(BaseModel(SAGUNet()))


def sag_path():
    """Where ComfyUI's ``init_builtin_extra_nodes`` finds the SAG node: beside ``nodes.py``, resolved."""
    import nodes
    return os.path.join(os.path.dirname(os.path.realpath(nodes.__file__)), "comfy_extras", "nodes_sag.py")


def load_sag():
    import nodes
    asyncio.run(nodes.load_custom_node(sag_path(), module_parent="comfy_extras"))
    return sag_module()


def sag_module():
    """The SAG module, under the name ComfyUI's loader gives a file: its path less ``.py``."""
    return sys.modules[os.path.splitext(sag_path())[0]]


FAMILIES = {   # name: (patcher, attention calls per model call, calls of them that ask for exact attention)
    "PixArt": (lambda: family_patcher("comfy.ldm.pixart.pixartms", "PixArtMS"), 4, 0),
    "Hunyuan-DiT": (lambda: family_patcher("comfy.ldm.hydit.models", "HunYuanDiT"), 4, 0),
    "Ernie-Image": (lambda: family_patcher("comfy.ldm.ernie.model", "ErnieImageModel"), 2, 0),
    "ACE-Step 1.5": (lambda: family_patcher("comfy.ldm.ace.ace_step15", "AceStepDiTModel"), 4, 4),
    "Hunyuan3D 2.1": (lambda: family_patcher("comfy.ldm.hunyuan3dv2_1.hunyuandit", "HunYuanDiTPlain"), 4, 4),
    "Wan Animate": (lambda: family_patcher("comfy.ldm.wan.model_animate", "AnimateWanModel"), 3, 0),
    "MultiTalk": (multitalk_patcher, 4, 0),
    "SAG": (sag_patcher, 1, 0),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_call_of_a_family_that_passes_no_options_runs_through_the_node(comfy_factory, family):
    _, nodes = loaded(comfy_factory)
    load_sag()
    make, per_call, exact = FAMILIES[family]
    from comfy.ldm.modules import attention
    ref = sample(make(), steps=2)                                              # ComfyUI's own attention
    (routed,) = node(nodes, "FlashAttentionBackend", model=make(), tune="auto", **dict(BACKEND, backend="sdpa-math"))
    with lib_attn.recording() as rec:
        out = sample(routed, steps=2)
    assert rel_err(out, ref) <= FP32
    assert rec.calls == {("dit", "sdpa-math"): 2 * per_call}
    assert not rec.fallbacks                                                   # sdpa-math is exact: no call passed over
    with lib_attn.recording() as rec:                                          # the same model without the node
        sample(make(), steps=2)
    assert not rec.calls and attention.optimized_attention.comfy_function is attention.attention_sub_quad


@pytest.mark.parametrize("family", ["PixArt", "Wan Animate", "SAG"])
def test_a_schedule_takes_the_steps_of_calls_that_pass_no_options(comfy_factory, family):
    _, nodes = loaded(comfy_factory)
    load_sag()
    make, per_call, _ = FAMILIES[family]
    (scheduled,) = node(nodes, "FlashAttentionBackend", model=make(), tune="auto", schedule=WINDOWS, **BACKEND)
    with lib_attn.recording() as rec:
        sample(scheduled, steps=4)
    assert rec.rules == {(WINDOWS, "0-50%", "dit", "sdpa"): 2 * per_call, (WINDOWS, "50-100%", "dit", "math"): 2 * per_call}


@pytest.mark.parametrize("linked", [False, True])
def test_the_global_route_reaches_the_sag_module_and_gives_calls_without_options_no_step(comfy_factory, tmp_path,
                                                                                          linked):
    """As a UNet's (its role), also where ComfyUI is reached through a symbolic link (its loader names
    the SAG file by its resolved path, while the attention module's path is the link's)."""
    root = COMFY_ROOT
    if linked:
        root = str(tmp_path / "ComfyUI")
        os.symlink(COMFY_ROOT, root)
    comfy = comfy_factory(argv=("--cpu",), env={"ATTN_COMFY_ROUTE": "auto",
                                                "ATTN_COMFY_SCHEDULE": "0-50%: math; 50-100%: sdpa"}, root=root)
    nodes_sag = load_sag()                       # ComfyUI loads its comfy_extras before the custom nodes
    assert "nodes_sag" not in sys.modules
    assert comfy.load_node()
    assert nodes_sag.optimized_attention.comfy_function.__name__ == "attention_sub_quad"
    assert nodes_sag.optimized_attention.__wrapped__.__name__ == "lib_attn_unet_attention"
    rules = lib_attn.config().schedule.text
    with lib_attn.recording() as rec:
        sample(unet_patcher(), prompt_id="g1", steps=2)                   # steps 1-2 (2 calls each): math, sdpa
        q = torch.randn(1, 8, 32)
        nodes_sag.attn_and_record(q, q, q, {"n_heads": 4, "attn_precision": None})   # no options: no step
    assert rec.rules == {(rules, "0-50%", "unet", "math"): 2, (rules, "50-100%", "unet", "sdpa"): 2,
                         (rules, "otherwise", "unet", "sdpa"): 1}


class TemporalVAE(torch.nn.Module):
    """A VAE whose attention is ComfyUI's ``CrossAttention`` (SVD's temporal VAE decoder has such blocks):
    its calls reach the function the UNet's attention module holds."""

    def __init__(self):
        super().__init__()
        from comfy.ldm.modules.attention import CrossAttention
        self.attn = CrossAttention(4, heads=1, dim_head=4)

    def forward(self, x):
        b, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)
        return (t + self.attn(t)).transpose(1, 2).reshape(b, c, h, w)


GLOBAL_FAMILIES = {   # name: (patcher, role, attention calls per model call)
    "LTXV": (lambda: family_patcher("comfy.ldm.lightricks.model", "LTXVModel"), "dit", 4),
    "PixArt": (lambda: family_patcher("comfy.ldm.pixart.pixartms", "PixArtMS"), "dit", 4),
    "UNet": (unet_patcher, "unet", 2),
}


@pytest.mark.parametrize("family", list(GLOBAL_FAMILIES))
def test_under_the_global_route_each_model_call_serves_its_models_role_with_its_step(comfy_factory, family):
    """LTXV calls the UNet's attention module and PixArt passes no options: the model call running says
    the role (``dit:`` rules take them) and the step."""
    rules = "dit 0-50%: math; dit: sdpa-math; unet 0-50%: math; unet: sdpa"
    comfy = comfy_factory(argv=("--cpu",), env={"ATTN_COMFY_ROUTE": "auto", "ATTN_COMFY_SCHEDULE": rules})
    assert comfy.load_node()
    make, role, per_call = GLOBAL_FAMILIES[family]
    text = lib_attn.config().schedule.text
    with lib_attn.recording() as rec:
        sample(make(), prompt_id="g1", steps=4)
    later = "sdpa-math" if role == "dit" else "sdpa"
    assert rec.rules == {(text, f"0-50% {role}", role, "math"): 2 * per_call,
                         (text, role, role, later): 2 * per_call}, rec.rules


def test_roles_under_the_global_route_follow_what_the_module_serves(comfy_factory):
    _, nodes = loaded(comfy_factory, env={"ATTN_COMFY_ROUTE": "auto"})
    from comfy.sd import VAE
    torch.manual_seed(0)
    vae = VAE(first_stage_model=TemporalVAE())
    latent = torch.randn(1, 4, 8, 8)
    with lib_attn.recording() as rec:
        vae.decode(latent)                                    # the UNet attention module's function, in a VAE
        sample(unet_patcher(), prompt_id="r1")
    assert rec.calls == {("vae", "sdpa"): 1, ("unet", "sdpa"): 4}
    from comfy.cldm.cldm import OptimizedAttention
    with lib_attn.recording() as rec:
        OptimizedAttention(32, 4)(torch.randn(1, 8, 32))      # a UNet ControlNet's union block: the UNet's role
    assert rec.calls == {("unet", "sdpa"): 1}
    assert VAE.__dict__["decode"].__code__.co_name == "vae_pass" and VAE.decode.__qualname__ == "VAE.decode"
    (routed,) = node(nodes, "FlashAttentionVAEBackend", prompt_id="r1", vae=vae, **dict(BACKEND, backend="sdpa-math"))
    with lib_attn.recording() as rec:
        routed.decode(latent)                                 # a routed VAE: its node's configuration
    assert rec.calls == {("vae", "sdpa-math"): 1}
    from comfy_attn import route
    route.undo()
    with lib_attn.recording() as rec:
        vae.decode(latent)
    assert not rec.calls and VAE.__dict__["decode"].__code__.co_name == "decode"   # ComfyUI's own method again


def test_mochis_blocks_are_joint(comfy_factory):
    from lib_attn import schedule

    class AsymmDiTJoint(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Identity(), torch.nn.Identity()])

    class WanModel(AsymmDiTJoint):
        pass

    assert [joint for _, joint in schedule.block_modules(AsymmDiTJoint())] == [True, True]
    assert [joint for _, joint in schedule.block_modules(WanModel())] == [False, False]


# --- sparse attention ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,words", [
    ("sol, budget=1.5", ["sparse budget '1.5' is outside (0, 1]"]),
    ("sol, budget=abc", ["sparse budget 'abc' is not a number"]),
    ("sparsest", ["sparse method 'sparsest' is not one of auto, sol, block-sparse"]),
    ("block-sparse, min_tokens=0", ["sparse min_tokens '0' must be a whole number >= 1"]),
])
def test_bad_sparse_settings_are_refused_before_the_graph_runs_and_when_the_node_runs(comfy_factory, text, words):
    _, nodes = loaded(comfy_factory)
    import execution
    cls = nodes.NODE_CLASS_MAPPINGS["FlashAttentionBackend"]
    values = dict(model=None, tune="auto", guard="on", sparse=text, **BACKEND)
    ok, errors = execution.validate(cls, values)                               # before the graph runs
    assert not ok and all(all(w in e["details"] for w in words) for e in errors)
    before = lib_attn.config()
    with pytest.raises(ValueError) as raised:                                  # the API may skip the page
        execution.execute(cls, dict(values, model=unet_patcher()))
    assert all(w in str(raised.value) for w in words) and lib_attn.config() == before


def test_the_node_puts_its_sparse_settings_in_force_while_its_model_samples(comfy_factory, monkeypatch):
    _, nodes = loaded(comfy_factory)
    cls = nodes.NODE_CLASS_MAPPINGS["FlashAttentionBackend"]
    assert cls.VALIDATE_INPUTS(chain="", sparse="sol, budget=0.15") is True
    assert "sol" in cls.INPUT_TYPES()["optional"]["sparse"][1]["tooltip"]
    seen = []
    from comfy_attn import route
    real = route.run.segment

    def watching(config=None):
        seen.append(config.get("sparse") if config else None)
        return real(config)

    monkeypatch.setattr(route.run, "segment", watching)
    (model,) = node(nodes, "FlashAttentionBackend", model=unet_patcher(), tune="auto",
                    sparse="block-sparse, budget=0.1, min_tokens=4096", **BACKEND)
    (off,) = node(nodes, "FlashAttentionBackend", model=unet_patcher(), tune="auto", sparse="off", **BACKEND)
    with lib_attn.recording() as rec:
        sample(model, steps=2)
        sample(off, steps=2)
    assert seen[0].text == "block-sparse, budget=0.1, min_tokens=4096, topk=0.1, dense=0-20%; first 1"
    assert seen[1] == ""
    assert rec.calls == {("unet", "sdpa"): 8}                                  # short calls: dense, as without
    assert lib_attn.config().sparse is None                                    # the node's settings end with its run


def test_default_sparse_from_the_environment_and_a_bad_one_said_at_startup(comfy_factory, capsys):
    _, _ = loaded(comfy_factory, env={"ATTN_COMFY_SPARSE": "block-sparse, budget=0.2"})
    assert "ATTN_COMFY_SPARSE: default sparse 'block-sparse, budget=0.2, min_tokens=12288" in capsys.readouterr().out
    assert lib_attn.config().sparse.budget == 0.2
    lib_attn.reset()
    _, _ = loaded(comfy_factory, env={"ATTN_COMFY_SPARSE": "sol, min_tokens=-3"})
    out = capsys.readouterr().out
    assert "ATTN_COMFY_SPARSE='sol, min_tokens=-3': sparse min_tokens '-3' must be a whole number >= 1" in out
    assert "No default sparse" in out and lib_attn.config().sparse is None


class LocalAttentionDiT(torch.nn.Module):
    """A diffusion model whose one attention call is long self-attention with local structure (as a video
    model's: ``local_inputs`` on a 4×16×32 grid, 2,048 tokens), made as ComfyUI's models make it: through
    ComfyUI's module function with the transformer options, on ``(B, N, heads·d)``."""

    def __init__(self, heads=2, head_dim=32):
        super().__init__()
        from lib_attn.commands.bench.inputs import local_inputs
        self.heads = heads
        q, k, v = local_inputs(1, heads, (4, 16, 32), head_dim, torch.float32, torch.device("cpu"), seed=3)
        for name, t in zip("qkv", (q, k, v)):
            self.register_buffer(name, t.transpose(1, 2).reshape(1, t.shape[2], heads * head_dim).contiguous())

    def forward(self, x, timesteps=None, context=None, transformer_options={}, **kwargs):
        from comfy.ldm.modules import attention
        out = attention.optimized_attention(self.q, self.k, self.v, self.heads, transformer_options=transformer_options)
        return x + out.mean()


def test_a_sparse_call_through_the_node_is_taken_and_the_report_node_shows_its_readout(comfy_factory):
    _, nodes = loaded(comfy_factory)
    from comfy.model_base import BaseModel
    from comfy.model_patcher import ModelPatcher
    (model,) = node(nodes, "FlashAttentionBackend", model=ModelPatcher(BaseModel(LocalAttentionDiT())), tune="auto",
                    sparse="block-sparse, budget=0.15, min_tokens=1024, dense=none", **BACKEND)
    with lib_attn.recording() as rec:
        out = sample(model, steps=2)
    assert rec.calls == {("dit", "block-sparse"): 2} and rec.sparse.calls == 2
    assert rec.sparse.error_max() <= 0.15
    text = node(nodes, "FlashAttentionReport", images=out)["ui"]["text"]
    head = next(line for line in text if line.startswith("sparse ×2 (block-sparse, budget=0.15"))
    assert f"blocks kept {rec.sparse.kept_share():.0%}" in head and f"error max {rec.sparse.error_max():.1e}" in head
    assert "against budget 1.5e-01" in head
    assert any(line.startswith("sparse DiT block-sparse ") and "error max" in line for line in text), text


def test_below_min_tokens_the_report_counts_the_dense_calls_by_reason_and_the_image_is_unchanged(comfy_factory):
    comfy, nodes = loaded(comfy_factory)
    (short,) = node(nodes, "FlashAttentionBackend", prompt_id="s2", model=flux_patcher(), tune="auto",
                    sparse="block-sparse, min_tokens=4096", **BACKEND)
    same = sample(short, prompt_id="s2", steps=2)
    text = node(nodes, "FlashAttentionReport", prompt_id="s2", images=torch.zeros(1, 8, 8, 3))["ui"]["text"]
    assert "dense while sparse was on: DiT ×2 below min_tokens: 64 < 4096" in text, text
    event, data, _ = comfy.server.sent[-1]
    assert data["sparse"]["calls"] == 0 and data["sparse"]["dense"] == [
        {"role": "dit", "reason": "below min_tokens: 64 < 4096", "count": 2}]
    (dense,) = node(nodes, "FlashAttentionBackend", prompt_id="s3", model=flux_patcher(), tune="auto", sparse="off",
                    **BACKEND)
    assert torch.equal(same, sample(dense, prompt_id="s3", steps=2))           # the image without sparse
