"""Tuning: ranking by measurement with an output check, the stored file, and registered backends."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

import lib_attn
from lib_attn import _compat, check, tune
from lib_attn import tuning_file
from lib_attn.chains import default_chain
from tests import tune_backends
from tests.engine_helpers import fresh_engine_with, make_qkv, reference, rel_err
from host_attn import status as host_status

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALLS = tune_backends.CALLS


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    with fresh_engine_with(monkeypatch, tmp_path, tune_backends):
        yield


def qkv(n=48, seed=1):
    return make_qkv(1, 2, n, 40, 16, torch.float32, seed=seed)


def ranked_chain():
    lib_attn.configure(preference=list(tune_backends.IDS), tune="on")


def test_tuning_picks_the_fastest_correct_backend_and_says_why_the_others_lost():
    ranked_chain()
    q, k, v = qkv()
    with lib_attn.recording() as rec:
        out = lib_attn.attention(q, k, v)
    assert rel_err(out, reference(q, k, v)) < 1e-5
    d = lib_attn.explain(q, k, v)
    assert d.backend == "tt-quick" and d.source == "measured"
    assert list(d.timings) == ["tt-quick", "tt-slow"]  # fastest first
    assert d.timings["tt-quick"] < d.timings["tt-slow"]
    wrong = d.reasons_for("tt-wrong")
    assert len(wrong) == 1 and wrong[0].startswith("output check failed: rel err ")
    bound = check.BOUNDS[torch.float32]
    assert wrong[0].endswith(f" > {bound:.1e}") and float(wrong[0].split()[5]) > bound
    assert d.reasons_for("tt-raise") == ["RuntimeError: no kernel image for this device"]
    # The head of the chain took the call and only lost on time: no fallback to count or report.
    assert rec.calls == {("unet", "tt-quick"): 1} and not rec.fallbacks
    assert rec.tuned == {("unet", "tt-quick")}
    assert "[tuned: measured]" in str(d) and "output check failed" in str(d)
    # Every candidate ran a bounded number of times, the winner once more for the call itself.
    assert 1 <= CALLS["tt-slow"] <= tune.REPS and CALLS["tt-wrong"] == 1 and CALLS["tt-raise"] == 1
    before = dict(CALLS)
    lib_attn.attention(q, k, v)
    assert CALLS["tt-quick"] == before["tt-quick"] + 1 and CALLS["tt-slow"] == before["tt-slow"]


def test_a_head_that_fails_its_output_check_is_a_counted_fallback():
    lib_attn.configure(preference=["tt-wrong", "tt-slow"], tune="on")
    q, k, v = qkv()
    with lib_attn.recording() as rec:
        out = lib_attn.attention(q, k, v)
    assert rel_err(out, reference(q, k, v)) < 1e-5
    ((key, n),) = rec.fallbacks.items()
    assert key[:2] == ("unet", "tt-wrong") and key[2].startswith("output check failed") and n == 1
    with lib_attn.use(strict=True), pytest.raises(lib_attn.AttentionFallbackError, match="output check failed"):
        lib_attn.attention(q, k, v)


def test_every_candidate_failing_leaves_the_rest_of_the_chain_in_order():
    lib_attn.configure(preference=["tt-wrong", "tt-raise"], tune="on")
    q, k, v = qkv()
    out = lib_attn.attention(q, k, v)
    assert rel_err(out, reference(q, k, v)) < 1e-5
    d = lib_attn.explain(q, k, v)
    assert d.backend == "sdpa" and d.source == "order"  # the default chain behind the user's
    assert d.reasons_for("tt-wrong")[0].startswith("output check failed")


def test_default_chain_is_ranked_on_cpu_when_tuning_is_on():
    lib_attn.configure(tune="on")
    q, k, v = qkv()
    out = lib_attn.attention(q, k, v)
    d = lib_attn.explain(q, k, v)
    assert d.source == "measured" and set(d.timings) == {"sdpa", "math"}
    assert d.backend == min(d.timings, key=d.timings.get)
    assert rel_err(out, reference(q, k, v)) < 1e-5
    assert not any(bid.startswith("tt-") for bid in d.timings)  # registered: never in a default chain


def test_auto_measures_only_on_cuda_devices():
    q, k, v = qkv()
    lib_attn.attention(q, k, v)
    assert lib_attn.config().tune == "auto" and lib_attn.explain(q, k, v).source == "order"
    assert not os.path.exists(tuning_file.cache_path())
    assert tune.enabled("auto", "cuda") and not tune.enabled("auto", "cpu") and not tune.enabled("off", "cuda")


def test_a_single_named_backend_is_never_ranked():
    lib_attn.configure(preference=["tt-slow"], tune="on")
    q, k, v = qkv()
    lib_attn.attention(q, k, v)
    assert dict(CALLS) == {"tt-slow": 1}
    assert lib_attn.explain(q, k, v).source == "order"
    lib_attn.configure(preference="auto", guard="off")
    lib_attn.attention(q, k, v, backend="tt-wrong")  # named per call, the guard off: runs as asked
    assert CALLS["tt-wrong"] == 1 and lib_attn.explain(q, k, v, backend="tt-wrong").backend == "tt-wrong"


def test_approximate_backends_are_ranked_only_where_the_chain_names_them(monkeypatch):
    monkeypatch.setattr(tune_backends.Quick, "approximate", True)
    lib_attn.configure(tune="on")
    q, k, v = qkv()
    lib_attn.attention(q, k, v)
    assert "tt-quick" not in lib_attn.explain(q, k, v).timings
    lib_attn.configure(preference=["tt-slow", "tt-quick"])
    lib_attn.attention(q, k, v)
    assert set(lib_attn.explain(q, k, v).timings) == {"tt-slow", "tt-quick"}


def run_process(cache: str) -> dict:
    env = dict(os.environ, **{tuning_file.ENV_DIR: cache})
    done = subprocess.run([sys.executable, "-m", "tests.tune_backends"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_uses_the_stored_ranking_without_measuring(tmp_path):
    first = run_process(str(tmp_path / "shared"))
    assert first["source"] == "measured" and first["backend"] == "tt-quick"
    assert first["calls"]["tt-slow"] >= 1 and first["calls"]["tt-wrong"] == 1
    second = run_process(str(tmp_path / "shared"))
    assert second == {"calls": {"tt-quick": 1}, "source": "stored", "backend": "tt-quick"}


def test_a_changed_fingerprint_measures_again(monkeypatch):
    ranked_chain()
    q, k, v = qkv()
    lib_attn.attention(q, k, v)
    lib_attn.reset()  # a new process in all but the in-memory store
    ranked_chain()
    assert lib_attn.explain(q, k, v).source == "stored"
    lib_attn.attention(q, k, v)
    assert lib_attn.explain(q, k, v).source == "stored"
    slow_calls = CALLS["tt-slow"]
    monkeypatch.setattr(tune_backends.Slow, "version", "2.0", raising=False)  # an upgraded package
    from lib_attn import kernels
    kernels.reset_probes()
    lib_attn.reset()
    ranked_chain()
    assert lib_attn.explain(q, k, v).source == "order"  # nothing stored for this fingerprint
    lib_attn.attention(q, k, v)
    assert lib_attn.explain(q, k, v).source == "measured" and CALLS["tt-slow"] > slow_calls
    with open(tuning_file.cache_path()) as f:
        assert len(json.load(f)["machines"]) == 2  # the old machine's entries stay, unused


def test_a_corrupt_file_costs_one_log_line_and_is_set_aside(caplog):
    os.makedirs(tuning_file.cache_dir())
    corrupt = '{"schema": "lib_attn.tune/1", "machines": {'
    with open(tuning_file.cache_path(), "w") as f:
        f.write(corrupt)
    ranked_chain()
    with caplog.at_level(logging.WARNING, logger="lib_attn"):
        for n in (48, 56, 64):
            q, k, v = qkv(n)
            out = lib_attn.attention(q, k, v)
            assert rel_err(out, reference(q, k, v)) < 1e-5
            assert lib_attn.explain(q, k, v).source == "measured"
    lines = [r.getMessage() for r in caplog.records if "tuning" in r.getMessage()]
    (aside,) = [n for n in os.listdir(tuning_file.cache_dir()) if n.startswith(tuning_file.FILE_NAME + ".corrupt-")]
    aside = os.path.join(tuning_file.cache_dir(), aside)
    assert len(lines) == 1 and f"{tuning_file.cache_path()} is no tuning file" in lines[0] and aside in lines[0]
    with open(aside) as f:
        assert f.read() == corrupt
    with open(tuning_file.cache_path()) as f:
        assert len(next(iter(json.load(f)["machines"].values()))["entries"]) == 3


def test_an_unwritable_directory_keeps_tuning_in_memory(monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(tuning_file.ENV_DIR, str(blocker / "cache"))
    ranked_chain()
    with caplog.at_level(logging.WARNING, logger="lib_attn"):
        for n in (48, 56):
            q, k, v = qkv(n)
            lib_attn.attention(q, k, v)
            assert lib_attn.explain(q, k, v).backend == "tt-quick"
    assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 1
    lib_attn.reset()
    ranked_chain()
    assert lib_attn.explain(q, k, v).source == "stored"  # kept in memory for this process


def test_two_writers_keep_each_others_entries(tmp_path):
    ranked_chain()
    other = tuning_file.Store()
    other.load()  # another process read the (missing) file before this one wrote
    q, k, v = qkv()
    lib_attn.attention(q, k, v)
    other.put("elsewhere", {"device": "x"}, "sig", {"timings": {"sdpa": 1.0}, "rejected": {}})
    with open(tuning_file.cache_path()) as f:
        machines = json.load(f)["machines"]
    assert "elsewhere" in machines and len(machines) == 2
    assert [p for p in os.listdir(tuning_file.cache_dir()) if p.endswith(".tmp")] == []


def test_clear_forgets_stored_rankings():
    ranked_chain()
    q, k, v = qkv()
    lib_attn.attention(q, k, v)
    assert tuning_file.table()["entries"]
    assert tuning_file.clear() and not os.path.exists(tuning_file.cache_path())
    lib_attn.reset()
    ranked_chain()
    assert lib_attn.explain(q, k, v).source == "order"


@pytest.mark.parametrize("gate", ["compiling", "in_backward"])
def test_no_tuning_while_tracing_or_in_backward(monkeypatch, gate):
    ranked_chain()
    monkeypatch.setattr(_compat, gate, lambda: True)
    q, k, v = qkv()
    lib_attn.attention(q, k, v)
    assert dict(CALLS) == {"tt-slow": 1}  # the fixed order: the chain's head
    monkeypatch.setattr(_compat, gate, lambda: False)
    lib_attn.attention(q, k, v)  # the blocked decision was not kept: this call tunes
    assert lib_attn.explain(q, k, v).source == "measured"


def test_no_tuning_while_a_cuda_graph_is_captured(monkeypatch):
    ranked_chain()
    monkeypatch.setattr(_compat, "capturing", lambda device_type: True)
    q, k, v = qkv()
    lib_attn.attention(q, k, v)
    assert dict(CALLS) == {"tt-slow": 1}
    assert tune.blocked("cpu") == "a CUDA graph is being captured"


def test_the_backward_gate_is_real():
    ranked_chain()
    q, k, v = qkv()
    seen = []
    x = torch.ones(3, requires_grad=True)
    x.register_hook(lambda g: seen.append((_compat.in_backward(), lib_attn.attention(q, k, v))) or g)
    (x * 2).sum().backward()
    assert seen[0][0] is True and dict(CALLS) == {"tt-slow": 1}
    assert _compat.in_backward() is False


@pytest.mark.skipif(_compat.TORCH_VERSION < (2, 3), reason="torch.compiler.is_compiling arrives in torch 2.3; "
                    "older torch answers through torch._dynamo.is_compiling")
def test_the_compile_gate_is_real():
    def probe(x):
        return x + 1 if _compat.compiling() else x - 1
    compiled = torch.compile(probe, backend="eager", fullgraph=True)
    assert compiled(torch.zeros(1)).item() == 1.0
    assert probe(torch.zeros(1)).item() == -1.0


def test_a_masked_bshd_call_is_checked_on_its_own_rows():
    lib_attn.configure(preference=["tt-slow", "tt-quick"], tune="on")
    q, k, v = make_qkv(2, 2, 70, 30, 16, torch.float32, layout="bshd", seed=4)
    mask = torch.rand(2, 2, 70, 30) > 0.3
    mask[..., 0] = True
    out = lib_attn.attention(q, k, v, layout="bshd", mask=mask.transpose(1, 1))
    assert rel_err(out, reference(q, k, v, mask=mask, layout="bshd")) < 1e-5
    assert lib_attn.explain(q, k, v, layout="bshd", mask=mask).source == "measured"


def test_fingerprint_covers_every_device_field_and_backend_versions():
    device = lib_attn.device_info("cpu")
    fp = tuning_file.fingerprint(device)
    assert fp["device"] == json.loads(json.dumps(__import__("dataclasses").asdict(device)))
    assert fp["torch"] == torch.__version__ and "sdpa" in fp["backends"] and "tt-quick" in fp["backends"]
    assert tuning_file.fingerprint_key(fp) == tuning_file.fingerprint_key(tuning_file.fingerprint(device))


# --- registering backends ----------------------------------------------------------------------

class Smallest(lib_attn.Backend):
    id = "my-kernel"
    label = "My kernel"
    devices = ("cpu",)
    dtypes = (torch.float32,)

    def run(self, q, k, v, mask, scale):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def test_the_smallest_backend_is_valid_everywhere_a_built_in_id_is():
    lib_attn.register_backend(Smallest())
    try:
        assert "my-kernel" in lib_attn.BACKEND_IDS and lib_attn.BACKEND_IDS[-1] == "my-kernel"
        assert list(lib_attn.BACKEND_IDS).count("my-kernel") == 1
        info = {b.id: b for b in lib_attn.backends()}["my-kernel"]
        assert info.available and info.label == "My kernel"
        lib_attn.configure(preference=["my-kernel"])
        q, k, v = qkv()
        with lib_attn.recording() as rec:
            out = lib_attn.attention(q, k, v)
        assert rec.calls == {("unet", "my-kernel"): 1} and rel_err(out, reference(q, k, v)) < 1e-5
        assert lib_attn.explain(q, k, v, fp32="keep").backend == "my-kernel"
        half = [t.to(torch.bfloat16) for t in (q, k, v)]
        assert "dtype bfloat16 not supported (fp32)" in lib_attn.explain(*half).reasons_for("my-kernel")
        for role in lib_attn.ROLES:
            assert "my-kernel" not in default_chain(role, lib_attn.device_info("cpu"))
    finally:
        lib_attn.unregister_backend("my-kernel")
    assert "my-kernel" not in lib_attn.BACKEND_IDS
    with pytest.raises(ValueError, match="valid ids"):
        lib_attn.configure(preference=["my-kernel"])


def test_register_backend_refuses_what_it_cannot_use():
    with pytest.raises(TypeError):
        lib_attn.register_backend(object())

    class Clash(Smallest):
        id = "sdpa"
    with pytest.raises(ValueError, match="built-in"):
        lib_attn.register_backend(Clash())

    class NoRun(lib_attn.Backend):
        id, devices, dtypes = "no-run", ("cpu",), (torch.float32,)
    with pytest.raises(ValueError, match="run"):
        lib_attn.register_backend(NoRun())
    with pytest.raises(ValueError, match="built-in"):
        lib_attn.unregister_backend("math")


def test_backend_ids_stay_a_tuple_like_sequence():
    ids = lib_attn.BACKEND_IDS
    assert ids == tuple(ids) and ids[0] == "flash-attn" and ids[-1] in ids
    assert ("auto",) + tuple(ids) == ("auto",) + ids and len(ids) == len(tuple(ids))
    assert ", ".join(ids).startswith("flash-attn, ")


def test_tune_setting_values():
    assert lib_attn.configure(tune=True).tune == "on"
    assert lib_attn.configure(tune="off").tune == "off"
    with lib_attn.use(tune="on"):
        assert lib_attn.config().tune == "on"
    assert lib_attn.config().tune == "off"
    with pytest.raises(ValueError, match="tune"):
        lib_attn.configure(tune="fast")


def test_a_failing_measurement_leaves_the_fixed_order_and_the_call_intact(monkeypatch, caplog):
    ranked_chain()
    monkeypatch.setattr(check, "reference", lambda *a: (_ for _ in ()).throw(RuntimeError("out of memory")))
    q, k, v = qkv()
    with caplog.at_level(logging.WARNING, logger="lib_attn"):
        out = lib_attn.attention(q, k, v)
    assert rel_err(out, reference(q, k, v)) < 1e-5
    assert lib_attn.explain(q, k, v).source == "order" and dict(CALLS) == {"tt-slow": 1}
    assert any("could not measure" in r.getMessage() for r in caplog.records)


def test_tune_command_ranks_a_models_calls_and_clear_forgets_them(capsys):
    from lib_attn import shapes
    from lib_attn.__main__ import main

    assert main(["tune", "--model", "sd15", "--res", "64"]) == 0
    text = capsys.readouterr().out
    calls = shapes.model_calls("sd15", 64)
    assert f"results in {tuning_file.cache_path()}" in text and "winner" in text and "fixed order" in text
    assert f"tuning cost: " in text and f"for {len(calls)} call kinds" in text
    for call in calls:
        line = next(ln for ln in text.splitlines() if ln.startswith(call.where + " "))
        assert line.split()[-5] in ("sdpa", "math") and line.rstrip().endswith("ms") and "×" in line
    assert len(tuning_file.table()["entries"]) == len(calls)
    # On a CPU, tuning is off in use by default: the stored rankings serve only runs with it on, as it says.
    assert 'note: tuning is auto on cpu in use, so later runs use these rankings only with tuning on' in text
    assert lib_attn.config().tune == "auto"  # the command's tuning was scoped
    assert main(["tune", "--model", "sd15", "--res", "64"]) == 0
    assert capsys.readouterr().out.count(" stored") == len(calls)  # a second run measures nothing
    assert main(["tune", "--clear"]) == 0
    assert "removed" in capsys.readouterr().out and not tuning_file.table()["entries"]


# --- switches: flag, setting, the webui's layers, the JSON route ---------------------------------

def test_flag_and_setting_reach_the_engine():
    import argparse

    from tests.test_preload import parser_with_flags
    from webui_attn.ui import api
    from webui_attn.settings import flags, layers, stored

    opts = parser_with_flags().parse_args(["--attn-tune", "on"])
    assert flags.layer_from(opts) == {"tune": "on"} and flags.problems(opts) == []
    with pytest.raises(SystemExit):
        parser_with_flags().parse_args(["--attn-tune", "fast"])
    assert parser_with_flags().parse_args([]).attn_tune is None
    assert flags.problems(argparse.Namespace(attn_tune="fast")) == ["--attn-tune 'fast': must be on or off. The flag is ignored."]
    # A registered id is valid wherever a built-in one is.
    assert flags.parse_ids("tt-quick, sdpa") == (["tt-quick", "sdpa"], [])
    assert stored.layer_from({stored.KEY_BACKEND: "tt-quick"}) == {
        "preference": {"unet": ["tt-quick"], "dit": ["tt-quick"]}}
    assert "tt-quick" in stored.backend_choices()
    assert stored.DEFAULTS[stored.KEY_TUNE] == "Auto"
    assert stored.layer_from({stored.KEY_TUNE: "Auto"}) is None
    assert stored.layer_from({stored.KEY_TUNE: "off"}) == {"tune": "off"}
    try:
        layers.set_layer("flags", flags.layer_from(opts))
        assert lib_attn.config().tune == "on"
        layers.set_layer("settings", stored.layer_from({stored.KEY_TUNE: "off"}))  # the setting wins
        assert lib_attn.config().tune == "off"
        layers.set_layer("settings", None)
        q, k, v = qkv()
        lib_attn.attention(q, k, v)
        status = host_status.tuning()
        assert status["mode"] == "on" and status["active"] and status["file"] == tuning_file.cache_path()
        assert api.status()["tuning"]["file"] == "tuning.json"  # the route names the file, never its path
        (entry,) = status["entries"]
        assert entry["call"]["shape"] == [1, 2, 48, 40, 16] and set(entry["timings"]) == {"sdpa", "math"}
        assert entry["winner"] == min(entry["timings"], key=entry["timings"].get)
        assert status["fingerprint"]["torch"] == torch.__version__
    finally:
        layers.reset()


def test_a_candidate_out_of_memory_is_rejected_for_now_but_not_stored(monkeypatch):
    def oom(self, q, k, v, mask, scale):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
    monkeypatch.setattr(tune_backends.Raises, "run", oom)
    ranked_chain()
    q, k, v = qkv()
    lib_attn.attention(q, k, v)
    d = lib_attn.explain(q, k, v)
    assert d.source == "measured" and d.reasons_for("tt-raise")[0].startswith("OutOfMemoryError: CUDA out of memory")
    assert tuning_file.table()["entries"] == []  # the next process measures again


def test_under_autocast_kernels_are_held_to_autocasts_bound():
    lib_attn.configure(tune="on")
    q, k, v = make_qkv(2, 4, 96, 77, 40, torch.float32, seed=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lib_attn.attention(q, k, v)
        d = lib_attn.explain(q, k, v)
    assert d.source == "measured" and set(d.timings) == {"sdpa", "math"} and not d.rejected, str(d)
    assert rel_err(out, reference(q, k, v)) < check.BOUNDS[torch.bfloat16]


def test_when_every_backend_fails_its_check_the_call_still_runs(monkeypatch):
    lib_attn.configure(tune="on", guard="off")  # tuning's own rule (the guard would go on to math)
    monkeypatch.setattr(check, "check", lambda *a: "output check failed: rel err 1.0e+00 > 5.0e-03")
    q, k, v = qkv()
    out = lib_attn.attention(q, k, v)
    assert rel_err(out, reference(q, k, v)) < 1e-5
    assert lib_attn.explain(q, k, v).backend == "sdpa"


def test_a_long_call_is_timed_on_a_part_that_keeps_the_device_full(monkeypatch):
    q, k, v = make_qkv(2, 24, 4096, 4096, 64, torch.float16, layout="bshd", seed=0)
    mask = torch.ones(2, 1, 1, 4096, dtype=torch.bool)
    per_head = 4 * 4096 * 4096 * 64
    monkeypatch.setattr(tune, "_processors", lambda device: 132)  # an H100's SMs
    monkeypatch.setattr(tune, "TIMED_WORK", {"cpu": 2 * 24 * per_head})
    assert tune.timed_part(q, k, v, mask, "bshd") == ((q, k, v, mask), 1.0)
    monkeypatch.setattr(tune, "TIMED_WORK", {"cpu": 3 * per_head})
    (pq, pk, pv, pm), share = tune.timed_part(q, k, v, mask, "bshd")
    # 4096 queries are 32 tiles of 128 rows a head: 4 waves over 132 SMs need 17 heads, more than the work budget.
    assert pq.shape == (1, 4096, 17, 64) and pk.shape == pv.shape == (1, 4096, 17, 64) and pm.shape == (1, 1, 1, 4096)
    assert share == 17 / 48
    assert pq.data_ptr() == q.data_ptr() and pk.data_ptr() == k.data_ptr()  # views: nothing copied
    monkeypatch.setattr(tune, "_processors", lambda device: 2)
    (pq, *_), share = tune.timed_part(q, k, v, mask, "bshd")
    assert pq.shape == (1, 4096, 3, 64) and share == 3 / 48  # the work budget rules
    monkeypatch.setattr(tune, "TIMED_WORK", {"cpu": 30 * per_head})
    (pq, *_), share = tune.timed_part(q, k, v, mask, "bshd")
    assert pq.shape == (2, 4096, 24, 64) and share == 1.0  # past one item's heads: whole items


def test_a_parts_timings_stand_for_the_whole_call(monkeypatch):
    shapes_seen = []
    real = tune_backends.Quick.run

    def run(self, q, k, v, mask, scale):
        shapes_seen.append(tuple(q.shape))
        return real(self, q, k, v, mask, scale)
    monkeypatch.setattr(tune_backends.Quick, "run", run)
    monkeypatch.setattr(tune._Timer, "times", lambda self, fn, n: [fn() is None or 1e-3 for _ in range(n)])
    monkeypatch.setattr(tune, "SLOWER", 1e9)  # on a loaded machine tt-slow's checked call is not its time
    monkeypatch.setattr(tune, "TIMED_WORK", {"cpu": 1.0})
    monkeypatch.setattr(tune, "_processors", lambda device: 1)
    lib_attn.configure(preference=["tt-quick", "tt-slow"], tune="on")
    q, k, v = make_qkv(1, 4, 600, 300, 32, torch.float32, seed=2)
    out = lib_attn.attention(q, k, v)
    assert rel_err(out, reference(q, k, v)) < 1e-5
    d = lib_attn.explain(q, k, v)
    assert d.source == "measured" and d.timings == {"tt-quick": pytest.approx(4e-3), "tt-slow": pytest.approx(4e-3)}
    probe, part, *timed, call = shapes_seen
    assert probe[:2] == (1, 1) and probe[2] < 600  # the probe's copies
    assert part == (1, 1, 600, 32) and all(t == part for t in timed) and call == (1, 4, 600, 32)
