"""A parallel attention call: the shapes of call a model makes, checked, laid out, run, counted.

``attention(q, k, v, kind=...)`` takes this rank's share of a call under the configuration in force
(``lib_attn.parallel.use`` / ``configure``) and returns this rank's share of the output:

* ``kind="self"``: q, k and v hold this rank's shard of one sequence (``sharding``'s convention);
* ``kind="cross"``: q holds this rank's shard; k and v are the same on every rank (e.g. the text).
  Each rank's queries see every key already: the call is the engine's, with no exchange;
* ``kind="joint"``: q, k and v hold the text part (``text_len`` tokens, the same on every rank; in front,
  or at the back with ``text_first=False``) and this rank's shard of the image/video tokens.

The caller says which: lengths never decide it. Without a configuration in force, or on one rank, the
call is the engine's own. Each call is counted in the readout (``Recording.parallel``) with its mode,
ranks and the bytes this rank sent.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch

from .. import _compat
from .. import dispatch as _dispatch
from .. import scope as _scope
from .. import stats
from ..kernels.base import default_scale
from ..spec import LAYOUTS, ROLES
from . import comm, sharding
from .mesh import Parallel, ParallelError
from .modes import Layout, run

KINDS = ("self", "cross", "joint")
_KIND_CODE = {kind: i for i, kind in enumerate(KINDS)}

_process: Parallel | None = None
_scoped: ContextVar = ContextVar("lib_attn_parallel", default=None)


def configure(parallel: Parallel | None) -> None:
    """Put ``parallel`` in force for the whole process (None: no parallel mode)."""
    global _process
    _process = _checked_config(parallel)


@contextlib.contextmanager
def use(parallel: Parallel | None):
    """Put ``parallel`` in force for this thread or task for the ``with`` block (None: none)."""
    token = _scoped.set((_checked_config(parallel),))
    try:
        yield parallel
    finally:
        _scoped.reset(token)


def current() -> Parallel | None:
    """The configuration in force here: the innermost ``use``, else ``configure``'s."""
    scoped = _scoped.get()
    return scoped[0] if scoped is not None else _process


def _checked_config(parallel):
    if parallel is not None and not isinstance(parallel, Parallel):
        raise ValueError(f"parallel must be a lib_attn.parallel.Parallel or None, got {type(parallel).__name__}")
    return parallel


def attention(q, k, v, *, kind: str = "self", text_len: int = 0, text_first: bool = True, seq_len: int | None = None,
              layout: str = "bhsd", mask=None, scale=None, role: str = "dit", parallel: Parallel | None = None):
    """This rank's share of the output of a call split over the ranks (see the module's docstring).

    ``seq_len``: the whole length of the split part when the caller knows it; the ranks then skip the
    exchange of their lengths and each checks its own against the convention. ``parallel``: a
    configuration for this call instead of the one in force. Bad input raises ValueError naming the
    value and the valid ones; a peer that fails or stalls raises ``ParallelError`` within the timeout.
    """
    par = parallel if parallel is not None else current()
    _check_call(kind, layout, role, text_len, q)
    if par is None or par.world == 1:
        return _dispatch.attention(q, k, v, layout=layout, mask=mask, scale=scale, role=role)
    if _compat.IS_COMPILING():
        # A traced call would attend to this rank's keys only: a wrong image, never an error.
        raise ParallelError("a call split over ranks cannot be traced by torch.compile; compile the model "
                            "without lib_attn.parallel in force")
    if kind == "cross":  # every rank holds every key: its queries need nothing from the others
        empty = q.shape[2 if layout == "bhsd" else 1] == 0
        out = q.new_empty(q.shape[:3] + v.shape[3:]) if empty else \
            _dispatch.attention(q, k, v, layout=layout, mask=mask, scale=scale, role=role)
        _count(role, kind, "local", par, "", 0)
        return out
    if mask is not None:
        raise ValueError(f"a {kind} call split over ranks takes no mask (only kind 'cross' does)")
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if q.shape[2] != k.shape[2] or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"a {kind} call needs q, k and v of one shape, got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} (layout {layout})")
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
        raise ValueError(f"q, k and v must have one dtype and one device, got {q.dtype}/{q.device}, "
                         f"{k.dtype}/{k.device}, {v.dtype}/{v.device}")
    if text_len > q.shape[2]:
        raise ValueError(f"text_len {text_len} is longer than this rank's {q.shape[2]} tokens")
    t = text_len if kind == "joint" else 0
    scale = default_scale(scale, q.shape[-1])
    traffic = comm.Traffic()
    with par.in_use():
        lens = _lengths(par, q, t, kind, seq_len)
        heads = q.shape[1]
        lay, mode, note, pad = _layout(par, heads, lens)
        cut = (slice(0, t), slice(t, None)) if text_first else (slice(q.shape[2] - t, None), slice(0, q.shape[2] - t))
        text = tuple(_pad_heads(x[:, :, cut[0]], pad) for x in (q, k, v))
        part = tuple(_pad_heads(x[:, :, cut[1]], pad) for x in (q, k, v))
        out_t, out_p = run(par, lay, text, part, scale, role, traffic)
    out = torch.cat([out_t, out_p] if text_first else [out_p, out_t], dim=2) if t else out_p
    out = out[:, :heads] if pad else out
    _count(role, kind, mode, par, note, traffic.sent)
    return out.transpose(1, 2) if layout == "bshd" else out


def _check_call(kind, layout, role, text_len, q) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
    if not isinstance(text_len, int) or isinstance(text_len, bool) or text_len < 0:
        raise ValueError(f"text_len {text_len!r} must be an integer >= 0")
    if kind != "joint" and text_len:
        raise ValueError(f"text_len {text_len} is for kind 'joint' only, not {kind!r}")
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a 4-D tensor in layout {layout!r}, got "
                         f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")


def _lengths(par: Parallel, q, t: int, kind: str, seq_len) -> list[int]:
    """Every rank's split-part length, by position in the group. From ``seq_len`` by the convention,
    or exchanged: then every rank also sees every other's shape and, when they disagree, raises the
    same error, so no rank goes on to a collective the others will not make."""
    mine = q.shape[2] - t
    if seq_len is not None:
        lens = sharding.sizes(seq_len, par.world)
        if lens[par.rank] != mine:
            raise ValueError(f"rank {par.rank} holds {mine} tokens of the split part, but seq_len {seq_len} split "
                             f"over {par.world} ranks gives it {lens[par.rank]}")
        return lens
    b, h, _, d = q.shape
    rows = comm.all_gather_ints([b, h, d, t, _KIND_CODE[kind], mine], par, par.comm_group, par.ranks, q.device)
    first = rows[0][:5]
    for pos, row in enumerate(rows):
        if row[:5] != first:
            names = ("batch", "heads", "head_dim", "text_len", "kind")
            diff = ", ".join(f"{n} {a} vs {bb}" for n, a, bb in zip(names, first, row[:5]) if a != bb)
            raise ParallelError(f"rank {par.rank} of {par.world}: the ranks disagree on this {kind} call: rank "
                                f"{par.ranks[0]} and rank {par.ranks[pos]} differ in {diff}")
    return [row[5] for row in rows]


def _layout(par: Parallel, heads: int, lens: list) -> tuple[Layout, str, str, int]:
    """(layout, mode, note, padded heads) for a call with ``heads`` heads: the configured grid, or, when the
    heads do not divide the Ulysses degree, padded heads or a ring over every rank."""
    u = par.ulysses
    note, pad = "", 0
    me = (par.ranks[par.rank],)
    if u > 1 and heads % u:
        if par.uneven_heads == "ring":
            note = f"heads {heads} not divisible by ulysses {u}: ran as a ring over {par.world} ranks"
            return Layout(None, me, 0, par.comm_group, par.ranks, par.rank, lens), "ring", note, 0
        pad = -heads % u
        note = f"heads {heads} not divisible by ulysses {u}: padded to {heads + pad}"
    if par.ring == 1:
        return Layout(par.comm_group, par.ranks, par.rank, None, me, 0, lens), par.mode, note, pad
    if u == 1:
        return Layout(None, me, 0, par.comm_group, par.ranks, par.rank, lens), par.mode, note, pad
    return Layout(par.ulysses_group, par.ulysses_ranks, par.rank % u, par.ring_group, par.ring_ranks,
                  par.rank // u, lens), par.mode, note, pad


def _pad_heads(x, pad: int):
    if not pad:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], pad, x.shape[2], x.shape[3])], dim=1)


def _count(role: str, kind: str, mode: str, par: Parallel, note: str, sent: int) -> None:
    key = (role, kind, mode, par.world, par.ulysses, par.ring, note)
    recordings = _scope.current().recordings
    stats.count("parallel", key, 1, recordings)
    stats.count("parallel_bytes", key, sent, recordings)
