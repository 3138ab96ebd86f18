"""Every code example of README.md, docs/diffusers.md, docs/schedules.md and docs/sparse.md, run as the
page writes it (tiny models, offline, on the CPU), and what the page says it gives.

The fenced ``python`` blocks are taken from the pages and run whole. Each has a check below (``RUNS``)
that runs it and asserts what its page says; a block with no check fails the inventory test, so a new
example is run or listed, never skipped. The command lines of the other fenced blocks are run where
cheap (``python -m lib_attn doctor``) or listed in ``NOT_RUN`` with why.

Substituted, and only that (``_run``'s ``replace``, ``flux_pipeline``):

* **The pipeline.** The pages' ``pipe`` is FLUX.1-schnell loaded with ``FluxPipeline.from_pretrained``:
  the hub's weights are not here, and diffusers' ``FluxPipeline`` needs ``transformers`` (its text
  encoders), which the test environment does not install. ``FluxPipeline`` is replaced by
  ``TinyFluxPipeline``: a ``DiffusionPipeline`` with FLUX's denoiser and VAE classes (tiny, random
  weights) under FLUX's component names, FLUX's scheduler, and a call that samples as FLUX does
  (flow-matching Euler steps over the image tokens, then the VAE's decode). The text encoders it lacks
  are ones ``route`` never routes; the prompt's embeddings are drawn from the prompt.
* **The device.** ``.to("cuda")`` runs as ``.to("cpu")``.
* **The placeholders.** A page's ``...`` (your code here) is left as it is, except in the loop of
  docs/schedules.md, where it becomes a call of a tiny UNet: the loop exists to make those calls.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys

import pytest
import torch

import lib_attn
from engine_helpers import reference, rel_err
from lib_attn import schedule as sched
from lib_attn.integrations.diffusers import route

try:
    import diffusers
except Exception as exc:  # noqa: BLE001 - diffusers 0.35+ needs a newer torch than 2.1 (it reads torch.xpu)
    pytest.skip(f"diffusers does not import here: {type(exc).__name__}: {exc}", allow_module_level=True)
from diffusers import (AutoencoderKL, DiffusionPipeline, FlowMatchEulerDiscreteScheduler,  # noqa: E402
                       FluxTransformer2DModel, UNet2DConditionModel)
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ("README.md", "docs/diffusers.md", "docs/schedules.md", "docs/sparse.md")
#: Command lines of the pages' fenced blocks that the tests do not run, with why.
NOT_RUN = {
    "git clone <this repository's URL> extensions/sd-webui-flash-attention":
        "clones from the network into a webui; the webui tests install the extension from this tree",
    "pip install torch --index-url https://download.pytorch.org/whl/cpu": "downloads torch from the network",
    "pip install .": "installs into the environment; tests/test_install.py builds the package",
    "bash tools/run_bench.sh     # the CPU benchmark (python -m lib_attn bench); extra arguments go to it":
        "creates a virtual environment and benchmarks for minutes; tests/test_bench.py runs the bench",
    "bash tools/run_tests.sh     # the test suite (pytest); extra arguments go to pytest":
        "runs this test suite itself",
}
#: The first word of a line in a fenced block that makes it a command (the rest are printed output).
COMMANDS = ("pip ", "git ", "bash ", "python ")


def fenced(page: str) -> list[tuple[int, str, str]]:
    """(line, language, text) of each fenced block of ``page``."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        lines = f.read().splitlines()
    out, start, lang, body = [], None, "", []
    for n, line in enumerate(lines, 1):
        if line.startswith("```") and start is None:
            start, lang, body = n, line[3:].strip(), []
        elif line.startswith("```"):
            out.append((start, lang, "\n".join(body) + "\n"))
            start = None
        elif start is not None:
            body.append(line)
    return out


def python_blocks(page: str) -> list[str]:
    return [text for _, lang, text in fenced(page) if lang == "python"]


def command_lines(page: str) -> list[str]:
    return [line.strip() for _, lang, text in fenced(page) if lang != "python"
            for line in text.splitlines() if line.strip().startswith(COMMANDS)]


@pytest.fixture(autouse=True)
def fresh():
    lib_attn.reset()
    sched.leave()
    yield
    lib_attn.reset()
    sched.leave()


# --- the substitutes ---------------------------------------------------------------------------

class TinyFluxPipeline(DiffusionPipeline):
    """FLUX's denoiser, VAE and scheduler, tiny and random; see the module."""

    def __init__(self, transformer, vae, scheduler):
        super().__init__()
        self.register_modules(transformer=transformer, vae=vae, scheduler=scheduler)

    @classmethod
    def from_pretrained(cls, name, torch_dtype=torch.float32, **kwargs):
        torch.manual_seed(0)
        transformer = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                             attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                             pooled_projection_dim=32, axes_dims_rope=(4, 4, 8))
        vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                            up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64),
                            latent_channels=4, layers_per_block=1, norm_num_groups=32, sample_size=32)
        pipe = cls(transformer.eval(), vae.eval(), FlowMatchEulerDiscreteScheduler())
        pipe.set_progress_bar_config(disable=True)
        return pipe.to(torch_dtype)

    @torch.no_grad()
    def __call__(self, prompt: str, num_inference_steps: int = 28, side: int = 8):
        g = torch.Generator().manual_seed(len(prompt))
        dtype = self.transformer.dtype
        text = torch.randn(1, 7, 32, generator=g).to(dtype)
        pooled = torch.randn(1, 32, generator=g).to(dtype)
        latents = torch.randn(1, side * side, 4, generator=g).to(dtype)
        grid = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(float(side)), torch.arange(float(side)),
                                          indexing="ij"), -1).reshape(-1, 3)
        self.scheduler.set_timesteps(num_inference_steps)
        self.scheduler.set_begin_index(0)  # as FluxPipeline does
        for t in self.progress_bar(self.scheduler.timesteps):
            velocity = self.transformer(hidden_states=latents, encoder_hidden_states=text, pooled_projections=pooled,
                                        timestep=(t / 1000).expand(1).to(dtype), img_ids=grid,
                                        txt_ids=torch.zeros(7, 3), return_dict=False)[0]
            latents = self.scheduler.step(velocity, t, latents).prev_sample
        image = self.vae.decode(latents.transpose(1, 2).reshape(1, 4, side, side)).sample
        return ImagePipelineOutput(images=list((image / 2 + 0.5).clamp(0, 1).float()))


def tiny_unet():
    torch.manual_seed(1)
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32).eval()


@pytest.fixture
def flux_pipeline(monkeypatch):
    monkeypatch.setattr(diffusers, "FluxPipeline", TinyFluxPipeline)
    return TinyFluxPipeline.from_pretrained("black-forest-labs/FLUX.1-schnell")


def _run(code: str, namespace: dict | None = None, replace: dict | None = None) -> tuple[dict, str]:
    """Run one example (after the substitutions ``replace`` names, each of which must be found); returns
    its namespace and what it printed."""
    for old, new in (replace or {}).items():
        assert old in code, f"the example no longer holds {old!r}: update the substitution"
        code = code.replace(old, new)
    namespace = dict(namespace or {}, __name__="__docs_example__")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "<docs example>", "exec"), namespace)  # noqa: S102 - the docs' own examples
    return namespace, printed.getvalue()


def _roles_and_ids(calls: dict) -> set:
    assert calls and all(n > 0 for n in calls.values())
    assert all(bid in lib_attn.BACKEND_IDS for _, bid in calls)
    return {role for role, _ in calls}


# --- README.md ---------------------------------------------------------------------------------

def check_readme_route(code, flux_pipeline):
    # "pipe: a diffusers pipeline, e.g. FluxPipeline"
    ns, printed = _run(code, {"pipe": flux_pipeline})
    calls, fallbacks = printed.splitlines()
    assert calls == str(ns["rec"].calls) and fallbacks == str(ns["rec"].fallbacks)
    assert _roles_and_ids(ns["rec"].calls) == {"dit", "vae"}      # "{("dit", "flash-attn"): 228, ("vae", …): 1}"
    assert ns["rec"].fallbacks == {}                               # nothing here the engine did not take
    assert ns["image"].shape == (3, 16, 16)
    assert not any(type(m.processor).__name__.startswith("Routed") for m in flux_pipeline.transformer.modules()
                   if hasattr(m, "processor"))                    # "puts back exactly what was there on exit"


# --- docs/diffusers.md -------------------------------------------------------------------------

def check_diffusers_route(code, flux_pipeline):
    ns, printed = _run(code, replace={'.to("cuda")': '.to("cpu")'})
    lines = printed.splitlines()
    pipe, rec = ns["pipe"], ns["rec"]
    assert isinstance(pipe, TinyFluxPipeline) and pipe.transformer.dtype == torch.bfloat16
    assert lines[0] == str(ns["routing"].processors) and ns["routing"].processors == {"dit": 2, "vae": 2}
    assert lines[1] == str(rec.calls) and _roles_and_ids(rec.calls) == {"dit", "vae"}
    # 2 blocks x 4 steps of the DiT, the decoder's one VAE attention
    assert sum(n for (role, _), n in rec.calls.items() if role == "dit") == 8
    assert sum(n for (role, _), n in rec.calls.items() if role == "vae") == 1
    assert lines[2] == str(rec.fallbacks)
    readout = lines[3:]
    assert readout == lib_attn.readout.text(lib_attn.Report.from_recording(rec)).splitlines()
    (dit,) = [line for line in readout if line.startswith("DiT: ")]
    (vae,) = [line for line in readout if line.startswith("VAE: ")]
    assert dit.endswith(" ×8") and vae.endswith(" ×1")
    assert any(re.fullmatch(r"time [\d.]+ (s|ms)", line) for line in readout), readout
    assert lib_attn.config().preference["dit"] is None           # the second scope put back what it changed


def check_diffusers_schedule(code, flux_pipeline):
    ns, _ = _run(code, {"pipe": flux_pipeline, "prompt": "a lighthouse at dawn"})
    assert ns["image"].shape == (3, 16, 16)
    assert lib_attn.config().schedule is None                     # "the configuration is as before afterwards"
    with lib_attn.recording() as rec:                             # the same, counted
        _run(code, {"pipe": flux_pipeline, "prompt": "a lighthouse at dawn"})
    rules = {label: sum(n for (_, _), n in by.items()) for label, by in _rule_counts(rec).items()}
    # 30 steps, 2 DiT calls each: 6 steps in 0-20%, 18 in 20-80%, 6 in 80-100%; a DiT has no cross-attention
    assert rules == {"0-20%": 12, "20-80%": 36, "80-100%": 12, "vae": 1}, rules


def _rule_counts(rec) -> dict:
    out: dict = {}
    for (_, label, role, bid), n in rec.rules.items():
        out.setdefault(label, {})[(role, bid)] = n
    return out


# --- docs/schedules.md -------------------------------------------------------------------------

def check_schedules_loop(code, flux_pipeline):
    unet = tiny_unet()
    g = torch.Generator().manual_seed(3)
    sample, text = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 5, 32, generator=g)
    timesteps, sigmas = list(range(20)), [14.6 * (1 - i / 20) + 0.03 for i in range(20)]
    call = "        unet(sample, t, encoder_hidden_states=text)\n"
    # "your own code": a model whose attention calls the engine (here a diffusers UNet through route)
    with route(unet), lib_attn.recording() as rec:
        _run(code, {"unet": unet, "timesteps": timesteps, "sigmas": sigmas, "sample": sample, "text": text},
             replace={"        ...\n": call})
    rules = {label: sum(by.values()) for label, by in _rule_counts(rec).items()}
    # 20 steps of 8 attention calls (4 blocks' self- and cross-attention): 4, 12 and 4 steps in the windows
    assert rules == {"0-20%": 32, "20-80%": 96, "80-100%": 32}, rules
    assert sched.position().progress is None                      # schedule.leave(): no step known after


# --- docs/sparse.md ----------------------------------------------------------------------------

def check_sparse_settings(code, flux_pipeline):
    seen = []
    real = lib_attn.configure

    def configure(**kwargs):
        seen.append(real(**kwargs).sparse)
        return lib_attn.config()
    lines = code.splitlines()
    assert lines[-1].startswith('lib_attn.configure(sparse="off")')
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lib_attn, "configure", configure)
        _run(code)
    first, second, off = seen
    assert first == lib_attn.sparse.make("block-sparse")          # "every default below"
    assert first.text == "block-sparse, budget=0.15, min_tokens=12288, topk=0.1, dense=0-20%; first 1"
    assert second.text == "block-sparse, budget=0.2, min_tokens=16384, topk=0.1, dense=0-30%; first 2"
    assert off is None and lib_attn.config().sparse is None


def check_sparse_text(code, flux_pipeline):
    """A script tells a joint call's text tokens: the call kind names them and their rows are exact."""
    n = 512 + 1024
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 32, generator=g) for _ in range(3))
    settings = "block-sparse, budget=1, min_tokens=1024, topk=0.2, dense=none, calibrate=off"
    with lib_attn.use(sparse=settings), lib_attn.recording() as rec:
        namespace, _ = _run(code, {"q": q, "k": k, "v": v})
    kinds = [kind for _, _, kind, _ in lib_attn.Report.from_recording(rec).sparse.kinds]
    assert kinds == ["512 text tokens first"]
    assert rel_err(namespace["out"][:, :, :512], reference(q, k, v)[:, :, :512]) < 1e-5


#: Each python block of the pages, in order, and its check.
RUNS = {
    "README.md": [check_readme_route],
    "docs/diffusers.md": [check_diffusers_route, check_diffusers_schedule],
    "docs/schedules.md": [check_schedules_loop],
    "docs/sparse.md": [check_sparse_settings, check_sparse_text],
}


def test_every_python_example_of_the_pages_has_a_check_and_every_command_is_run_or_listed():
    for page in PAGES:
        assert len(python_blocks(page)) == len(RUNS[page]), f"{page}: a python example without a check, or a check without one"
        for line in command_lines(page):
            assert line in NOT_RUN or line.startswith(RUN_COMMANDS), f"{page}: command not run nor listed: {line}"


@pytest.mark.parametrize("page, index", [(page, i) for page in PAGES for i in range(len(RUNS[page]))])
def test_the_example_runs_and_gives_what_its_page_says(page, index, flux_pipeline):
    RUNS[page][index](python_blocks(page)[index], flux_pipeline)


#: Commands the pages give that run here in seconds.
RUN_COMMANDS = ("python -m lib_attn doctor",)


def test_the_doctor_command_lists_every_backend_with_the_sparse_ones():
    done = subprocess.run([sys.executable, "-m", "lib_attn", "doctor"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr
    for bid in (*lib_attn.BACKEND_IDS, *lib_attn.SPARSE_IDS):
        assert re.search(rf"^\s*{re.escape(bid)}\b", done.stdout, re.M), f"doctor lists no row for {bid}"
