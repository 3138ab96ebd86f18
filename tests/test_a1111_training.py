"""A1111's Train tab through the extension (A1111 1.10.1 double): textual inversion and hypernetwork training
run the U-Net's CrossAttention through the engine, and get its gradients from the first step of each shape,
equal to A1111's own ``sdp`` forward's."""
import pytest
import torch

import lib_attn
from tests.doubles.fixtures import webui_factory  # noqa: F401
from webui_attn.routing import a1111

AUTO = "attn-auto - fastest available per call"


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def grads_of(fn, tensors):
    for t in tensors:
        t.grad = None
    out = fn()
    assert out.requires_grad and out.grad_fn is not None
    out.pow(2).mean().backward()
    return out.detach(), [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("what", ["textual inversion", "hypernetwork"])
@pytest.mark.parametrize("guard", ["on", "off", "full"])
def test_training_gets_gradients_from_the_first_step(webui_factory, what, guard):
    webui_factory("a1111").load_scripts()
    import ldm.modules.attention as ldm_attention
    from modules import sd_hijack, shared
    from modules import sd_hijack_optimizations as sho
    from modules.hypernetworks import hypernetwork

    assert sd_hijack.apply_optimizations(AUTO) == a1111.ENTRY_BY_KEY["auto"].name
    lib_attn.reset()
    lib_attn.configure(guard=guard)
    torch.manual_seed(0)
    module = ldm_attention.CrossAttention(64, 48, 2, 32).double().requires_grad_(False)  # the U-Net is frozen
    x = torch.randn(2, 16, 64, dtype=torch.float64)
    ctx = torch.randn(2, 7, 48, dtype=torch.float64)
    if what == "textual inversion":
        embedding = torch.randn(1, 2, 48, dtype=torch.float64, requires_grad=True)  # the trained vectors
        trained = [embedding]
        context = lambda: torch.cat([ctx[:, :5], embedding.expand(2, -1, -1)], dim=1)  # noqa: E731
    else:
        layers = (torch.nn.Linear(48, 48).double(), torch.nn.Linear(48, 48).double())
        shared.loaded_hypernetworks.append(hypernetwork.Hypernetwork(layers={48: layers}))
        trained = [p for layer in layers for p in layer.parameters()]
        context = lambda: ctx  # noqa: E731
    try:
        for step in range(2):  # the first step meets each shape for the first time
            with lib_attn.recording() as rec:
                got = grads_of(lambda: module(x, context=context()), trained)
            want = grads_of(lambda: sho.scaled_dot_product_attention_forward(module, x, context()), trained)
            assert rec.total("unet") == 1, step
            assert rel_err(got[0], want[0]) < 1e-10, step
            for g, w in zip(got[1], want[1]):
                assert rel_err(g, w) < 1e-10, (step, what)
    finally:
        shared.loaded_hypernetworks.clear()
