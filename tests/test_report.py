"""The per-generation report: data from real engine calls on CPU, and the webuis' exact text, infotext and
JSON formats of it (``webui_attn.readout``)."""
import json
import os
import threading

import pytest
import torch

import lib_attn
from lib_attn.report import MIB, Report, Vram, VramProbe
from webui_attn.ui import readout
from webui_attn.ui.readout import (calls_text, from_infotext, host_vram, lines, parse_infotext, quote_infotext, text,
                                to_infotext, vram_text)

GIB = 1024 * MIB


@pytest.fixture(autouse=True)
def _fresh_engine():
    lib_attn.reset()
    yield
    lib_attn.reset()


def _qkv(heads=2, seq=16, dim=32, dtype=torch.float32):
    return [torch.randn(1, heads, seq, dim, dtype=dtype) for _ in range(3)]


def _generation(unet_calls=5, vae_calls=2):
    """A small 'generation' on the real engine: UNet calls on the default chain, VAE calls that ask for
    flash-attn (absent or unable on CPU) and so fall back with the engine's own reason."""
    q, k, v = _qkv()
    vq, vk, vv = _qkv(heads=1, seq=64, dim=512)
    with lib_attn.recording() as rec:
        for _ in range(unet_calls):
            lib_attn.attention(q, k, v, role="unet")
        for _ in range(vae_calls):
            lib_attn.attention(vq, vk, vv, role="vae", backend="flash-attn")
    unet = lib_attn.explain(q, k, v, role="unet")
    vae = lib_attn.explain(vq, vk, vv, role="vae", backend="flash-attn")
    return rec, unet, vae


def test_report_counts_what_the_engine_ran():
    rec, unet, vae = _generation(unet_calls=7, vae_calls=3)
    report = Report.from_recording(rec)

    assert report.calls == {("unet", unet.backend): 7, ("vae", vae.backend): 3}
    flash_reasons = vae.reasons_for("flash-attn")
    assert vae.backend != "flash-attn" and flash_reasons
    assert report.fallbacks == {("vae", "flash-attn", "; ".join(flash_reasons)): 3}
    assert report.main_backend() == unet.backend
    assert report.kernels[unet.backend].startswith(unet.backend)
    assert report.seconds is not None and report.seconds >= 0
    assert report.vram is None


def test_counts_are_per_generation_and_a_process_recording_follows_calls_on_another_thread():
    q, k, v = _qkv()
    with lib_attn.recording():
        lib_attn.attention(q, k, v)  # an earlier generation
    everywhere = lib_attn.Recording()
    with lib_attn.recording() as rec:
        lib_attn.attention(q, k, v)
        worker = threading.Thread(target=lambda: [lib_attn.attention(q, k, v) for _ in range(4)])
        worker.start()
        worker.join()
    everywhere.finish()
    assert sum(Report.from_recording(rec).calls.values()) == 1  # this generation's thread
    assert sum(Report.from_recording(everywhere).calls.values()) == 5


def test_text_line_exact_format():
    report = Report(
        calls={("unet", "flash-attn"): 1260, ("vae", "sdpa-efficient"): 2},
        fallbacks={("vae", "flash-attn", "head_dim 512 > 256"): 2},
        kernels={"flash-attn": "flash-attn 2.8.3", "sdpa-efficient": "sdpa-efficient torch 2.3.1"},
        seconds=75.25,
        vram=Vram(active_peak=1500 * MIB + 1, reserved_peak=2048 * MIB, system_peak=6000 * MIB, total=81559 * MIB),
    )
    assert lines(report) == [
        "Attention: flash-attn 2.8.3 ×1,260 · VAE sdpa-efficient torch 2.3.1 ×2 · 1 min. 15.2 sec. · "
        "A: 1.47 GB, R: 2.00 GB, Sys: 5.9/79.6475 GB (7.4%)",
        "Attention fallbacks: VAE flash-attn ×2: head_dim 512 > 256",
    ]
    assert text(report) == "\n".join(lines(report))


def test_text_without_calls_time_or_vram():
    assert lines(Report()) == ["Attention: no attention calls"]
    assert lines(Report(seconds=3.04)) == ["Attention: no attention calls · 3.0 sec."]


def test_kernel_description_not_starting_with_its_id_is_prefixed():
    report = Report(calls={("unet", "sage"): 3}, kernels={"sage": "SageAttention 2.2.0"})
    assert calls_text(report) == "sage (SageAttention 2.2.0) ×3"
    assert from_infotext(to_infotext(report)).main_backend() == "sage"


def test_vram_rounds_bytes_up_to_mib_like_the_webui():
    # 1 byte over 1500 MiB counts as 1501 MiB: 1501/1024 = 1.4658 -> 1.47 (1.46 without rounding up)
    vram = Vram(1500 * MIB + 1, 3 * GIB, 10 * GIB + 1, 24 * GIB)
    assert vram_text(vram) == "A: 1.47 GB, R: 3.00 GB, Sys: 10.0/24 GB (41.7%)"
    bounded = Vram(1500 * MIB, 3 * GIB, 10 * GIB, 24 * GIB, source="own", peaks_bounded=True)
    assert vram_text(bounded) == "A: ≤1.46 GB, R: ≤3.00 GB, Sys: 10.0/24 GB (41.7%)"


class _RunFlag:
    def __init__(self, on):
        self._on = on

    def is_set(self):
        return self._on


class _Monitor:
    """The webui monitor's reading side (host-contract A7): read() returns its data dict."""

    def __init__(self, data, running=True, disabled=False):
        self.data = dict(data)
        self.run_flag = _RunFlag(running)
        self.disabled = disabled

    def read(self):
        return self.data


def test_host_monitor_numbers_are_used_only_while_it_runs():
    data = {"min_free": 70 * GIB, "free": 72 * GIB, "total": 80 * GIB, "active": 0,
            "active_peak": 5 * GIB, "reserved_peak": 6 * GIB, "system_peak": 10 * GIB}
    vram = host_vram(_Monitor(data))
    assert (vram.active_peak, vram.reserved_peak, vram.system_peak, vram.total) == (5 * GIB, 6 * GIB, 10 * GIB, 80 * GIB)
    assert vram.source == "host" and not vram.peaks_bounded
    assert host_vram(_Monitor(data, running=False)) is None        # API request: not monitored
    assert host_vram(_Monitor(data, disabled=True)) is None        # no CUDA / poll rate 0
    assert host_vram(_Monitor({"total": 1}, running=True)) is None  # thread has not sampled yet
    assert host_vram(None) is None


def test_probe_on_cpu_measures_nothing():
    assert VramProbe("cpu").start().stop() is None
    if not torch.cuda.is_available():
        assert VramProbe(None).start().stop() is None


class _FakeCuda:
    """torch.cuda's memory queries, scripted; resetting peaks is forbidden."""

    def __init__(self, stats, infos):
        self.stats, self.infos = list(stats), list(infos)

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: self.stats.pop(0))
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: self.infos.pop(0))

        def forbidden(*a, **k):
            raise AssertionError("reset_peak_memory_stats must never be called")

        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", forbidden)


def _stats(active, reserved):
    return {"active_bytes.all.peak": active, "reserved_bytes.all.peak": reserved}


def test_probe_peak_that_rose_is_this_generation(monkeypatch):
    fake = _FakeCuda([_stats(2 * GIB, 3 * GIB), _stats(4 * GIB, 5 * GIB)],
                     [(70 * GIB, 80 * GIB), (60 * GIB, 80 * GIB), (65 * GIB, 80 * GIB)])
    fake.install(monkeypatch)
    probe = VramProbe("cuda:0").start()
    probe.poll()
    vram = probe.stop()
    assert vram == Vram(4 * GIB, 5 * GIB, 20 * GIB, 80 * GIB, source="own", peaks_bounded=False)
    assert not fake.stats and not fake.infos


def test_probe_peak_that_did_not_rise_is_a_bound(monkeypatch):
    _FakeCuda([_stats(4 * GIB, 5 * GIB), _stats(4 * GIB, 5 * GIB)],
              [(70 * GIB, 80 * GIB), (71 * GIB, 80 * GIB)]).install(monkeypatch)
    vram = VramProbe("cuda:0").start().stop()
    assert vram.peaks_bounded and vram.system_peak == 10 * GIB
    assert vram_text(vram).startswith("A: ≤4.00 GB, R: ≤5.00 GB")


def _webui_infotext(entries: dict) -> str:
    """An infotext's last line as the webui writes it (values with , : or a newline JSON-quoted)."""
    params = {"Steps": "20", "Sampler": "Euler a", **entries, "Version": "v1.10.1"}
    return "a prompt\nSteps: 20, " + ", ".join(f"{k}: {quote_infotext(v)}" for k, v in params.items() if k != "Steps")


def test_infotext_entries_exact_and_round_trip():
    report = Report(
        calls={("unet", "flash-attn"): 1200, ("unet", "sdpa-flash"): 60, ("vae", "sdpa-efficient"): 2},
        fallbacks={("unet", "flash-attn", "dense attention mask not supported"): 60,
                   ("vae", "flash-attn", "head_dim 512 > 256"): 2},
        kernels={"flash-attn": "flash-attn 2.8.3 (FA3)", "sdpa-flash": "sdpa-flash torch 2.5.1+cu124",
                 "sdpa-efficient": "sdpa-efficient torch 2.5.1+cu124"},
    )
    entries = to_infotext(report)
    assert entries == {
        "Attention": "flash-attn 2.8.3 (FA3) + sdpa-flash torch 2.5.1+cu124; VAE sdpa-efficient torch 2.5.1+cu124",
        "Attention fallbacks": "flash-attn ×60: dense attention mask not supported; VAE flash-attn ×2: head_dim 512 > 256",
    }
    line = _webui_infotext(entries)
    assert 'Attention fallbacks: "flash-attn ×60' in line  # quoted: it holds ':'
    assert parse_infotext(line)["Attention"] == entries["Attention"]

    back = from_infotext(line)
    assert to_infotext(back) == entries
    assert back.fallbacks == report.fallbacks
    assert back.main_backend() == "flash-attn"
    assert to_infotext(from_infotext(parse_infotext(line))) == entries


def test_infotext_of_a_real_generation_round_trips():
    rec, unet, _ = _generation(unet_calls=2, vae_calls=1)
    report = Report.from_recording(rec)
    line = _webui_infotext(to_infotext(report))
    back = from_infotext(line)
    assert to_infotext(back) == to_infotext(report)
    assert back.main_backend() == unet.backend
    assert set(back.fallbacks) == set(report.fallbacks)


def test_reasons_with_separators_and_newlines_parse_back():
    reasons = {("unet", "sage", "dtype fp32 not supported (fp16/bf16); head_dim 40 not a multiple of 64"): 3,
               ("vae", "xformers", "line one\n  line two"): 1}
    report = Report(calls={("unet", "sdpa"): 4}, fallbacks=reasons)
    assert to_infotext(report)["Attention fallbacks"] == (
        "sage ×3: dtype fp32 not supported (fp16/bf16); head_dim 40 not a multiple of 64; "
        "VAE xformers ×1: line one line two")
    assert from_infotext(_webui_infotext(to_infotext(report))).fallbacks == {
        ("unet", "sage", "dtype fp32 not supported (fp16/bf16); head_dim 40 not a multiple of 64"): 3,
        ("vae", "xformers", "line one line two"): 1}


def test_no_calls_means_no_infotext():
    assert to_infotext(Report()) == {}
    assert from_infotext({"Steps": "20"}) is None
    assert from_infotext("prompt\nSteps: 20, Sampler: Euler") is None


def _json_report():
    return Report(
        calls={("unet", "flash-attn"): 1260, ("vae", "sdpa-efficient"): 2},
        fallbacks={("vae", "flash-attn", "head_dim 512 > 256"): 2},
        kernels={"flash-attn": "flash-attn 2.8.3", "sdpa-efficient": "sdpa-efficient torch 2.3.1"},
        seconds=12.34567,
        vram=Vram(3 * GIB, 4 * GIB, 6 * GIB, 80 * GIB),
        guard={("unet", "sage", "non-finite values", "flash-attn", True): 3},
    )


GUARD_JSON = [{"role": "unet", "backend": "sage", "what": "non-finite values", "ran_on": "flash-attn",
               "recomputed": True, "count": 3}]
GUARD_TEXT = "sage ×3 non-finite values → flash-attn (recomputed)"


def test_json_of_the_data_exact():
    """The engine's report as data: no host's text in it."""
    assert json.loads(_json_report().to_json()) == {
        "calls": [
            {"role": "unet", "backend": "flash-attn", "kernel": "flash-attn 2.8.3", "count": 1260, "tuned": False},
            {"role": "vae", "backend": "sdpa-efficient", "kernel": "sdpa-efficient torch 2.3.1", "count": 2,
             "tuned": False},
        ],
        "fallbacks": [{"role": "vae", "backend": "flash-attn", "reason": "head_dim 512 > 256", "count": 2}],
        "seconds": 12.346,
        "vram": {"source": "host", "peaks_bounded": False, "active_peak_bytes": 3 * GIB,
                 "reserved_peak_bytes": 4 * GIB, "system_peak_bytes": 6 * GIB, "total_bytes": 80 * GIB},
        "guard": GUARD_JSON, "schedule": None, "rules": [], "notes": [], "ran_on": None, "hint": None,
    }


def test_json_exact():
    """What the webuis' status route returns: the data plus the webui's text of it."""
    report = _json_report()
    assert json.loads(json.dumps(readout.to_json(report))) == {
        "calls": [
            {"role": "unet", "backend": "flash-attn", "kernel": "flash-attn 2.8.3", "count": 1260, "tuned": False},
            {"role": "vae", "backend": "sdpa-efficient", "kernel": "sdpa-efficient torch 2.3.1", "count": 2,
             "tuned": False},
        ],
        "fallbacks": [{"role": "vae", "backend": "flash-attn", "reason": "head_dim 512 > 256", "count": 2}],
        "seconds": 12.346,
        "vram": {"source": "host", "peaks_bounded": False, "active_peak_bytes": 3 * GIB,
                 "reserved_peak_bytes": 4 * GIB, "system_peak_bytes": 6 * GIB, "total_bytes": 80 * GIB,
                 "text": "A: 3.00 GB, R: 4.00 GB, Sys: 6.0/80 GB (7.5%)"},
        "text": ["Attention: flash-attn 2.8.3 ×1,260 · VAE sdpa-efficient torch 2.3.1 ×2 · 12.3 sec. · "
                 "A: 3.00 GB, R: 4.00 GB, Sys: 6.0/80 GB (7.5%)",
                 "Attention fallbacks: VAE flash-attn ×2: head_dim 512 > 256",
                 f"Attention guard: {GUARD_TEXT}"],
        "infotext": {"Attention": "flash-attn 2.8.3; VAE sdpa-efficient torch 2.3.1",
                     "Attention fallbacks": "VAE flash-attn ×2: head_dim 512 > 256",
                     "Attention guard": GUARD_TEXT},
        "guard": GUARD_JSON, "schedule": None, "rules": [], "notes": [], "ran_on": None, "hint": None,
    }


def test_json_reads_back():
    rec, _, _ = _generation(unet_calls=3, vae_calls=1)
    report = Report.from_recording(rec, seconds=2.5, vram=Vram(3 * GIB, 4 * GIB, 6 * GIB, 80 * GIB, "own", True))
    back = Report.from_dict(json.loads(report.to_json()))
    assert back.to_dict() == report.to_dict()
    assert lines(back) == lines(report)
    assert Report.from_dict(readout.to_json(report)) == report  # the route's JSON reads back too
    assert Report.from_dict(json.loads(_json_report().to_json())).guard == _json_report().guard


def test_dit_and_unet_in_one_generation_stay_apart():
    report = Report(calls={("unet", "sdpa"): 3, ("dit", "flash-attn"): 5, ("text", "sdpa-math"): 1})
    assert calls_text(report) == "sdpa ×3 · DiT flash-attn ×5 · Text sdpa-math ×1"
    back = from_infotext(to_infotext(report))
    assert set(back.calls) == {("unet", "sdpa"), ("dit", "flash-attn"), ("text", "sdpa-math")}


def test_notes_and_what_ran_elsewhere():
    """Attention that did not go through the engine is named as such, never as engine calls; notes (an
    ignored override or setting) reach the readout and the infotext, the hint only the readout."""
    report = Report(seconds=21.0, notes=("override 'x' ignored", "setting a='b' ignored"),
                    ran_on="A1111's InvokeAI optimizer", hint="choose attn-auto")
    assert lines(report) == [
        "Attention: A1111's InvokeAI optimizer, not through this extension · 21.0 sec.",
        "Attention note: override 'x' ignored",
        "Attention note: setting a='b' ignored",
        "Attention note: choose attn-auto",
    ]
    assert to_infotext(report) == {"Attention note": "override 'x' ignored; setting a='b' ignored"}
    assert from_infotext(to_infotext(report)) is None       # nothing to paste back as a backend
    assert Report.from_dict(json.loads(report.to_json())) == report


def test_a_tuned_choice_is_marked_and_parses_back(monkeypatch, tmp_path):
    monkeypatch.setenv("LIB_ATTN_CACHE_DIR", str(tmp_path))
    q, k, v = _qkv()
    vq, vk, vv = _qkv(heads=1, seq=64, dim=512)
    with lib_attn.recording() as rec:
        with lib_attn.use(tune="on"):
            lib_attn.attention(q, k, v, role="unet")
            ran = lib_attn.explain(q, k, v, role="unet")  # what tuning chose (a loaded machine may pick math)
        lib_attn.attention(vq, vk, vv, role="vae")  # tuning off again: the fixed order
    report = Report.from_recording(rec)
    assert report.tuned == {("unet", ran.backend)}
    assert calls_text(report) == f"{report.describe(ran.backend)} [tuned] ×1 · VAE {report.describe('sdpa')} ×1"
    entries = to_infotext(report)
    assert entries["Attention"] == f"{report.describe(ran.backend)} [tuned]; VAE {report.describe('sdpa')}"
    back = from_infotext(_webui_infotext(entries))
    assert back.tuned == report.tuned and back.kernels == report.kernels and to_infotext(back) == entries
    assert Report.from_dict(json.loads(report.to_json())).tuned == report.tuned


def test_a_script_prints_the_readout_lines_the_hosts_show():
    """What a diffusers script prints (docs/diffusers.md): the engine's own readout, no host package needed."""
    import subprocess
    import sys
    code = ("import torch, lib_attn\n"
            "q = torch.randn(1, 2, 64, 32)\n"
            "with lib_attn.recording() as rec:\n"
            "    for _ in range(3):\n"
            "        lib_attn.attention(q, q, q, role='dit', backend='sdpa-math')\n"
            "    lib_attn.attention(q, q, q, role='vae', backend='flash-attn')\n"
            "print(lib_attn.readout.text(lib_attn.Report.from_recording(rec)))\n"
            "import sys; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('host_attn', 'webui_attn', 'comfy_attn', 'invoke_attn')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout.splitlines()
    assert out[0].startswith("DiT: sdpa-math") and out[0].endswith("×3")
    assert out[1].startswith("VAE: ") and "×1" in out[1]
    if not lib_attn.explain(torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8),
                            role="vae", backend="flash-attn").backend == "flash-attn":
        assert any(line.startswith("fallback VAE flash-attn ×1: ") for line in out)
    assert any(line.startswith("time ") for line in out)
    assert out[-1] == "[]"        # no host package was imported
