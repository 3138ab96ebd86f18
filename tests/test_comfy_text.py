"""ComfyUI's joint blocks tell their text tokens to their joint attention calls while a model routed by the
Attention backend node samples with sparse attention on (``comfy_attn.text``): Flux's double blocks from
their ``txt`` and ``img``, its single blocks from the ``img_slice`` Flux puts in the options, SD3's MMDiT
blocks from their ``context`` and ``x``; every other call is told nothing."""
from __future__ import annotations

import pytest
import torch

import lib_attn
from engine_helpers import told_calls
from lib_attn import conditioning
from tests.doubles.comfy_fixtures import comfy_factory  # noqa: F401
from tests.test_comfy import BACKEND, loaded, node, sample


@pytest.fixture(autouse=True)
def fresh():
    lib_attn.reset()
    yield
    lib_attn.reset()




def _patcher(make):
    from comfy.model_base import BaseModel
    from comfy.model_patcher import ModelPatcher
    torch.manual_seed(0)
    return ModelPatcher(BaseModel(make()))


@pytest.mark.parametrize("family", ["flux", "mmdit"])
def test_joint_blocks_tell_their_text_first_to_their_joint_calls(comfy_factory, monkeypatch, family):
    _, nodes = loaded(comfy_factory)
    from comfy.ldm.flux.model import FluxBlocks
    from comfy.ldm.modules.diffusionmodules.mmdit import MMDiT
    make = FluxBlocks if family == "flux" else MMDiT
    seen = told_calls(monkeypatch)
    (model,) = node(nodes, "FlashAttentionBackend", model=_patcher(make), tune="auto",
                    sparse="block-sparse, min_tokens=1, dense=none", **BACKEND)
    with lib_attn.recording() as rec:
        sample(model, steps=2)                       # 64 image tokens (8×8), 7 text tokens
    joint = conditioning.Text(7, 71, "first")
    per_call = [(71, joint)] * 4 if family == "flux" else [(71, joint), (64, None), (71, joint)]
    assert seen == per_call * 2, seen                # two steps; SD3.5's image-only attention told nothing
    kinds = sorted({kind for _, _, kind, _ in rec.sparse.kinds})
    assert kinds == (["7 text tokens first"] if family == "flux" else ["7 text tokens first", "any"])
    assert conditioning.current(71) is None          # nothing told after the sampling


def test_without_sparse_attention_nothing_is_told(comfy_factory, monkeypatch):
    _, nodes = loaded(comfy_factory)
    from comfy.ldm.flux.model import FluxBlocks
    seen = told_calls(monkeypatch)
    (model,) = node(nodes, "FlashAttentionBackend", model=_patcher(FluxBlocks), tune="auto", sparse="off", **BACKEND)
    sample(model, steps=1)
    assert seen == [(71, None)] * 4
