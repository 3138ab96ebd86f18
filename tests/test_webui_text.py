"""Forge Neo's Flux tells the engine its text tokens while sparse attention is on (``webui_attn.routing.text``):
its double blocks from their ``img`` and ``txt``, its single blocks the model call's double blocks' text
over the joined sequence; the generation's ``Follower`` keeps the hooks on the running model."""
from __future__ import annotations

import types

import torch

import lib_attn
from engine_helpers import told_calls
from lib_attn import conditioning
from tests.doubles.fixtures import webui_factory  # noqa: F401
from webui_attn.routing import sampling, text




class NeoFlux(torch.nn.Module):
    """Neo's ``IntegratedFluxTransformer2DModel.inner_forward`` block loop, on the double's blocks: every
    double block as ``block(img=img, txt=txt, ...)``, then ``torch.cat((txt, img), 1)`` through the single
    blocks as ``block(img, ...)``."""

    def __init__(self, hidden=32, heads=2):
        import backend.nn.flux as flux
        super().__init__()
        self.double_blocks = torch.nn.ModuleList(flux.DoubleStreamBlock(hidden, heads) for _ in range(2))
        self.single_blocks = torch.nn.ModuleList(flux.SingleStreamBlock(hidden, heads) for _ in range(2))

    def forward(self, img, txt):
        for block in self.double_blocks:
            img, txt = block(img=img, txt=txt, pe=None)
        img = torch.cat((txt, img), 1)
        for block in self.single_blocks:
            img = block(img, pe=None)
        return img[:, txt.shape[1]:]


def test_neo_flux_blocks_tell_their_text_and_the_follower_keeps_them_on_the_running_model(webui_factory,
                                                                                           monkeypatch):
    webui = webui_factory("neo", argv=["--attention-pytorch"])
    webui.load_scripts()
    torch.manual_seed(0)
    model = NeoFlux()
    img, txt = torch.randn(1, 20, 32), torch.randn(1, 6, 32)
    shared = types.SimpleNamespace(sd_model=types.SimpleNamespace(forge_objects=types.SimpleNamespace(
        unet=types.SimpleNamespace(model=types.SimpleNamespace(diffusion_model=model)))))
    seen = told_calls(monkeypatch)
    follower = sampling.Follower(None, shared, text=True)       # sparse on, no dense window asks for a position
    params = types.SimpleNamespace(denoiser=None, sampling_step=0, total_sampling_steps=1, sigma=None)
    with torch.no_grad():
        follower.step(params)
        model(img, txt)
        follower.close()
        model(img, txt)                                          # hooks gone with the generation
    joint = conditioning.Text(6, 26, "first")
    assert seen == [(26, joint)] * 4 + [(26, None)] * 4
    assert lib_attn.schedule.position().progress is None        # no position told without a window
    # single blocks of a model call whose double blocks told nothing (none ran) are told nothing
    with text.told(model), torch.no_grad():
        model.single_blocks[0](torch.randn(1, 30, 32), pe=None)
    assert seen[-1] == (30, None)
