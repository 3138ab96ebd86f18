"""The tuning file shared by processes: concurrent writers, its lock, corrupt and unreadable files."""
from __future__ import annotations

import json
import logging
import multiprocessing
import os
import sys
import time

import pytest

from lib_attn import tuning_file
from lib_attn.file_lock import FileLock

# Forked workers start in milliseconds; spawned ones would each import torch again.
MP = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
WORKERS, EACH = 8, 60
KEY, FP = "machine-a", {"device": "a"}


@pytest.fixture(autouse=True)
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv(tuning_file.ENV_DIR, str(tmp_path / "cache"))
    return tmp_path / "cache"


def result(worker: int, i: int) -> dict:
    return {"timings": {"sdpa": worker + i / 1000, "math": 10.0 + worker}, "rejected": {"xformers": f"w{worker}"},
            "winner": "sdpa"}


def stored() -> dict:
    with open(tuning_file.cache_path(), encoding="utf-8") as f:
        doc = json.load(f)
    assert doc["schema"] == tuning_file.SCHEMA
    return doc["machines"]


def warnings_of(caplog) -> list:
    return [r.getMessage() for r in caplog.records if r.name == "lib_attn" and r.levelno >= logging.WARNING]


def set_aside_files(cache) -> list:
    return sorted(n for n in os.listdir(cache) if n.startswith(tuning_file.FILE_NAME + ".corrupt-"))


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _put_many(cache: str, worker: int, barrier, timeout: float) -> None:
    """A worker process: EACH results of its own, written one by one right after the others start."""
    os.environ[tuning_file.ENV_DIR] = cache
    tuning_file.LOCK_TIMEOUT_S = timeout
    logger = logging.getLogger("lib_attn")
    logger.setLevel(logging.WARNING)
    collect = _Collect()
    logger.addHandler(collect)
    store = tuning_file.Store()
    barrier.wait(60)
    for i in range(EACH):
        store.put(f"machine-{worker % 2}", {"device": worker % 2}, f"w{worker}-{i}", result(worker, i))
    for line in collect.lines:
        print(line, file=sys.stderr)
    sys.exit(1 if collect.lines else 0)


def test_processes_writing_at_once_keep_every_result(cache):
    # The timeout is generous here: this checks that no write undoes another, however long a
    # process waits for its turn on a busy 2-core machine.
    barrier = MP.Barrier(WORKERS + 1)
    procs = [MP.Process(target=_put_many, args=(str(cache), w, barrier, 60.0)) for w in range(WORKERS)]
    for p in procs:
        p.start()
    try:
        barrier.wait(60)
    finally:
        for p in procs:
            p.join(60)
    assert [p.exitcode for p in procs] == [0] * WORKERS  # and none logged a line
    machines = stored()
    assert sorted(machines) == ["machine-0", "machine-1"]
    for w in range(WORKERS):
        machine = machines[f"machine-{w % 2}"]
        assert machine["fingerprint"] == {"device": w % 2}
        for i in range(EACH):
            assert machine["entries"][f"w{w}-{i}"] == result(w, i)
    assert sum(len(m["entries"]) for m in machines.values()) == WORKERS * EACH
    assert [n for n in os.listdir(cache) if n.endswith(".tmp")] == []
    fresh = tuning_file.Store()
    assert fresh.entry("machine-1", f"w7-{EACH - 1}") == result(7, EACH - 1)


def _hold(lock_path: str, held, release) -> None:
    lock = FileLock(lock_path)
    lock.acquire(0)
    held.set()
    release.wait(60)
    lock.release()


def test_a_lock_held_past_the_timeout_keeps_results_in_memory_with_one_log_line(cache, monkeypatch, caplog):
    monkeypatch.setattr(tuning_file, "LOCK_TIMEOUT_S", 0.5)
    os.makedirs(cache)
    held, release = MP.Event(), MP.Event()
    holder = MP.Process(target=_hold, args=(tuning_file.cache_path() + tuning_file.LOCK_SUFFIX, held, release))
    holder.start()
    store = tuning_file.Store()
    try:
        assert held.wait(60)
        with caplog.at_level(logging.WARNING, logger="lib_attn"):
            t0 = time.monotonic()
            store.put(KEY, FP, "first", result(0, 1))
            waited = time.monotonic() - t0
            t0 = time.monotonic()
            store.put(KEY, FP, "second", result(0, 2))
            again = time.monotonic() - t0
        assert waited >= 0.5 and again < 0.5  # waits once, then tries without waiting
        assert not os.path.exists(tuning_file.cache_path())
        assert store.entry(KEY, "first") == result(0, 1) and store.entry(KEY, "second") == result(0, 2)
        (line,) = warnings_of(caplog)
        assert f"cannot lock {tuning_file.cache_path()}{tuning_file.LOCK_SUFFIX}" in line
        assert "more than 0.5 s" in line and "kept in memory" in line
    finally:
        release.set()
        holder.join(60)
    assert holder.exitcode == 0
    with caplog.at_level(logging.WARNING, logger="lib_attn"):
        store.put(KEY, FP, "third", result(0, 3))  # the lock is free again: everything is stored
    assert len(warnings_of(caplog)) == 1
    assert stored()[KEY]["entries"] == {n: result(0, i) for i, n in enumerate(["first", "second", "third"], 1)}


CORRUPT = {
    "truncated": b'{"schema": "lib_attn.tune/1", "machines": {',
    "not utf-8": b'{"schema": "lib_attn.tune/1", "machines": {}, "note": "\xff\xfe"}',
    "other schema": b'{"schema": "elsewhere/2", "machines": {}}',
    "not an object": b'[1, 2, 3]',
    "empty": b"",
}


@pytest.mark.parametrize("content", list(CORRUPT.values()), ids=list(CORRUPT))
def test_a_corrupt_file_is_set_aside_intact_and_named_in_the_log(cache, caplog, content):
    os.makedirs(cache)
    with open(tuning_file.cache_path(), "wb") as f:
        f.write(content)
    store = tuning_file.Store()
    with caplog.at_level(logging.WARNING, logger="lib_attn"):
        assert store.entry(KEY, "sig") is None
        store.put(KEY, FP, "sig", result(1, 1))
    (aside,) = set_aside_files(cache)
    aside = os.path.join(cache, aside)
    with open(aside, "rb") as f:
        assert f.read() == content
    (line,) = warnings_of(caplog)
    assert line.startswith(f"attention tuning: {tuning_file.cache_path()} is no tuning file (") and f" {aside} " in line
    assert stored() == {KEY: {"fingerprint": FP, "entries": {"sig": result(1, 1)}}}


def test_corrupt_files_in_a_row_get_names_of_their_own(cache, caplog, monkeypatch):
    monkeypatch.setattr(tuning_file, "_stamp", lambda: "20250102-030405")  # all within one second
    os.makedirs(cache)
    earlier = os.path.join(cache, tuning_file.FILE_NAME + ".corrupt-20250102-030405")
    with open(earlier, "w") as f:
        f.write("set aside before")
    with caplog.at_level(logging.WARNING, logger="lib_attn"):
        for n in (1, 2):
            with open(tuning_file.cache_path(), "w") as f:
                f.write(f"corrupt {n}")
            tuning_file.Store().put(KEY, FP, f"sig{n}", result(n, n))
    names = set_aside_files(cache)
    assert names == [os.path.basename(earlier), os.path.basename(earlier) + "-2", os.path.basename(earlier) + "-3"]
    contents = []
    for name in names:
        with open(os.path.join(cache, name)) as f:
            contents.append(f.read())
    assert contents == ["set aside before", "corrupt 1", "corrupt 2"]
    lines = warnings_of(caplog)
    assert len(lines) == 2 and f"{earlier}-2 " in lines[0] and f"{earlier}-3 " in lines[1]
    assert stored()[KEY]["entries"] == {"sig2": result(2, 2)}


def test_a_corrupt_file_that_cannot_be_moved_is_not_overwritten(cache, caplog, monkeypatch):
    def refuse(path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(tuning_file, "_set_aside", refuse)
    os.makedirs(cache)
    with open(tuning_file.cache_path(), "w") as f:
        f.write("corrupt")
    store = tuning_file.Store()
    with caplog.at_level(logging.WARNING, logger="lib_attn"):
        store.put(KEY, FP, "one", result(1, 1))
        store.put(KEY, FP, "two", result(1, 2))
    (line,) = warnings_of(caplog)
    assert f"cannot set aside {tuning_file.cache_path()} (PermissionError" in line and "kept in memory" in line
    with open(tuning_file.cache_path()) as f:
        assert f.read() == "corrupt"
    assert store.entry(KEY, "two") == result(1, 2)


def _unreadable_directory(path):
    os.makedirs(path)  # a directory where the file should be: open() fails, as for an unreadable file
    return lambda: os.path.isdir(path)


def _no_permission(path):
    if os.name == "nt" or os.geteuid() == 0:
        pytest.skip("file permissions do not stop this user from reading")
    with open(path, "w") as f:
        json.dump({"schema": tuning_file.SCHEMA, "machines": {}}, f)
    os.chmod(path, 0)
    return lambda: os.stat(path).st_size > 0 and os.stat(path).st_mode & 0o777 == 0


@pytest.mark.parametrize("make", [_unreadable_directory, _no_permission], ids=["directory", "no-permission"])
def test_an_unreadable_file_is_left_alone_and_tuning_stays_in_memory(cache, caplog, make):
    os.makedirs(cache)
    unchanged = make(tuning_file.cache_path())
    store = tuning_file.Store()
    try:
        with caplog.at_level(logging.WARNING, logger="lib_attn"):
            store.put(KEY, FP, "one", result(1, 1))
            store.put(KEY, FP, "two", result(1, 2))
        (line,) = warnings_of(caplog)
        assert f"cannot use {tuning_file.cache_path()} (" in line and "kept in memory" in line
        assert store.entry(KEY, "one") == result(1, 1) and store.entry(KEY, "two") == result(1, 2)
        assert unchanged() and set_aside_files(cache) == []
    finally:
        if os.path.isfile(tuning_file.cache_path()):
            os.chmod(tuning_file.cache_path(), 0o600)


def test_the_lock_excludes_a_second_holder_until_released(cache):
    os.makedirs(cache)
    path = str(cache / "x.lock")
    first, second = FileLock(path), FileLock(path)
    first.acquire(0)
    with pytest.raises(TimeoutError, match="holds it for more than 0.05 s"):
        second.acquire(0.05)
    first.release()
    second.acquire(0)
    second.release()
    assert os.path.exists(path)  # the lock file stays for the next holder
