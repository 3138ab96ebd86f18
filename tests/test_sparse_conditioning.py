"""A joint call's conditioning tokens (``lib_attn.conditioning``): told only to the joint calls of the
length declared, kept by block-sparse routing as keys for every query block and computed exactly as
queries, in the kernel, in the share of blocks it reports and in calibration's measurement alike."""
from __future__ import annotations

import math
import random
import threading

import pytest
import torch

import lib_attn
from lib_attn import conditioning
from lib_attn import sparse_measure as measure
from lib_attn.kernels import REGISTRY
from lib_attn.kernels.block_sparse import exact, gather
from lib_attn.kernels.sparse import Knob

from tests.engine_helpers import make_qkv, reference, rel_err
from tests.test_block_sparse import pooled_reference

BLOCK_SPARSE = REGISTRY["block-sparse"]


def _kept_rows(routing, b, h, n):
    return torch.stack([torch.stack([routing.kept_blocks(bi, hi, torch.arange(n)) for hi in range(h)])
                        for bi in range(b)])


@pytest.mark.parametrize("tokens, side, knob", [(300, "first", Knob("topk", 0.2)), (100, "last", Knob("topk", 0.3)),
                                                (256, "last", Knob("threshold", 0.8)), (1, "first", Knob("topk", 0.05))])
def test_the_text_blocks_are_kept_by_every_query_block_and_counted_in_the_share(tokens, side, knob):
    n = 1100  # 9 blocks of 128, the last one short
    q, k, _ = make_qkv(2, 3, n, n, 16, torch.float32, seed=4)
    with conditioning.text(tokens, total=n, side=side):
        routing = BLOCK_SPARSE.routing(q, k, None, knob)
        (again,) = BLOCK_SPARSE.routings(q, k, None, [knob])
    start, stop = (0, tokens) if side == "first" else (n - tokens, n)
    first, end = start // 128, -(-stop // 128)
    assert routing.exact_rows == again.exact_rows == (first, end)
    assert torch.equal(routing.indices, again.indices)
    kept = _kept_rows(routing, 2, 3, n)                  # (b, h, rows, key blocks)
    assert kept[..., first:end].all()                    # every query keeps every text key block
    text_rows = kept[:, :, first * 128:min(end * 128, n)]
    assert text_rows.all()                               # the text's query blocks attend every key block
    # the share reported is that of the blocks computed: per query block, its kept blocks (all for text ones)
    per_block = kept[:, :, ::128].sum(-1, dtype=torch.float64)
    assert float(routing.kept) == pytest.approx(float(per_block.sum()) / (2 * 3 * 9 * 9), abs=1e-6)
    # outside the text, a top-k routing keeps no more than its share (the text blocks count in it)
    if knob.name == "topk":
        others = [i for i in range(9) if not first <= i < end]
        widest = max(int(kept[:, :, i * 128].sum(-1).max()) for i in others)
        assert widest == max(math.floor(knob.value * 9 + 1e-9), end - first + 2 - (first == 0))


def test_calls_of_another_length_and_calls_outside_the_block_are_told_nothing():
    q, k, _ = make_qkv(1, 2, 700, 700, 16, torch.float32, seed=1)
    with conditioning.text(200, total=701):
        assert conditioning.current(700) is None
        assert BLOCK_SPARSE.routing(q, k, None, Knob("topk", 0.3)).exact_rows is None
    with conditioning.text(0, total=700):
        assert conditioning.current(700) is None
    assert BLOCK_SPARSE.routing(q, k, None, Knob("topk", 0.3)).exact_rows is None


@pytest.mark.parametrize("side", ["first", "last"])
def test_the_kernel_is_exact_on_text_rows_and_pooled_elsewhere_as_calibration_measures_it(side):
    n, tokens = 900, 200
    q, k, v = make_qkv(1, 2, n, n, 16, torch.float64, seed=6)
    knob = Knob("topk", 0.3)
    with conditioning.text(tokens, total=n, side=side):
        result = BLOCK_SPARSE.run_sparse(q, k, v, None, knob)
        routing = BLOCK_SPARSE.routing(q, k, None, knob)
    assert BLOCK_SPARSE.design("cpu", torch.float64, 16) == "gather"
    scale = 16 ** -0.5
    assert rel_err(result.out, pooled_reference(q, k, v, scale, routing)) < 1e-6
    rows = slice(0, 256) if side == "first" else slice(640, n)    # the query blocks holding text
    assert rel_err(result.out[:, :, rows], reference(q, k, v)[:, :, rows]) < 1e-12
    assert float(result.kept) == float(routing.kept)
    samples = measure.draw(q, "bhsd", random.Random(3))
    assert measure.routed_errors(q, k, v, scale, "bhsd", [routing], samples)[0] == pytest.approx(
        measure.output_error(result.out, q, k, v, scale, "bhsd", samples), rel=1e-4)


def test_the_text_rows_log_sum_exp_is_written_where_the_design_returns_one():
    n = 600
    q, k, v = make_qkv(2, 2, n, n, 16, torch.float32, seed=8)
    with conditioning.text(150, total=n):
        routing = BLOCK_SPARSE.routing(q, k, None, Knob("topk", 0.4))
    out = gather.run(q, k, v, 0.25, routing, 128)
    lse = torch.zeros(2, 2, n)
    exact.overwrite(out, lse, q, k, v, 0.25, routing)
    want = torch.logsumexp((q[:, :, :256].double() @ k.double().transpose(-1, -2)) * 0.25, -1)
    assert torch.allclose(lse[:, :, :256].double(), want, atol=1e-4) and not lse[:, :, 256:].any()
    assert rel_err(out[:, :, :256], reference(q, k, v, scale=0.25)[:, :, :256]) < 1e-5


class _Joint(torch.nn.Module):
    """A joint block as diffusers writes SD3's: image first, the text appended (``last``)."""

    def __init__(self, seen, fail=False):
        super().__init__()
        self.seen, self.fail = seen, fail

    def forward(self, hidden_states, encoder_hidden_states=None):
        total = hidden_states.shape[1] + encoder_hidden_states.shape[1]
        self.seen.append((conditioning.current(total), conditioning.current(hidden_states.shape[1])))
        if self.fail:
            raise RuntimeError("half-way")
        return hidden_states


def test_hooks_declare_a_blocks_text_from_its_arguments_for_its_call_only():
    seen = []
    block, failing = _Joint(seen), _Joint(seen, fail=True)
    read = conditioning.joint_reader(("hidden_states", 0), ("encoder_hidden_states", 1), "last")
    img, txt = torch.zeros(1, 40, 4), torch.zeros(1, 7, 4)
    with conditioning.hooks([(block, read), (failing, read)]) as count:
        assert count == 2
        block(img, encoder_hidden_states=txt)
        block(hidden_states=img, encoder_hidden_states=txt[:, :3])
        with pytest.raises(RuntimeError, match="half-way"):
            failing(img, txt)
        assert conditioning.current(47) is None          # gone after each call, also one that raised
        with conditioning.text(5, total=47):              # the block's own holds in it, the one around after it
            block(img, txt[:, :2])
            assert conditioning.current(47) == conditioning.Text(5, 47, "first")
    block(img, txt)                                       # hooks removed
    assert seen == [(conditioning.Text(7, 47, "last"), None), (conditioning.Text(3, 43, "last"), None),
                    (conditioning.Text(7, 47, "last"), None), (conditioning.Text(2, 42, "last"), None), (None, None)]
    assert conditioning.Text(7, 47, "last").span == (40, 47) and conditioning.Text(7, 47).blocks(4) == (0, 2)


def test_a_declaration_belongs_to_its_thread():
    found = []
    with conditioning.text(10, total=100):
        worker = threading.Thread(target=lambda: found.append(conditioning.current(100)))
        worker.start()
        worker.join()
        assert conditioning.current(100) is not None
    assert found == [None]


def test_an_engine_call_keeps_the_text_and_names_it_in_its_kind():
    n = 1280
    q, k, v = make_qkv(1, 2, n, n, 32, torch.float32, seed=2)
    settings = "block-sparse, budget=1, min_tokens=1024, topk=0.2, dense=none, calibrate=off"
    with lib_attn.use(sparse=settings), lib_attn.recording() as rec:
        with conditioning.text(256, total=n):
            out = lib_attn.attention(q, k, v, role="dit")
        plain = lib_attn.attention(q, k, v, role="dit")
    report = lib_attn.Report.from_recording(rec).sparse
    assert sorted(kind for _, _, kind, _ in report.kinds) == ["256 text tokens first", "any"]
    assert rel_err(out[:, :, :256], reference(q, k, v)[:, :, :256]) < 1e-5
    assert rel_err(plain[:, :, :256], reference(q, k, v)[:, :, :256]) > 1e-3
