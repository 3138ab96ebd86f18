"""``host_attn.patching``: undo restores only what is still this project's, and leaves another extension's
wrapper put on after ours working (ours taken out from under it, or left as a pass-through)."""
import functools
import sys
import threading
import types

import torch

import lib_attn
from host_attn import patching
from host_attn.patching import Patches, Stored
from tests.doubles.fixtures import webui_factory  # noqa: F401


class Target:
    def method(self, x):
        return ("original", x)


def ours(self, x):
    return ("ours", x)


def _fresh():
    class Owner:
        def method(self, x):
            return ("original", x)
    return Owner


def test_undo_restores_what_still_holds_our_replacement():
    owner = _fresh()
    original = owner.__dict__["method"]
    patches = Patches("test")
    patches.patch(owner, "method", ours)
    assert owner().method(1) == ("ours", 1)
    assert patches.undo() == 1
    assert owner.__dict__["method"] is original and not patches.active


def test_a_wrapper_closing_over_ours_stays_and_calls_the_original(capsys):
    owner = _fresh()
    original = owner.__dict__["method"]
    patches = Patches("test")
    patches.patch(owner, "method", ours)
    below = owner.method  # another extension wraps what it finds, in a closure
    seen = []

    @functools.wraps(below)
    def theirs(self, x):
        seen.append(x)
        return below(self, x)

    owner.method = theirs
    assert owner().method(2) == ("ours", 2)
    patches.undo()
    assert owner.__dict__["method"] is theirs  # theirs kept
    assert owner().method(3) == ("original", 3) and seen == [2, 3]  # still working, on the original
    assert theirs.__wrapped__ is original
    said = capsys.readouterr().out
    assert "was wrapped again after this extension" in said and "theirs" in said and "calls the original" in said


def test_a_wrapper_reading_ours_from_a_module_global_or_the_owner_is_unwrapped_too():
    owner = _fresh()
    patches = Patches("test")
    patches.patch(owner, "method", ours)
    other = types.ModuleType("other_extension")
    sys.modules["other_extension"] = other
    try:
        exec("def theirs(self, x):\n    return ('theirs',) + saved(self, x)\n", vars(other))
        other.saved = owner.method  # a module-level "original"
        owner.method = other.theirs
        owner.orig_method = ours  # the owner-attribute pattern: CrossAttention.orig_forward = forward
        patches.undo()
        assert owner().method(4) == ("theirs", "original", 4)
        assert owner.orig_method is not ours
    finally:
        del sys.modules["other_extension"]


def test_a_wrapper_that_cannot_be_unwrapped_gets_a_pass_through(capsys):
    owner = _fresh()
    patches = Patches("test")
    work = []

    @patching.reads_passthrough
    def replacement(self, x):
        below = patching.passthrough(replacement)
        if below is not None:
            return below(self, x)
        work.append(x)
        return ("ours", x)

    patches.patch(owner, "method", replacement)
    holder = [owner.method]  # the other extension keeps ours in a list: no reference the walk can rewrite

    def theirs(self, x):
        return ("theirs",) + holder[0](self, x)

    owner.method = theirs
    patches.undo()
    assert owner.__dict__["method"] is theirs
    assert owner().method(5) == ("theirs", "original", 5) and work == []
    assert "left under it, passing every call to the original" in capsys.readouterr().out
    patches.patch(owner, "method", replacement)  # in force again when patched again
    assert patching.passthrough(replacement) is None
    assert owner().method(6) == ("ours", 6) and work == [6]
    patches.undo()


def test_a_host_reset_is_left_alone():
    owner = _fresh()
    original = owner.__dict__["method"]
    patches = Patches("test")
    patches.patch(owner, "method", ours)
    owner.method = original  # the host put its own back (A1111's undo_optimizations())
    patches.undo()
    assert owner.__dict__["method"] is original


def test_a_stored_descriptor_left_under_another_shows_the_hosts_value():
    class Block:
        def __init__(self):
            self.fn = "host"

    patches = Patches("test")
    patches.patch_stored(Block, "fn", "ours")
    block = Block()
    assert block.fn == "ours"
    ours_descriptor = Block.__dict__["fn"]

    class Theirs:  # another data descriptor, on top, that falls back to the one it replaced
        def __get__(self, obj, owner=None):
            return ours_descriptor.__get__(obj, owner) + "+theirs"

        def __set__(self, obj, value):
            ours_descriptor.__set__(obj, value)

    holder = Theirs()
    Block.fn = holder
    patches.undo()
    assert Block.__dict__["fn"] is holder
    assert block.fn == "host+theirs"


def test_threads_undoing_at_once_each_restore_once():
    owners = [_fresh() for _ in range(200)]
    originals = [o.__dict__["method"] for o in owners]
    for _ in range(20):
        patches = Patches("test")
        for owner in owners:
            patches.patch(owner, "method", ours)
        errors, counts = [], []
        barrier = threading.Barrier(4)

        def undo():
            barrier.wait()
            try:
                counts.append(patches.undo())
            except Exception as exc:  # noqa: BLE001 - the test reports any
                errors.append(exc)

        threads = [threading.Thread(target=undo) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and sum(counts) == len(owners)
        assert all(o.__dict__["method"] is m for o, m in zip(owners, originals))


# --- A1111: another extension's patch of an attention forward, put on after ours ---------------------------

def test_a1111_another_extensions_forward_wrapper_survives_our_undo(webui_factory, capsys):
    webui_factory("a1111").load_scripts()
    import ldm.modules.attention as la
    from modules import sd_hijack
    from webui_attn.routing import a1111
    before = la.CrossAttention.forward
    optimizer = next(o for o in sd_hijack.optimizers if a1111.is_ours(o) and o.webui_attn_entry.key == "auto")
    optimizer.apply()
    below = la.CrossAttention.forward
    assert below is not before
    seen = []

    def other_forward(self, x, context=None, mask=None, **kwargs):  # e.g. a token-merging extension
        seen.append(x.shape)
        return below(self, x, context=context, mask=mask, **kwargs)

    la.CrossAttention.forward = other_forward
    module = la.CrossAttention(64, None, 2, 32)
    x = torch.randn(1, 8, 64)
    with lib_attn.recording() as rec:
        module(x)
    assert sum(rec.calls.values()) == 1  # ours ran under theirs
    optimizer.undo()
    assert la.CrossAttention.forward is other_forward
    with lib_attn.recording() as rec:
        out = module(x)
    assert rec.calls == {} and len(seen) == 2  # theirs still runs, on what was there before ours
    assert torch.allclose(out, before(module, x), atol=1e-6)
    assert "was wrapped again after this extension" in capsys.readouterr().out
