"""``python -m lib_attn bench``: time every backend on the attention calls of real models.

For each model's calls (``lib_attn.shapes``) and every backend column ("auto" =
the engine's current configuration with tuning on unless ``--tune off``, so it
runs what tuning ranks fastest; then each backend id pinned per call):

* time per call: median and p20/p80 over samples taken in interleaved rounds
  (the backend order rotates every round so clock and thermal drift cancel);
  CUDA events on a GPU, ``time.perf_counter_ns`` on the CPU;
* TFLOP/s (``4·b·h·q·kv·d``), attention time per denoising step weighted by calls
  per step, and % of the H200 floor when the device is an H200;
* peak extra memory of one call: on CUDA the allocator's peak over the allocation
  before the call; on CPU the resident-set high-water mark (Linux
  ``/proc/self/clear_refs``) over the resident set before the call, in a fresh
  subprocess whose glibc returns every block ≥ 64 KiB to the OS on free;
* error against a float64 reference on evenly spaced query rows;
* which backend really ran (from the engine's recording) and, for a backend that
  cannot take a call, the engine's reasons instead of a number;
* the engine's own cost per call, against a direct ``F.scaled_dot_product_attention``.

Inputs are laid out as A1111 passes them: ``(b, s, h·d)`` projections viewed as
``(b, s, h, d)`` and transposed to ``(b, h, s, d)``, i.e. non-contiguous.

One job per module: ``timing`` (timers, quantiles, machine load), ``inputs`` (inputs and the
float64 reference), ``memory`` (peak extra memory of one call), ``overhead`` (the engine's own
cost), ``cells`` (one result per call and column, sums per step), ``runner`` (settings, columns,
rounds, the run and its document), ``progress`` (stderr), ``text`` (the report) and ``chart``
(the PNG). This package exposes what the command line and other callers use.
"""
from ..formats import fmt_sig, fmt_time, format_table
from .cells import AUTO, Cell, finish_cell, per_step
from .cells import finish_cell as _finish_cell  # noqa: F401 - the name it had before the split
from .chart import matplotlib_missing, plot, plot_sparse
from .inputs import make_inputs, output_error, reference_rows, sample_rows
from .memory import measure_cpu_memory
from .overhead import SCHEDULE, dispatch_cost, engine_overhead, measure_overhead, scheduled_overhead
from .progress import Progress
from .runner import SCHEMA, BenchSettings, resolve_columns, run
from .text import Footnotes, render
from .timing import OtherLoad, Timer, quantile, summarize

__all__ = [
    "SCHEMA", "AUTO", "BenchSettings", "resolve_columns", "run", "render", "plot", "plot_sparse", "matplotlib_missing",
    "Cell", "finish_cell", "per_step", "make_inputs", "sample_rows", "reference_rows", "output_error",
    "measure_cpu_memory", "measure_overhead", "dispatch_cost", "engine_overhead", "scheduled_overhead", "SCHEDULE",
    "Progress",
    "Footnotes", "format_table", "fmt_time", "fmt_sig", "Timer", "OtherLoad", "quantile", "summarize",
]
