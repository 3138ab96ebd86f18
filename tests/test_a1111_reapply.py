"""The extension's own entry ("Cross attention optimization" set to one of its entries) through what A1111 1.10.1
does whenever it re-applies an optimizer: ``apply_optimizations`` first runs ``undo_optimizations()``, which
resets the four forwards by assignment (``sd_hijack.py`` 103-110) and puts ldm's AttnBlock forward on sgm's
AttnBlock too (line 110 reuses the ldm variable), then calls the current optimizer's ``undo()`` (line 76),
which for this extension's entry is ``Patches.undo``. What A1111 reset is A1111's own doing, not another
extension's wrapper: undo says nothing of a wrapper, puts sgm's own forward back, and leaves no mark on the
extension's forwards.
"""
import pytest

gr = pytest.importorskip("gradio")

from tests.doubles.fixtures import webui_factory  # noqa: E402,F401
from tests.test_generation import AUTO_TITLE, _clean, start  # noqa: E402,F401
from webui_attn.routing import a1111, forwards  # noqa: E402
from host_attn import patching  # noqa: E402


def _sgm_own_forward():
    from modules import sd_hijack_optimizations as sho
    return sho.sgm_diffusionmodules_model_AttnBlock_forward


@pytest.mark.parametrize("then", ["sdp", "None"])
def test_leaving_the_entry_says_no_wrapper_and_puts_sgms_own_attnblock_back(webui_factory, capsys, then):
    start(webui_factory, optimization=AUTO_TITLE)
    import sgm.modules.diffusionmodules.model as sgm_model
    from modules import sd_hijack, shared
    assert sgm_model.AttnBlock.forward is forwards.attnblock_forward
    capsys.readouterr()
    # Settings → Optimizations → Cross attention optimization: the onchange runs redo_hijack
    shared.opts.cross_attention_optimization = (
        then if then == "None" else next(o.title() for o in sd_hijack.optimizers if o.name == then))
    sd_hijack.model_hijack.redo_hijack(shared.sd_model)
    out = capsys.readouterr().out
    assert "wrapped again" not in out
    assert patching.passthrough(forwards.attnblock_forward) is None
    if then == "None":
        # nothing applied after the reset: sgm's AttnBlock runs sgm's own forward, as before the entry
        assert sgm_model.AttnBlock.forward is _sgm_own_forward()
    else:
        assert sd_hijack.current_optimizer.name == then
    assert not a1111.patches.active


def test_a_reload_with_the_entry_chosen_says_no_wrapper(webui_factory, capsys):
    start(webui_factory, optimization=AUTO_TITLE)
    import sgm.modules.diffusionmodules.model as sgm_model
    from modules import sd_hijack, shared
    capsys.readouterr()
    for _ in range(2):   # each model load (refiner, hires checkpoint, the switch back) re-applies the entry
        sd_hijack.model_hijack.redo_hijack(shared.sd_model)
    assert "wrapped again" not in capsys.readouterr().out
    assert sgm_model.AttnBlock.forward is forwards.attnblock_forward
    assert a1111.patches.active and a1111.patches.intact()
