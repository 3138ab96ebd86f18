"""What belongs to a thread or task: the configuration ``use`` puts in force, recordings and the
schedule's position. Two threads, each in its own ``use`` and ``recording``, run their own kernels
and count their own calls; the process-wide configuration stays shared."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import lib_attn
from lib_attn import schedule as sched
from tests.engine_helpers import make_qkv, reference, rel_err


@pytest.fixture(autouse=True)
def fresh():
    lib_attn.reset()
    yield
    lib_attn.configure(preference="auto", schedule="")
    lib_attn.reset()


def run_threads(*targets):
    """Start every target at once (a barrier), wait for them all, re-raise the first error."""
    barrier = threading.Barrier(len(targets))
    errors = []

    def wrapped(target):
        def run():
            try:
                barrier.wait()
                target()
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                errors.append(exc)
        return run
    threads = [threading.Thread(target=wrapped(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("order", ["use, then recording", "recording, then use"])
def test_two_threads_run_their_own_kernels_and_count_their_own_calls(order):
    q, k, v = make_qkv(1, 2, 32, 32, 16, torch.float32, seed=1)
    want = reference(q, k, v)
    results = {}

    def worker(backend):
        def run():
            if order == "use, then recording":
                with lib_attn.use(preference=[backend]), lib_attn.recording() as rec:
                    outs = [lib_attn.attention(q, k, v) for _ in range(200)]
            else:
                with lib_attn.recording() as rec, lib_attn.use(preference=[backend]):
                    outs = [lib_attn.attention(q, k, v) for _ in range(200)]
            results[backend] = (rec, outs)
        return run

    run_threads(worker("sdpa-math"), worker("math"))
    for backend in ("sdpa-math", "math"):
        rec, outs = results[backend]
        assert rec.calls == {("unet", backend): 200}, (backend, rec.calls)
        assert all(rel_err(o, want) < 1e-5 for o in outs[::50])


def test_use_in_one_thread_leaves_the_other_on_the_process_configuration():
    q, k, v = make_qkv(1, 2, 32, 32, 16, torch.float32, seed=2)
    lib_attn.configure(preference=["sdpa-math"])  # the process-wide configuration (settings, flags)
    inside, outside = threading.Event(), threading.Event()
    seen = {}

    def scoped():
        with lib_attn.use(preference=["math"]), lib_attn.recording() as rec:
            inside.set()
            outside.wait()
            lib_attn.attention(q, k, v)
            seen["scoped"] = (dict(rec.calls), lib_attn.config().preference["unet"])

    def plain():
        inside.wait()  # while the other thread is inside its use block
        with lib_attn.recording() as rec:
            lib_attn.attention(q, k, v)
        seen["plain"] = (dict(rec.calls), lib_attn.config().preference["unet"])
        outside.set()

    run_threads(scoped, plain)
    assert seen["scoped"] == ({("unet", "math"): 1}, ("math",))
    assert seen["plain"] == ({("unet", "sdpa-math"): 1}, ("sdpa-math",))
    assert lib_attn.config().preference["unet"] == ("sdpa-math",)  # and here, after both


def test_configure_inside_a_use_block_changes_the_process_and_the_block_keeps_its_own():
    with lib_attn.use(fp32="keep") as cfg:
        lib_attn.configure(tune="off")
        assert lib_attn.config() is cfg and lib_attn.config().fp32 == "keep"
    assert lib_attn.config().tune == "off" and lib_attn.config().fp32 == "cast"


def test_equal_configurations_share_their_decisions(monkeypatch):
    q, k, v = make_qkv(1, 2, 32, 32, 16, torch.float32, seed=3)
    lib_attn.configure(preference=["math"])
    lib_attn.attention(q, k, v)
    monkeypatch.setattr("lib_attn.dispatch.decide", lambda *a, **kw: pytest.fail("decided again"))
    with lib_attn.use(preference=["math"]):  # equal to the process's: its decisions serve
        lib_attn.attention(q, k, v)

    def other_thread():
        with lib_attn.use(fp32="cast"):
            lib_attn.attention(q, k, v)
    run_threads(other_thread)


def test_each_thread_has_its_own_schedule_position():
    q, k, v = make_qkv(1, 2, 32, 32, 16, torch.float32, seed=4)
    text = "0-50%: sdpa-math; 50-100%: math"
    at = {"early": 1, "late": 9}
    counts, positions = {}, {}
    ready = threading.Barrier(2)

    def sampler(name):
        def run():
            with lib_attn.use(schedule=text), lib_attn.recording() as rec:
                sched.at_step(at[name], 10)
                ready.wait()  # both positions are set before either thread calls
                for _ in range(20):
                    lib_attn.attention(q, k, v)
                positions[name] = sched.position().progress
            counts[name] = dict(rec.calls)
        return run

    run_threads(sampler("early"), sampler("late"))
    assert counts == {"early": {("unet", "sdpa-math"): 20}, "late": {("unet", "math"): 20}}
    assert positions == {"early": 0.1, "late": 0.9}
    assert sched.position().progress is None and lib_attn.config().schedule is None  # the process's, untouched


def test_asyncio_tasks_keep_their_own_configuration_and_recordings():
    q, k, v = make_qkv(1, 2, 32, 32, 16, torch.float32, seed=5)

    async def session(backend, n):
        with lib_attn.use(preference=[backend]), lib_attn.recording() as rec:
            for _ in range(n):
                lib_attn.attention(q, k, v)
                await asyncio.sleep(0)  # the other task runs in between
        return dict(rec.calls)

    async def both():
        return await asyncio.gather(session("sdpa-math", 7), session("math", 5))

    assert asyncio.run(both()) == [{("unet", "sdpa-math"): 7}, {("unet", "math"): 5}]


def test_fallbacks_and_guard_events_are_counted_in_their_threads_recording():
    q, k, v = make_qkv(1, 2, 32, 32, 16, torch.float32, seed=6)
    results = {}

    def falls_back():
        with lib_attn.use(preference=["sdpa-efficient"]), lib_attn.recording() as rec:  # CUDA only: falls back
            for _ in range(3):
                lib_attn.attention(q, k, v)
        results["falls back"] = rec

    def plain():
        with lib_attn.recording() as rec:
            for _ in range(3):
                lib_attn.attention(q, k, v)
        results["plain"] = rec

    run_threads(falls_back, plain)
    ((key, n),) = results["falls back"].fallbacks.items()
    assert key[:2] == ("unet", "sdpa-efficient") and n == 3
    assert not results["plain"].fallbacks and results["plain"].calls == {("unet", "sdpa"): 3}
    assert set(results["falls back"].paths) == {key}


def test_recording_into_counts_several_blocks_of_one_thread_and_stays_open():
    """A host's generation that runs as several pieces of work (InvokeAI's nodes) counts each piece
    into one recording; another thread's calls meanwhile are not counted; finish() closes it."""
    q, k, v = make_qkv(1, 2, 16, 16, 16, torch.float32, seed=3)
    total = lib_attn.Recording(here=True)  # the kind recording() makes: its own thread's calls

    def other():
        for _ in range(50):
            lib_attn.attention(q, k, v)

    for n in (3, 4):
        with lib_attn.recording(into=total) as rec:
            assert rec is total
            run_threads(other)
            for _ in range(n):
                lib_attn.attention(q, k, v)
    assert total.calls == {("unet", "sdpa"): 7} and total.finished is None
    total.finish()
    with lib_attn.recording(into=total):
        lib_attn.attention(q, k, v)
    assert total.calls == {("unet", "sdpa"): 7}
    with pytest.raises(ValueError, match="counts its own thread"):
        with lib_attn.recording(into=lib_attn.Recording()):
            pass
