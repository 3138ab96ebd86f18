"""``python -m lib_attn doctor``: versions, backends with reasons, and the engine's decisions per model."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch

import lib_attn
from lib_attn import shapes
from lib_attn.commands import doctor
from lib_attn.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def doctor_json():
    proc = subprocess.run([sys.executable, "-m", "lib_attn", "doctor", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_json_records_versions_and_device(doctor_json):
    v = doctor_json["versions"]
    assert v["torch"] == torch.__version__
    assert v["python"] == ".".join(map(str, sys.version_info[:3]))
    assert v["cuda"] == torch.version.cuda
    dev = doctor_json["device"]
    assert dev["type"] == ("cuda" if torch.cuda.is_available() else "cpu")
    if dev["type"] == "cpu":
        assert dev["description"].startswith("CPU only")
    # A property of the torch build: a CUDA build reports its cuDNN on a machine without a GPU too.
    assert v["cudnn"] == (torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)


def test_json_lists_every_backend_with_a_reason_when_unavailable(doctor_json):
    listed = doctor_json["backends"]
    assert [b["id"] for b in listed] == list(lib_attn.BACKEND_IDS)
    live = {b.id: b for b in lib_attn.backends()}
    for b in listed:
        assert b["available"] == live[b["id"]].available
        if not b["available"]:
            assert b["reason"] and b["reason"] == live[b["id"]].reason
        assert doctor_json["versions"]["backends"][b["id"]] == b["version"]


def test_json_decisions_cover_every_model_call(doctor_json):
    decisions = doctor_json["decisions"]
    for model in shapes.IMAGE_MODELS:
        mine = [d for d in decisions if d["model"] == model]
        assert sum(d["calls"] for d in mine) == shapes.calls_per_step(model)
        assert [tuple(d["shape"]) for d in mine] == [c.shape for c in shapes.model_calls(model)]
    for d in decisions:
        assert d["backend"] in lib_attn.BACKEND_IDS
        assert d["role"] == shapes.ROLES[d["model"]]
        for bid, reasons in d["rejected"]:
            assert bid in lib_attn.BACKEND_IDS and reasons and all(isinstance(r, str) and r for r in reasons)
    assert doctor_json["config"]["preference"]["unet"] == "auto"


def test_passed_over_backends_and_their_reasons_are_the_engines():
    # Put backends first that cannot take a CPU float32 call, so the decision has to pass them over.
    with lib_attn.use(preference=["sdpa-efficient", "flash-attn", "sdpa"]):
        doc = doctor.report(device=CPU)
        text = doctor.render(doc)
    for d in doc["decisions"]:
        call = next(c for c in shapes.model_calls(d["model"]) if c.where == d["where"])
        q, k, v = doctor._empty_inputs(call, torch.float32, CPU)
        with lib_attn.use(preference=["sdpa-efficient", "flash-attn", "sdpa"]):
            fresh = lib_attn.explain(q, k, v, role=call.role)
        assert d["backend"] == fresh.backend == "sdpa"
        assert d["rejected"] == [[bid, list(r)] for bid, r in fresh.rejected]
        assert [bid for bid, _ in d["rejected"]] == ["sdpa-efficient", "flash-attn"]
    assert doc["config"]["preference"]["unet"] == ["sdpa-efficient", "flash-attn", "sdpa"]
    available = {b.id: b.available for b in lib_attn.backends()}
    for bid, reasons in doc["decisions"][0]["rejected"]:
        # An unavailable backend's reason is printed once, in the backends table.
        shown = "not available (see backends)" if not available[bid] else "; ".join(reasons)
        assert f"        {bid}: {shown}" in text.splitlines()
    assert "preference sdpa-efficient,flash-attn,sdpa" in text


def test_the_schedule_in_force_is_in_the_config_line_and_the_json():
    with lib_attn.use(schedule="0-50%: sdpa;50-100%:math"):
        doc = doctor.report(device=CPU)
        text = doctor.render(doc)
    assert doc["config"]["schedule"] == "0-50%: sdpa; 50-100%: math"
    assert "schedule '0-50%: sdpa; 50-100%: math'" in text
    assert doctor.report(device=CPU)["config"]["schedule"] is None


def test_doctor_lists_the_sparse_backends_with_their_probes_the_sparse_settings_and_diffusers(doctor_json):
    listed = {b["id"]: b for b in doctor_json["sparse"]["backends"]}
    assert set(listed) == set(lib_attn.SPARSE_IDS) >= {"block-sparse", "sol"}
    for info in lib_attn.backends(sparse=True):
        b = listed[info.id]
        assert b["available"] == bool(info.available) and b["reason"] == info.reason
    assert listed["block-sparse"]["design"] in ("flex", "gather") and listed["block-sparse"].get("compiler")
    assert doctor_json["sparse"]["settings"] is None  # none configured in that process
    assert doctor_json["diffusers"]["supported"] == "0.35 up to 0.43 excluded"
    with lib_attn.use(sparse="block-sparse, budget=0.1"):
        doc = doctor.report(device=CPU)
        text = doctor.render(doc)
    assert doc["sparse"]["settings"].startswith("block-sparse, budget=0.1")
    assert f"sparse attention: {doc['sparse']['settings']} (" in text
    sol = next(line for line in text.splitlines() if line.strip().startswith("sol "))
    assert ("yes" in sol) == bool(listed["sol"]["available"]) and (listed["sol"]["reason"] in sol)
    assert any(line.strip().startswith("block-sparse ") and "design " in line for line in text.splitlines())
    assert f"route() supports {doc['diffusers']['supported']}" in text


def bench_header(doc):
    from lib_attn.commands import bench
    settings = {"timer": "t", "columns": [], "h200_floor": False, "load_average": None, "cpu_count": 2,
                "seconds": 1.0, "memory_method": "m", "reference": "r"}
    return bench.render({"device": doc["device"], "versions": doc["versions"], "settings": settings,
                         "calls": [], "results": [], "per_step": []}).splitlines()[0]


def test_cudnn_of_a_cuda_build_without_a_gpu_is_one_value_in_doctor_and_bench(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 8902)
    monkeypatch.setattr(torch.version, "cuda", "12.1")
    doc = doctor.report(device=CPU)
    assert doc["versions"]["cudnn"] == 8902
    assert "  cuDNN     8902" in doctor.render(doc).splitlines()
    header = bench_header(doc)
    assert "CUDA 12.1, cuDNN 8902" in header, header
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    doc = doctor.report(device=CPU)
    assert doc["versions"]["cudnn"] is None
    assert "  cuDNN     -" in doctor.render(doc).splitlines()
    header = bench_header(doc)
    assert "CUDA 12.1, cuDNN -" in header and "None" not in header, header


def test_text_report_names_versions_backends_and_models():
    text = doctor.render(doctor.report(device=CPU))
    assert f"torch     {torch.__version__}" in text
    assert "device    CPU only" in text
    for b in lib_attn.backends():
        line = next(l for l in text.splitlines() if l.strip().startswith(b.id + " "))
        assert ("yes" in line) == b.available
        if not b.available:
            assert b.reason in line
    for model in shapes.IMAGE_MODELS:
        assert f"{shapes.MODEL_LABELS[model]} @ {shapes.NATIVE_RES[model]}" in text


def test_dtype_option_describes_calls_in_that_dtype(capsys):
    assert main(["doctor", "--json", "--dtype", "bf16"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {d["dtype"] for d in doc["decisions"]} == {"bfloat16"}


def test_bad_dtype_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["doctor", "--dtype", "fp8"])
    assert exc.value.code == 2
    assert "dtype must be one of" in capsys.readouterr().err


def test_no_command_prints_usage():
    out = io.StringIO()
    sys_stdout, sys.stdout = sys.stdout, out
    try:
        assert main([]) == 2
    finally:
        sys.stdout = sys_stdout
    assert "doctor" in out.getvalue() and "bench" in out.getvalue()


def test_stored_tuning_is_shown_per_model_shape(monkeypatch, tmp_path):
    monkeypatch.setenv("LIB_ATTN_CACHE_DIR", str(tmp_path))
    lib_attn.reset()
    call = min(shapes.model_calls("sd15"), key=lambda c: c.flops)
    q, k, v = (torch.randn_like(t) for t in doctor._empty_inputs(call, torch.float32, CPU))
    try:
        with lib_attn.use(tune="on"):
            lib_attn.attention(q, k, v, role=call.role)
            doc = doctor.report(device=CPU)
            text = doctor.render(doc)
    finally:
        lib_attn.reset()
    assert doc["tuning"]["mode"] == "on" and doc["tuning"]["active"] and doc["tuning"]["stored"] == 1
    tuned = [d for d in doc["decisions"] if d["stored"]]
    assert [(d["model"], d["where"]) for d in tuned] == [("sd15", call.where)]
    # The decision this process took when it measured; a new process reads the same from the file.
    assert set(tuned[0]["stored"]["timings"]) == {"sdpa", "math"} and tuned[0]["source"] == "measured"
    assert f"-> {tuned[0]['backend']} [tuned: measured]" in text and "stored tuning: " in text
    assert str(tmp_path) in text


def _stand_in_distribution(root, name: str, version: str) -> None:
    """An installed distribution as importlib.metadata finds it: a ``.dist-info`` with its METADATA."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_doctor_lists_every_package_the_backends_probe_with_its_version_or_not_installed(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    _stand_in_distribution(site, "kernels", "0.11.7")
    _stand_in_distribution(site, "flash-attn-4", "4.0.0b40")
    env = dict(os.environ, PYTHONPATH=str(site) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "lib_attn", "doctor", "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    packages = doc["versions"]["packages"]
    probed = {name for b in lib_attn.backends() for name in b.packages}
    assert {"kernels", "flash-attn-4", "flash-attn", "xformers", "sageattention", "nvidia-cutlass-dsl"} <= probed
    assert probed <= set(packages)
    assert packages["kernels"] == "0.11.7" and packages["flash-attn-4"] == "4.0.0b40"
    by_id = {b["id"]: b for b in doc["backends"]}
    assert "flash-attn-4" in by_id["flash-attn-4"]["packages"] and "kernels" in by_id["sage3"]["packages"]
    # The text names each one, with its version or "not installed", and the backends that look for it.
    text = doctor.render(doc)
    section = text.split("\npackages (")[1].split("\n\n")[0].splitlines()[1:]
    assert [line.split()[0] for line in section] == list(packages)
    (line,) = [l for l in section if l.split()[0] == "kernels"]
    assert "0.11.7" in line and "(flash-attn, " in line and "sage3)" in line
    for name, version in packages.items():
        (line,) = [l for l in section if l.split()[0] == name]
        assert (version or "not installed") in line
