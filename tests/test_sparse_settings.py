"""Sparse settings through configure()/use(): the text form, the defaults, what is refused and how, the dense
windows as schedule conditions (the position a host tells), and sparse backends kept out of chains."""
from __future__ import annotations

import pytest
import torch

import lib_attn
from lib_attn import schedule as sched
from lib_attn import sparse


@pytest.fixture(autouse=True)
def fresh():
    lib_attn.reset()
    yield
    lib_attn.reset()


def test_defaults_are_the_documented_ones():
    s = sparse.parse("block-sparse")
    assert (s.method, s.budget, s.min_tokens, s.topk, s.threshold, s.dense, s.calibrate) == \
        ("block-sparse", 0.15, 12288, 0.1, None, "0-20%; first 1", True)
    assert s.knob == lib_attn.Knob("topk", 0.1)
    assert [(w.steps, w.blocks) for w in s.windows] == [((0.0, 0.2), None), (None, ("first", 1))]
    assert sparse.parse(True) == sparse.make()


@pytest.mark.parametrize("text", [
    "block-sparse",
    "auto, budget=0.3, topk=0.1",
    "block-sparse, threshold=0.9, dense=0-10%; first 2; last 1",
    "block-sparse, min_tokens=4096, dense=none, calibrate=off",
    "block-sparse, budget=1, min_tokens=1, topk=1, dense=sigma 14-3; blocks 0-3",
])
def test_text_form_reads_back_to_equal_settings(text):
    s = sparse.parse(text)
    assert sparse.parse(s.text) == s
    assert sparse.parse({"method": s.method, "budget": s.budget, "min_tokens": s.min_tokens, "topk": s.topk,
                         "threshold": s.threshold, "dense": s.dense or "none", "calibrate": s.calibrate}) == s


def test_settings_that_differ_past_six_digits_keep_their_own_text_and_configuration():
    """The text writes every value exactly, so two different settings never share it, nor a configuration's
    canonical form (its cache key in InvokeAI, its dispatcher token)."""
    near = sparse.parse("block-sparse, budget=0.1500004, topk=0.2000001")
    plain = sparse.parse("block-sparse, budget=0.15, topk=0.2")
    assert near != plain and near.text != plain.text
    assert sparse.parse(near.text) == near and "budget=0.15," in plain.text and "topk=0.2," in plain.text
    first, second = lib_attn.Config(sparse=near), lib_attn.Config(sparse=plain)
    assert first.canonical != second.canonical and first.token != second.token
    steps = [sched.parse(f"{lo}-50%: sdpa-math").text for lo in ("10", "10.0000001")]
    assert steps[0] == "10-50%: sdpa-math" and steps[1] != steps[0] and sched.parse(steps[1]) == sched.parse(
        "10.0000001-50%: sdpa-math")


def test_fields_are_read_from_text():
    s = sparse.parse(" block-sparse , Budget = 0.25, min tokens=4096, threshold=0.95, dense = 0-30% ; first 2, "
                     "calibrate=off")
    assert (s.budget, s.min_tokens, s.topk, s.threshold, s.dense, s.calibrate) == \
        (0.25, 4096, None, 0.95, "0-30%; first 2", False)
    assert s.knob == lib_attn.Knob("threshold", 0.95)


@pytest.mark.parametrize("value, words", [
    ("radial", ["'radial'", "auto, sol, block-sparse"]),
    ("block-sparse, budget=0", ["budget '0'", "(0, 1]"]),
    ("block-sparse, budget=1.01", ["budget '1.01'", "(0, 1]"]),
    ("block-sparse, budget=-0.1", ["budget '-0.1'", "(0, 1]"]),
    ("block-sparse, budget=fine", ["budget 'fine'", "not a number"]),
    ("block-sparse, budget=nan", ["budget 'nan'", "finite"]),
    ({"method": "block-sparse", "budget": True}, ["budget True", "not a number"]),
    ("auto, min_tokens=0", ["min_tokens '0'", ">= 1"]),
    ("auto, min_tokens=100.5", ["min_tokens '100.5'", ">= 1"]),
    ("auto, topk=0", ["topk '0'", "(0, 1]"]),
    ("auto, topk=2", ["topk '2'", "(0, 1]"]),
    ("auto, threshold=0.9", ["threshold", "named method", "block-sparse"]),
    ("block-sparse, threshold=2", ["threshold 2", "0.05-1"]),
    ("block-sparse, topk=0.2, threshold=0.9", ["topk='0.2'", "threshold='0.9'", "one of them"]),
    ("block-sparse, dense=20-80", ["'20-80'", "valid conditions"]),
    ("block-sparse, dense=0-20%: sdpa", ["':'", "conditions only"]),
    ("block-sparse, calibrate=maybe", ["'maybe'", "on, off"]),
    ("block-sparse, speed=2", ["'speed=2'", "budget, min_tokens"]),
    ("block-sparse, budget=0.1, budget=0.2", ["'budget' given twice"]),
    ("budget=0.1", ["start with a method", "auto, sol, block-sparse"]),
    ({"method": "auto", "speed": 1}, ["'speed'", "method, budget"]),
    (12, ["int"]),
])
def test_bad_values_are_refused_naming_value_and_valid_ones(value, words):
    before = lib_attn.config()
    with pytest.raises(sparse.SparseError) as caught:
        lib_attn.configure(sparse=value)
    assert all(w in str(caught.value) for w in words), str(caught.value)
    assert lib_attn.config() == before  # nothing changed


def test_configure_and_use_put_settings_in_force_and_off():
    lib_attn.configure(sparse="block-sparse, budget=0.2")
    assert lib_attn.config().sparse.budget == 0.2
    lib_attn.configure(fp32="keep")  # other arguments leave sparse as it is
    assert lib_attn.config().sparse.budget == 0.2
    with lib_attn.use(sparse="off") as cfg:
        assert cfg.sparse is None and lib_attn.config().sparse is None
    assert lib_attn.config().sparse.budget == 0.2
    token = lib_attn.config().token
    lib_attn.configure(sparse="block-sparse, budget=0.3")
    assert lib_attn.config().token != token  # decisions are keyed on it
    lib_attn.configure(sparse=False)
    assert lib_attn.config().sparse is None


def test_dense_windows_join_the_position_after_the_schedule():
    lib_attn.configure(schedule="cross: sdpa; 50-100%: math", sparse="block-sparse, dense=0-20%; first 1")
    cfg = lib_attn.config()
    assert cfg.schedule.labels == ["cross", "50-100%"]
    assert cfg.positional.labels == ["cross", "50-100%", "0-20%", "first 1"]
    here = sched.position()
    assert here.schedule is cfg.positional and here.schedule.asks_step and here.schedule.asks_blocks
    sched.at_step(1, 10)
    sched.at_block(0, 30)
    assert here.token == (False, (0, 2, 3))
    sched.at_step(6, 10)
    sched.at_block(5, 30)
    assert here.token == (False, (0, 1))
    # the schedule's own rules still serve the calls they take; the windows are not schedule rules
    q = torch.randn(1, 2, 40, 16)
    with lib_attn.recording() as rec:
        lib_attn.attention(q, q, q)
    assert [label for (_, label, _, _) in rec.rules] == ["50-100%"]
    sched.leave()


def test_windows_alone_make_the_host_tell_the_position():
    lib_attn.configure(sparse="block-sparse")
    assert lib_attn.config().schedule is None
    assert sched.position().schedule.asks_step and sched.position().schedule.asks_blocks
    lib_attn.configure(sparse="block-sparse, dense=none")
    assert sched.position().schedule is None


def test_sparse_backends_are_not_chain_backends():
    assert "block-sparse" in lib_attn.SPARSE_IDS and "block-sparse" not in lib_attn.BACKEND_IDS
    assert [b.id for b in lib_attn.backends(sparse=True)] == list(lib_attn.SPARSE_IDS)
    assert "block-sparse" not in [b.id for b in lib_attn.backends()]
    for bad in ({"preference": ["block-sparse"]}, {"schedule": "self: block-sparse"}, {"avoid": "block-sparse"}):
        with pytest.raises(ValueError, match="'block-sparse' is a sparse backend.*sparse settings"):
            lib_attn.configure(**bad)
    q = torch.randn(1, 1, 8, 8)
    with pytest.raises(ValueError, match="sparse backend"):
        lib_attn.attention(q, q, q, backend="block-sparse")


def test_a_registered_sparse_backend_becomes_a_method():
    class Pooled(lib_attn.SparseBackend):
        id = "my-sparse"
        label = "test sparse"
        dtypes = (torch.float32,)

        def run_sparse(self, q, k, v, scale, knob):
            return lib_attn.SparseResult(torch.nn.functional.scaled_dot_product_attention(q, k, v), None, 1.0)

    lib_attn.register_backend(Pooled())
    try:
        assert "my-sparse" in sparse.methods() and "my-sparse" not in lib_attn.BACKEND_IDS
        lib_attn.configure(sparse="my-sparse, topk=0.5")
        assert lib_attn.config().sparse.method == "my-sparse"
        with pytest.raises(sparse.SparseError, match="my-sparse routes by topk only"):
            sparse.parse("my-sparse, threshold=0.5")
    finally:
        lib_attn.reset()
        lib_attn.unregister_backend("my-sparse")
    with pytest.raises(sparse.SparseError, match="'my-sparse' is not one of auto, sol, block-sparse"):
        sparse.parse("my-sparse")


def test_ladder_runs_from_the_users_setting_toward_denser():
    from lib_attn.kernels import REGISTRY
    backend = REGISTRY["block-sparse"]
    assert [k.value for k in backend.ladder(lib_attn.Knob("topk", 0.12))] == [0.12, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5]
    assert [k.value for k in backend.ladder(lib_attn.Knob("threshold", 0.85))] == [0.85, 0.9, 0.95, 0.98, 0.99]
    assert [k.value for k in backend.ladder(lib_attn.Knob("topk", 0.6))] == [0.6]
