"""Double of modules/call_queue.py: the queue lock, the UI's generation wrappers and the "Time taken /
A / R / Sys" readout (A7), in A1111 1.10.1's order: the memory monitor starts before the queue lock is
taken and stops after it is released and ``torch_gc`` ran."""
import html
import threading
import time

from modules import devices, shared

queue_lock = threading.Lock()


def wrap_queued_call(func):
    def f(*args, **kwargs):
        with queue_lock:
            res = func(*args, **kwargs)
        return res
    return f


def wrap_gradio_gpu_call(func, extra_outputs=None):
    """A UI generation: the job runs under the queue lock; the memory monitor was started before it
    (``wrap_gradio_call_no_job``), so a request that waits for the lock is already being measured."""
    def f(*args, **kwargs):
        with queue_lock:
            shared.state.begin(job="task(ui)")
            try:
                res = func(*args, **kwargs)
            finally:
                shared.state.end()
        return res
    return wrap_gradio_call(f, extra_outputs=extra_outputs, add_stats=True)


def wrap_gradio_call(func, extra_outputs=None, add_stats=False):
    def f(*args, **kwargs):
        try:
            res = func(*args, **kwargs)
        finally:
            shared.state.skipped = False
            shared.state.interrupted = False
            shared.state.job_count = 0
            shared.state.job = ""
        return res
    return wrap_gradio_call_no_job(f, extra_outputs, add_stats)


def wrap_gradio_call_no_job(func, extra_outputs=None, add_stats=False):
    def f(*args, extra_outputs_array=extra_outputs, **kwargs):
        run_memmon = shared.opts.memmon_poll_rate > 0 and shared.mem_mon is not None and not shared.mem_mon.disabled and add_stats
        if run_memmon:
            shared.mem_mon.monitor()
        t = time.perf_counter()
        try:
            res = list(func(*args, **kwargs))
        except Exception as e:
            res = extra_outputs_array or [None, ""]
            res = list(res) + [f"<div class='error'>{html.escape(type(e).__name__ + ': ' + str(e))}</div>"]
        devices.torch_gc()
        if not add_stats:
            return tuple(res)
        elapsed = time.perf_counter() - t
        elapsed_m = int(elapsed // 60)
        elapsed_s = elapsed % 60
        elapsed_text = f"{elapsed_s:.1f} sec."
        if elapsed_m > 0:
            elapsed_text = f"{elapsed_m} min. " + elapsed_text
        if run_memmon:
            mem_stats = {k: -(v // -(1024 * 1024)) for k, v in shared.mem_mon.stop().items()}
            active_peak = mem_stats["active_peak"]
            reserved_peak = mem_stats["reserved_peak"]
            sys_peak = mem_stats["system_peak"]
            sys_total = mem_stats["total"]
            sys_pct = sys_peak / max(sys_total, 1) * 100
            toltip_a = "Active: peak amount of video memory used during generation (excluding cached data)"
            toltip_r = "Reserved: total amount of video memory allocated by the Torch library "
            toltip_sys = "System: peak amount of video memory allocated by all running programs, out of total capacity"
            text_a = f"<abbr title='{toltip_a}'>A</abbr>: <span class='measurement'>{active_peak/1024:.2f} GB</span>"
            text_r = f"<abbr title='{toltip_r}'>R</abbr>: <span class='measurement'>{reserved_peak/1024:.2f} GB</span>"
            text_sys = f"<abbr title='{toltip_sys}'>Sys</abbr>: <span class='measurement'>{sys_peak/1024:.1f}/{sys_total/1024:g} GB</span> ({sys_pct:.1f}%)"
            vram_html = f"<p class='vram'>{text_a}, <wbr>{text_r}, <wbr>{text_sys}</p>"
        else:
            vram_html = ''
        res[-1] += f"<div class='performance'><p class='time'>Time taken: <wbr><span class='measurement'>{elapsed_text}</span></p>{vram_html}</div>"
        return tuple(res)
    return f
