"""``python -m lib_attn bench``: a short real CPU run, its JSON, table, reasons and chart;
and the pure parts (statistics, references, per-step sums, progress) on their own."""
from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import lib_attn
from lib_attn import shapes
from lib_attn.commands import bench
from tests.engine_helpers import reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLUMNS = ["auto", "sdpa-math", "sdpa-efficient", "flash-attn"]
RES = 192  # SD1.5's first level has 576 tokens: its fp32 score matrix (20 MiB) dwarfs the output


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """One real run of the CLI on SD1.5 at 192², kept to a few seconds of timing."""
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "-m", "lib_attn", "bench", "--model", "sd15", "--res", str(RES),
           "--backends", *COLUMNS, "--budget", "0.02", "--overhead-rounds", "5",
           "--json", str(out / "run.json")]
    plot = None
    try:
        import matplotlib  # noqa: F401
        plot = out / "run.png"
        cmd += ["--plot", str(plot)]
    except ImportError:
        pass
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return {"doc": json.loads((out / "run.json").read_text()), "stdout": proc.stdout,
            "stderr": proc.stderr, "plot": plot}


def test_json_schema(short_run):
    doc = short_run["doc"]
    assert doc["schema"] == bench.SCHEMA
    assert {"created", "command", "versions", "device", "settings", "backends", "calls", "results",
            "per_step", "overhead"} <= set(doc)
    v = doc["versions"]
    assert v["torch"] == torch.__version__ and v["python"] and "lib_attn" in v
    assert set(v["backends"]) == set(lib_attn.BACKEND_IDS)
    assert doc["device"]["type"] == "cpu"
    s = doc["settings"]
    assert s["columns"] == COLUMNS and s["models"] == ["sd15"] and s["res"] == RES
    assert s["timer"] == "perf_counter_ns" and s["dtypes"] == ["float32"]
    assert len(doc["calls"]) == len(shapes.model_calls("sd15", RES))
    assert sum(c["calls"] for c in doc["calls"]) == 32
    assert len(doc["results"]) == len(doc["calls"]) * len(COLUMNS)
    for r in doc["results"]:
        assert r["status"] in ("ok", "unsupported", "fell back", "failed")
        assert set(r) >= {"model", "res", "dtype", "where", "backend", "reason", "ran", "median_us",
                          "p20_us", "p80_us", "samples", "tflops", "peak_extra_mib", "first_call_extra_mib",
                          "rel_l2_error", "max_abs_error", "h200_floor_pct"}
        assert r["h200_floor_pct"] is None  # only on an H200


def test_cells_that_ran_have_consistent_numbers(short_run):
    doc = short_run["doc"]
    calls = {c["where"]: c for c in doc["calls"]}
    calls_at_res = {c.where: c for c in shapes.model_calls("sd15", RES)}
    ok = [r for r in doc["results"] if r["status"] == "ok"]
    assert {r["backend"] for r in ok} == {"auto", "sdpa-math"}
    for r in ok:
        assert r["samples"] >= doc["settings"]["min_rounds"]
        assert 0 < r["p20_us"] <= r["median_us"] <= r["p80_us"]
        c = calls[r["where"]]
        assert r["tflops"] == pytest.approx(4 * c["b"] * c["heads"] * c["q_len"] * c["kv_len"] * c["head_dim"]
                                            / (r["median_us"] * 1e-6) / 1e12)
        if r["backend"] == "auto":
            # The auto column runs tuned: the candidate tuning measured fastest on this call kind.
            assert r["tuned"] == "measured" and set(r["timings_us"]) == {"sdpa", "math"}
            assert r["ran"] == min(r["timings_us"], key=r["timings_us"].get)
            q, k, v = bench.make_inputs(calls_at_res[r["where"]], torch.float32, torch.device("cpu"))
            assert r["ran"] in (lib_attn.explain(q, k, v, role="unet").backend, "math")
        else:
            assert r["ran"] == r["backend"]
        assert r["rel_l2_error"] < 1e-5  # float32 against float64


def test_the_auto_column_says_it_runs_tuned(short_run):
    assert short_run["doc"]["settings"]["tune"] == "on"
    assert "auto: tuned: the engine measured" in short_run["stdout"]
    assert any(line.rstrip().endswith("(measured)") for line in short_run["stdout"].splitlines())


def test_per_step_is_the_call_weighted_sum(short_run):
    doc = short_run["doc"]
    calls = {c["where"]: c["calls"] for c in doc["calls"]}
    for step in doc["per_step"]:
        mine = [r for r in doc["results"] if r["backend"] == step["backend"]]
        if all(r["status"] == "ok" for r in mine):
            expected = sum(r["median_us"] * calls[r["where"]] for r in mine) / 1e3
            assert step["ms"] == pytest.approx(expected) and step["missing"] == []
            assert step["tflops"] == pytest.approx(shapes.step_flops("sd15", RES) / (expected * 1e-3) / 1e12)
        else:
            assert step["ms"] is None and step["missing"]
    assert {s["backend"]: s["ms"] is not None for s in doc["per_step"]} == {
        "auto": True, "sdpa-math": True, "sdpa-efficient": False, "flash-attn": False}


def test_unsupported_cells_show_the_engines_reasons(short_run):
    doc, text = short_run["doc"], short_run["stdout"]
    info = {b.id: b for b in lib_attn.backends()}
    calls = {c.where: c for c in shapes.model_calls("sd15", RES)}
    for r in doc["results"]:
        if r["backend"] not in ("sdpa-efficient", "flash-attn"):
            continue
        assert r["status"] == "unsupported" and r["median_us"] is None
        if not info[r["backend"]].available:
            expected = f"not available: {info[r['backend']].reason}"
        else:
            q, k, v = bench.make_inputs(calls[r["where"]], torch.float32, torch.device("cpu"))
            decision = lib_attn.explain(q, k, v, role="unet", backend=r["backend"])
            expected = "; ".join(decision.reasons_for(r["backend"]))
        assert r["reason"] == expected and expected
        assert f"{r['backend']}: {expected}" in text  # the footnote under the table
    # The table cell points at its footnote instead of showing a number.
    row = next(l for l in text.splitlines() if l.startswith("self L0"))
    assert "n/a[" in row


def test_memory_separates_quadratic_from_fused(short_run):
    doc = short_run["doc"]
    assert doc["settings"]["memory_method"].startswith("RSS high-water mark")
    call = shapes.model_calls("sd15", RES)[0]
    scores_mib = call.b * call.heads * call.q_len * call.kv_len * 4 / 2**20
    output_mib = call.b * call.heads * call.q_len * call.head_dim * 4 / 2**20
    cells = {r["backend"]: r for r in doc["results"] if r["where"] == call.where}
    assert cells["sdpa-math"]["peak_extra_mib"] >= scores_mib
    assert output_mib * 0.9 <= cells["auto"]["peak_extra_mib"] < scores_mib / 4
    # The guard's first check of sdpa-math copies nothing but q, k and v (into host memory: here the same RAM),
    # which put the caller's tensors back should a kernel write into them: its first call needs what a steady
    # one does, plus them (and the fingerprints' few columns).
    inputs_mib = output_mib + 2 * call.b * call.heads * call.kv_len * call.head_dim * 4 / 2**20
    assert cells["sdpa-math"]["first_call_extra_mib"] < cells["sdpa-math"]["peak_extra_mib"] + inputs_mib + output_mib
    row = next(l for l in short_run["stdout"].split("peak extra memory per call")[1].splitlines()
               if l.startswith(call.where))
    assert f"{cells['sdpa-math']['peak_extra_mib']:.1f} ({cells['sdpa-math']['first_call_extra_mib']:.1f})" in row


def test_overhead_is_measured_against_direct_sdpa(short_run):
    ov = short_run["doc"]["overhead"]
    m = ov["sd15_cross_mid"]
    assert m["shape"] == {"b": 2, "heads": 8, "q_len": 64, "kv_len": 77, "head_dim": 160}
    assert m["engine_backend"] == "sdpa" and m["like_for_like"]
    assert m["direct_us"] > 0 and m["engine_us"] > 0 and m["rounds"] == 5
    assert math.isfinite(m["added_us"]) and m["added_p20_us"] <= m["added_us"] <= m["added_p80_us"]
    assert "added" in short_run["stdout"] and "engine overhead" in short_run["stdout"]
    assert ov["guard"] == "on" and "(current configuration, guard on)" in short_run["stdout"]  # the default's cost


def test_overhead_is_measured_again_with_a_schedule_in_force(short_run):
    sched = short_run["doc"]["overhead"]["schedule"]
    assert sched["text"] == bench.SCHEDULE and (sched["at_step"], sched["steps"]) == (10, 20)
    tiny = sched["tiny"]
    assert tiny["shape"] == {"b": 1, "heads": 1, "q_len": 16, "kv_len": 16, "head_dim": 64}
    assert tiny["engine_backend"] == "sdpa" and tiny["like_for_like"] and tiny["rounds"] == 5
    assert math.isfinite(tiny["added_us"]) and math.isfinite(sched["dispatch"]["added_us"])
    lines = short_run["stdout"].splitlines()
    at = lines.index(f"  with a schedule in force ({bench.SCHEDULE}), at step 10 of 20:")
    assert lines[at + 1].startswith("    (1,1,16,64)×16 float32: direct ") and "(ran sdpa)" in lines[at + 1]
    assert lines[at + 2].startswith("    dispatch alone: ")


def test_table_progress_and_chart(short_run):
    text = short_run["stdout"]
    assert f"SD1.5 @ {RES}, float32" in text
    header = next(l for l in text.splitlines() if l.startswith("call "))
    assert all(col in header for col in COLUMNS)
    assert "ms per step" in text and "peak extra memory" in text and "relative L2 error" in text
    # Not a terminal: a progress line per tenth, at the start of each long part and 10 s after the last
    # line while steps come, ending at 100%.
    progress = [l for l in short_run["stderr"].splitlines() if l.startswith("bench:")]
    seconds = int(progress[-1].split(" after ")[1].split("s")[0])
    assert 2 <= len(progress) <= 11 + 2 + seconds // 10 and "100%" in progress[-1]
    assert any(l.endswith("(engine overhead: measuring)") for l in progress)
    if short_run["plot"] is None:
        pytest.skip("matplotlib is not installed")
    data = short_run["plot"].read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plot_without_matplotlib_is_a_clear_usage_error(tmp_path):
    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('matplotlib hidden for this test')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "shadow") + os.pathsep + ROOT)
    proc = subprocess.run([sys.executable, "-m", "lib_attn", "bench", "--plot", str(tmp_path / "x.png")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--plot needs matplotlib" in proc.stderr and "pip install matplotlib" in proc.stderr
    assert not (tmp_path / "x.png").exists() and proc.stdout == ""


@pytest.mark.parametrize("argv, message", [
    (["--backends", "fastest"], "backends must be among"),
    (["--dtype", "fp8"], "dtype must be one of"),
    (["--res", "500"], "res must be a positive multiple of 8"),
    (["--model", "sd4"], "invalid choice"),
    (["--schedule", "0-50%: fastest"], "--schedule: schedule rule 1 ('0-50%: fastest'): unknown backend id 'fastest'"),
    (["--schedule", "halfway: sdpa"], "'halfway' is not a condition; valid conditions: A-B% (steps done)"),
])
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    from lib_attn.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


# ----------------------------------------------------------------- pure parts


def test_quantile_interpolates_between_order_statistics():
    values = [1.0, 2.0, 4.0, 8.0, 16.0]
    assert bench.quantile(values, 0.5) == 4.0
    assert bench.quantile(values, 0.0) == 1.0 and bench.quantile(values, 1.0) == 16.0
    assert bench.quantile(values, 0.2) == pytest.approx(1.8)  # 0.8 of the way from 1 to 2
    assert bench.quantile([3.0], 0.8) == 3.0
    with pytest.raises(ValueError):
        bench.quantile([], 0.5)


def test_inputs_have_a1111_strides():
    call = shapes.model_calls("sd15", 512)[1]  # cross L0: (2, 8, 4096, 77, 40)
    q, k, v = bench.make_inputs(call, torch.float32, torch.device("cpu"))
    assert q.shape == (2, 8, 4096, 40) and k.shape == v.shape == (2, 8, 77, 40)
    assert not q.is_contiguous()
    assert q.stride() == (4096 * 8 * 40, 40, 8 * 40, 1)


def test_sampled_rows_span_the_queries():
    assert bench.sample_rows(100, 256).tolist() == list(range(100))
    rows = bench.sample_rows(4096, 256).tolist()
    assert rows[0] == 0 and rows[-1] == 4095 and len(rows) == 256 and rows == sorted(set(rows))


def test_reference_rows_and_error_detect_a_wrong_row():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 16) for n in (300, 50, 50))
    rows = bench.sample_rows(300, 64)
    ref = bench.reference_rows(q, k, v, rows)
    assert torch.allclose(ref, reference(q, k, v)[:, :, rows, :])
    out = reference(q, k, v).float()
    rel, max_abs = bench.output_error(out, rows, ref)
    assert rel < 1e-6 and max_abs < 1e-5
    out[1, 2, rows[-1], :] += 1.0  # one wrong sampled row
    rel, max_abs = bench.output_error(out, rows, ref)
    assert rel > 1e-3 and max_abs == pytest.approx(1.0, abs=1e-5)


def _cell(where, backend, median, status="ok"):
    c = bench.Cell("sd15", 512, "float32", where, backend, status=status)
    c.median_us = median if status == "ok" else None
    c.reason = "" if status == "ok" else "why not"
    return c


def test_per_step_weights_by_calls_and_marks_incomplete_backends():
    calls = shapes.model_calls("sd15", 512)
    rows = [(c, "float32") for c in calls]
    cells = [_cell(c.where, "a", 100.0 * (i + 1)) for i, c in enumerate(calls)]
    cells += [_cell(c.where, "b", 10.0, status="unsupported" if i == 2 else "ok") for i, c in enumerate(calls)]
    steps = {s["backend"]: s for s in bench.per_step(rows, cells, ["a", "b"])}
    expected_ms = sum(100.0 * (i + 1) * c.calls for i, c in enumerate(calls)) / 1e3
    assert steps["a"]["ms"] == pytest.approx(expected_ms) and steps["a"]["calls"] == 32
    assert steps["a"]["gflop"] == pytest.approx(shapes.step_flops("sd15", 512) / 1e9)
    assert steps["b"]["ms"] is None and steps["b"]["missing"] == [calls[2].where]


def test_h200_floor_percentage_only_for_16_bit_on_an_h200():
    call = shapes.model_calls("flux", 1024)[0]
    env = {"device": {"name": "NVIDIA H200"}}
    for dtype, expected in (("bfloat16", True), ("float32", False)):
        c = bench.Cell("flux", 1024, dtype, call.where, "auto")
        c._times, c._walls = [0.001, 0.002, 0.0005], [0.0015]
        bench._finish_cell(c, call, env)
        assert c.median_us == pytest.approx(1000.0)
        if expected:
            assert c.h200_floor_pct == pytest.approx(100 * shapes.h200_floor_s(*call.shape) / 1e-3)
        else:
            assert c.h200_floor_pct is None
    c = bench.Cell("flux", 1024, "bfloat16", call.where, "auto")
    c._times, c._walls = [0.001], [0.001]
    bench._finish_cell(c, call, {"device": {"name": "NVIDIA A100"}})
    assert c.h200_floor_pct is None


def test_progress_prints_tenths_when_not_a_terminal():
    stream = io.StringIO()
    p = bench.Progress(40, stream=stream)
    for i in range(40):
        p.step(f"unit {i}")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 11 and lines[-1].startswith("bench: 100%")
    silent = io.StringIO()
    q = bench.Progress(3, enabled=False, stream=silent)
    q.step("x")
    assert silent.getvalue() == ""


def test_progress_says_a_long_part_as_it_starts_and_speaks_at_least_every_ten_seconds():
    stream, now = io.StringIO(), [0.0]
    p = bench.Progress(100, stream=stream, clock=lambda: now[0])
    p.step("unit 0")  # 1%: no tenth passed
    now[0] = 4.0
    p.starting("engine overhead: measuring")
    for i in range(1, 6):  # slow steps within one tenth: a line once 10 s have passed since the last
        now[0] += 3.0
        p.step(f"unit {i}")
    lines = stream.getvalue().splitlines()
    assert lines == ["bench:   1% after 0s (unit 0)", "bench:   1% after 4s (engine overhead: measuring)",
                     "bench:   5% after 16s (unit 4)"]


def test_footnotes_number_each_reason_once():
    notes = bench.Footnotes()
    assert notes.ref("a: x") == "[1]" and notes.ref("b: y") == "[2]" and notes.ref("a: x") == "[1]"
    assert notes.render().splitlines() == ["  [1] a: x", "  [2] b: y"]


def test_a_backend_passed_over_for_one_call_shows_that_calls_reasons(monkeypatch):
    # On a CPU every installed backend takes every model call, so the engine is made to pass one
    # over for a per-call reason, as it does on a GPU (head_dim limits, dtypes, masks).
    real_explain = lib_attn.explain

    def explain(q, k, v, **kwargs):
        if kwargs.get("backend") == "sdpa-flash":
            return lib_attn.Decision("sdpa", rejected=[("sdpa-flash", ["head_dim 512 > 256"])])
        return real_explain(q, k, v, **kwargs)

    monkeypatch.setattr(lib_attn, "explain", explain)
    doc = bench.run(bench.BenchSettings(models=["vae"], res=256, backends=["auto", "sdpa-flash"],
                                        budget_s=0.01, overhead=False, memory=False, progress=False))
    cells = {r["backend"]: r for r in doc["results"]}
    assert cells["sdpa-flash"]["status"] == "unsupported"
    assert cells["sdpa-flash"]["reason"] == "head_dim 512 > 256"
    assert cells["auto"]["status"] == "ok" and cells["auto"]["median_us"] > 0
    text = bench.render(doc)
    assert "n/a[1]" in next(l for l in text.splitlines() if l.startswith("mid "))
    assert "  [1] sdpa-flash: head_dim 512 > 256" in text.splitlines()
    assert "ms per decode" in text


def test_overhead_pins_pytorchs_choice_when_the_configuration_runs_another_kernel():
    threads = torch.get_num_threads()
    with lib_attn.use(preference=["math"]):
        ov = bench.engine_overhead(torch.device("cpu"), torch.float32, rounds=3, schedule=None)
    assert "schedule" not in ov
    assert ov["threads"] == 1 and torch.get_num_threads() == threads  # one thread, then restored
    assert ov["sd15_cross_mid"]["engine_backend"] == "math"
    assert not ov["sd15_cross_mid"]["like_for_like"]
    pinned = ov["sd15_cross_mid_sdpa"]
    assert pinned["pinned"] == "sdpa" and pinned["engine_backend"] == "sdpa" and pinned["like_for_like"]
    text = bench.render({"device": {"description": "cpu", "type": "cpu"}, "versions": {"torch": "x"},
                         "settings": {"timer": "t", "columns": [], "h200_floor": False, "load_average": None,
                                      "cpu_count": 2, "seconds": 1.0, "memory_method": "m",
                                      "reference": "r"},
                         "calls": [], "results": [], "per_step": [], "overhead": ov})
    assert "includes the kernel" in text and "ran sdpa, pinned" in text


def test_the_scheduled_overhead_runs_under_the_rule_at_its_step_and_restores_everything():
    from lib_attn import schedule as sched

    text = "0-20%: sdpa; 20-80%: math; 80-100%: sdpa"
    before = lib_attn.config()
    with lib_attn.recording() as rec:
        got = bench.scheduled_overhead(torch.device("cpu"), torch.float32, rounds=3, schedule=text)
    assert lib_attn.config() is before and sched.where.progress is None and sched.where.token is None
    # Every call the measurement made (the stubbed ones too) was taken by the window holding step 10 of 20.
    assert set(rec.rules) == {(text, "20-80%", "unet", "math")} and sum(rec.rules.values()) == rec.total() > 0
    assert got["tiny"]["engine_backend"] == "math" and not got["tiny"]["like_for_like"]
    ov = {"guard": "on", "threads": 1, "schedule": got}
    text_out = bench.render({"device": {"description": "cpu", "type": "cpu"}, "versions": {"torch": "x"},
                             "settings": {"timer": "t", "columns": [], "h200_floor": False, "load_average": None,
                                          "cpu_count": 2, "seconds": 1.0, "memory_method": "m", "reference": "r"},
                             "calls": [], "results": [], "per_step": [], "overhead": ov})
    lines = text_out.splitlines()
    at = lines.index(f"  with a schedule in force ({text}), at step 10 of 20:")
    assert "(ran math)" in lines[at + 1] and "includes the kernel" in lines[at + 2]


def test_the_video_presets_run_scaled_down_on_the_cpu_and_say_so(tmp_path):
    out = tmp_path / "wan.json"
    proc = subprocess.run([sys.executable, "-m", "lib_attn", "bench", "--model", "wan", "--res", "480",
                           "--video-scale", "32", "--backends", "auto", "sdpa", "--budget", "0.02",
                           "--no-overhead", "--no-progress", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["settings"]["video_scale"] == 32
    # Wan 2.1/2.2 14B at 832x480, 81 frames: 21 x 30 x 52 = 32,760 tokens in 40 heads of 128; 512 text tokens.
    calls = {c["where"]: c for c in doc["calls"]}
    assert set(calls) == {"self 480p ÷32", "cross 480p ÷32"}
    assert (calls["self 480p ÷32"]["heads"], calls["self 480p ÷32"]["q_len"], calls["self 480p ÷32"]["kv_len"]) == \
        (1, 32760 // 32, 32760 // 32)
    assert (calls["cross 480p ÷32"]["q_len"], calls["cross 480p ÷32"]["kv_len"]) == (32760 // 32, 512)
    assert all(c["head_dim"] == 128 and c["calls"] == 80 for c in calls.values())
    for r in doc["results"]:
        assert r["status"] == "ok" and r["first_call_extra_mib"] is not None and r["peak_extra_mib"] is not None
    assert "video calls at 1/32 of their video tokens and heads (--video-scale 32)" in proc.stdout
    assert "Wan 2.1/2.2 14B, 81 frames @ 480, float32" in proc.stdout


def test_video_calls_follow_the_models_facts():
    wan = {c.where: c for c in shapes.model_calls("wan")}
    assert wan["self 720p"].shape == (1, 40, 75600, 75600, 128) and wan["cross 720p"].shape == (1, 40, 75600, 512, 128)
    assert wan["self 480p"].q_len == 32760 and wan["self 720p"].calls == 40 * 2
    (hv,) = shapes.model_calls("hunyuan-video")
    assert hv.shape == (1, 24, 118800 + 256, 118800 + 256, 128) and hv.calls == 60
    scaled = shapes.scaled_down(hv, 8)
    assert (scaled.heads, scaled.q_len, scaled.kv_len) == (3, 118800 // 8 + 256, 118800 // 8 + 256)
    assert shapes.scaled_down(shapes.model_calls("sd15")[0], 8) == shapes.model_calls("sd15")[0]
    with pytest.raises(ValueError, match="res must be a positive multiple of 16"):
        shapes.model_calls("wan", 500)
