"""A, R and Sys as A1111 1.10.1 measures them, against a simulated CUDA device (``tests.simulated_cuda``).

The webui's own monitor (the ``memmon`` double: A1111's polling thread) runs for UI generations, started
by ``wrap_gradio_call_no_job`` before the queue lock is taken; API generations take the lock directly and
are never monitored. Each generation here holds a transient 8 GiB on top of 4 GiB of weights, on a device
where an earlier generation left torch's lifetime peak at 30 GiB and 2 GiB belong to other processes.
"""
import re
import threading
import time

import pytest

gr = pytest.importorskip("gradio")

from tests.doubles.fixtures import webui_factory  # noqa: E402,F401
from tests.simulated_cuda import GIB, SimulatedDevice  # noqa: E402
from tests.test_generation import AUTO_TITLE, _clean, sample, start  # noqa: E402,F401
from webui_attn.ui import readout  # noqa: E402
from webui_attn.ui.readout import vram_text  # noqa: E402

#: What this generation's numbers are: 4 GiB weights + 8 GiB transient, 2 GiB of other processes, 80 GiB.
THIS_GENERATION = "A: 12.00 GB, R: 12.00 GB, Sys: 14.0/80 GB (17.5%)"


@pytest.fixture
def device(monkeypatch):
    sim = SimulatedDevice(total=80 * GIB, others=2 * GIB).install(monkeypatch)
    sim.alloc(4 * GIB)                    # the model's weights
    sim.alloc(26 * GIB)                   # an earlier generation's peak: torch's lifetime peak is 30 GiB
    sim.free(26 * GIB)
    sim.empty_cache()                     # that generation ended as A1111 ends each one: devices.torch_gc()
    return sim


def launch(webui_factory, device):
    runner, _, _ = start(webui_factory, optimization=AUTO_TITLE)
    import torch
    from modules import memmon, shared
    shared.device = torch.device("cuda", 0)
    monitor = memmon.MemUsageMonitor("MemMon", shared.device, shared.opts)
    assert not monitor.disabled
    monitor.start()
    shared.mem_mon = monitor
    return runner


def model(device, during=None):
    """Sampling and decoding: the attention calls, and 8 GiB held for half a second (several polls)."""
    def run(p):
        sample(p)
        time.sleep(0.05)                  # the monitor's thread resets the peaks as soon as it wakes
        device.alloc(8 * GIB)
        time.sleep(0.5)
        device.free(8 * GIB)
        if during is not None:
            during()
    return run


def processing_of(runner, sd_model, is_api):
    from modules import processing
    p = processing.StableDiffusionProcessingTxt2Img(sd_model=sd_model, prompt="a cat")
    p.scripts = runner
    p.script_args = tuple([0, "use setting", "use setting", ""])
    p.is_api = is_api
    return p


def ui_generation(runner, sd_model):
    """From the UI: ``wrap_gradio_gpu_call`` around the job; returns A1111's own A/R/Sys text."""
    from modules import call_queue, processing

    def job():
        processed = processing.process_images(processing_of(runner, sd_model, is_api=False))
        return [processed.comments]

    out = call_queue.wrap_gradio_gpu_call(job)()[-1]
    return a1111_line(out)


def a1111_line(html_out: str) -> str:
    """The figures of A1111's ``<p class='vram'>`` as plain text."""
    found = re.search(r"<p class='vram'>(.*?)</p>", html_out)
    assert found, "A1111 showed no VRAM line"
    return re.sub(r"<[^>]+>", "", found.group(1))


def api_generation(runner, sd_model):
    from modules.api import api
    api.txt2img(runner, sd_model=sd_model, prompt="a cat")


def test_ui_generation_shows_a1111s_own_numbers(webui_factory, device):
    runner = launch(webui_factory, device)
    theirs = ui_generation(runner, model(device))
    ours = readout.last_report().vram
    assert ours.source == "host" and vram_text(ours) == theirs == THIS_GENERATION


def test_api_generation_is_measured_as_a1111_measures_a_ui_one(webui_factory, device):
    runner = launch(webui_factory, device)
    api_generation(runner, model(device))
    api_vram = readout.last_report().vram
    assert api_vram.source == "own" and not api_vram.peaks_bounded
    assert vram_text(api_vram) == THIS_GENERATION           # not the lifetime 30 GiB, Sys polled over it
    assert ui_generation(runner, model(device)) == vram_text(api_vram)   # A1111's line for the same work


def test_poll_rate_zero_still_measures_and_api_status_shows_it(webui_factory, device):
    runner = launch(webui_factory, device)
    from modules import shared
    shared.opts.memmon_poll_rate = 0          # A1111 shows no line then; the readout still measures
    api_generation(runner, model(device))
    assert vram_text(readout.last_report().vram) == THIS_GENERATION
    assert readout.to_json(readout.last_report())["vram"]["text"] == THIS_GENERATION


def test_a_ui_request_queued_during_an_api_generation_does_not_erase_its_peak(webui_factory, device):
    """A1111 starts the monitor (which resets torch's peaks) before a UI request waits for the queue lock:
    the API generation running meanwhile keeps the peak its polls saw, and the UI generation that runs
    next shows A1111's own numbers (which, by A1111's ordering, start at that reset)."""
    runner = launch(webui_factory, device)
    from modules import shared
    ui_result = {}

    def ui_request_arrives():
        resets = device.resets
        waiting = threading.Thread(target=lambda: ui_result.setdefault("line", ui_generation(runner, model(device))))
        waiting.start()
        ui_result["thread"] = waiting
        deadline = time.monotonic() + 5
        while device.resets == resets and time.monotonic() < deadline:
            time.sleep(0.01)
        assert device.resets > resets and shared.mem_mon.run_flag.is_set()

    api_generation(runner, model(device, during=ui_request_arrives))
    assert vram_text(readout.last_report().vram) == THIS_GENERATION
    ui_result["thread"].join(10)
    assert vram_text(readout.last_report().vram) == ui_result["line"]
