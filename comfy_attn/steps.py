"""The sampler's step, as ComfyUI tells it, for the schedule in force.

ComfyUI hands every model call two things in its transformer options: ``sample_sigmas``, the
sampler's whole schedule (``CFGGuider.inner_sample``: one tensor for the sampling, on the model's
device), and ``sigmas``, the sigma of this call (``calc_cond_batch``: one per batch entry, a new
tensor for each model call). The step is where the call's sigma stands in the schedule: the last
step whose sigma is at or above it (Euler-like samplers call the model at each step's sigma; a
second evaluation between two sigmas counts to the earlier step, one at the next sigma, as Heun's
correction, to the next). The total is the schedule's length less one, so the fraction of steps done
is that of this sampler: KSamplerAdvanced's start/end steps and a denoise below 1 give it their own
steps. ComfyUI does not tell which pass (base, hires, refiner) a sampler is.

Reading the values waits for the device (a sync): the schedule's once per sampling, the call's sigma
once per model call, and only while a schedule with step or sigma rules is in force; block and kind
rules read nothing. The wait lets the previous step's queued work finish before the model call's
first kernels are launched.
"""
from __future__ import annotations

import bisect

from lib_attn import schedule

#: Relative slack when a sigma is compared with the schedule's (the sampler multiplies it by ones).
SLACK = 1e-5

_schedule = [None, ()]    # the sample_sigmas tensor last seen, its values
_seen = [None]            # the sigmas tensor of the last model call followed
_told = [(None, None, None), False]   # (step, total, sigma) told for it; whether a call without one came since


def step_of(sigma: float, values) -> int:
    """The step (0-based, of ``len(values) - 1``) that a model call at ``sigma`` belongs to, for a
    sampler whose sigmas are ``values`` (falling)."""
    n = len(values) - 1
    falling = [-v for v in values[:n]]
    return min(max(bisect.bisect_right(falling, -sigma + SLACK * abs(sigma)) - 1, 0), max(n - 1, 0))


def _values(sample_sigmas) -> tuple:
    if sample_sigmas is not _schedule[0]:
        _schedule[:] = [sample_sigmas, tuple(sample_sigmas.reshape(-1).tolist())]
    return _schedule[1]


def model_call(options) -> None:
    """A model call with transformer options ``options`` starts: tell the engine its step and sigma.
    Nothing is read unless the schedule in force has step or sigma rules."""
    rules = schedule.position().schedule
    if rules is None or not rules.asks_step:
        return
    sigmas = options.get("sigmas") if options is not None else None
    sample_sigmas = options.get("sample_sigmas") if options is not None else None
    _seen[0] = sigmas
    if sigmas is None or sample_sigmas is None or len(sample_sigmas) < 2:
        _tell(None, None, None)
        return
    values = _values(sample_sigmas)
    sigma = float(sigmas.reshape(-1)[0])
    _tell(step_of(sigma, values), len(values) - 1, sigma)


def _tell(step, total, sigma) -> None:
    _told[:] = [(step, total, sigma), False]
    schedule.at_step(step, total, sigma)


def attention_call(options) -> None:
    """An attention call with transformer options ``options`` (where nothing wraps the model calls: the
    global route): a new ``sigmas`` tensor means a new model call. A call that passes no options has no
    step (it may be another model's, a VAE's, a node's of its own): no step rule holds for it, and the
    next call of the model followed gets its step back without reading it again."""
    sigmas = options.get("sigmas") if options is not None else None
    if sigmas is None:
        if not _told[1]:
            _told[1] = True
            schedule.at_step(None, None)
    elif sigmas is not _seen[0]:
        model_call(options)
    elif _told[1]:
        _tell(*_told[0])


def leave() -> None:
    """Sampling is over: no step is known, and the tensors are let go."""
    _schedule[:] = [None, ()]
    _seen[0] = None
    _told[:] = [(None, None, None), False]
    schedule.leave()
