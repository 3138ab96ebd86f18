"""One InvokeAI session's attention: the node hook's work for each node, the session's recording, and
its report.

InvokeAI runs a session's nodes one after another in one thread (one thread per device when it
generates on several), each through ``BaseInvocation.invoke_internal`` with a context made for that
node. For a node the session routes (``choices``), the hook runs the node inside ``lib_attn.use`` with
its configuration and ``lib_attn.recording`` into the session's recording, with the node's role in
force for the stand-ins (``work``); it wraps, on that node's context only, the step callbacks (which
tell the schedule the step) and model loading (after which ``targets.route`` finds a model module
diffusers has just imported). For every node of a session that routes anything, it wraps the
context's image saving, so that every image the session saves records the attention in its metadata.

InvokeAI's step callbacks report the steps done: SD, SD3, CogView4, Qwen-Image and Krea-2 call it
with step 0 before their first step, then after each step; FLUX.1, FLUX.2, Z-Image, Wan and Anima
only after each; Ideogram-4 has none, and signals its progress after each step as the fraction done.
A node starts at step 0 of the ``steps`` (or ``num_steps``) it asks for (a denoiser that leaves them to
a preset, at the run's start), and each callback or fraction moves it to the step after the ones done. The sigma is
not reported: sigma rules do not hold in InvokeAI. Nor are the denoiser's blocks: block rules do not
hold either.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time

import lib_attn
from lib_attn import schedule
from lib_attn.report import Report, VramProbe

from lib_attn import readout

from . import choices, model_hooks, node_cache, targets, work

METADATA_KEY = "attention"
#: What ran attention in a session whose calls none went through the engine.
OWN_ATTENTION = "InvokeAI's own attention"
#: The statuses of a queue item whose session has ended (InvokeAI's ``QUEUE_ITEM_STATUS``).
ENDED = ("completed", "failed", "canceled")
LOADERS = ("load", "load_by_attrs", "load_by_key")


class Session:
    def __init__(self, session_id: str, graph_choices: choices.GraphChoices, device=None):
        self.id = session_id
        self.choices = graph_choices
        self.recording = lib_attn.Recording(here=True)
        self.started = self.touched = time.perf_counter()
        self.probe = VramProbe(device).start()  # on the session's own GPU
        self.notes: list = []
        self.said: list = []  # the choices of the nodes that made calls, in the order met
        self.running = None  # (the choice of the node running now, the calls counted when it began)
        self.cached: list = []  # the types of the routed nodes InvokeAI answered from its node cache

    def report(self) -> Report:
        # read, not stopped: every image the session saves, and the report node after them, show it
        report = Report.from_recording(self.recording, seconds=self.touched - self.started, vram=self.probe.read())
        notes = list(self.notes)
        if self.cached:
            notes.append(f"{_listed(self.cached)}: from InvokeAI's node cache (outputs made earlier under the same "
                         f"attention configuration; no attention ran for them)")
        elif not report.calls:
            report = dataclasses.replace(report, ran_on=OWN_ATTENTION)
        return dataclasses.replace(report, notes=tuple(notes)) if notes else report

    def metadata(self) -> dict:
        """What an image this session saves records: the report, and what chose the configuration."""
        report = self.report()
        return {"text": readout.lines(report), "configuration": [c.summary for c in self._said()], **report.to_dict()}

    def _said(self) -> list:
        """The choices of the nodes that made calls, in the order met (the node running now included)."""
        said = list(self.said)
        if self.running is not None:
            choice, before = self.running
            if self.recording.total() > before and choice not in said:
                said.append(choice)
        return said

    def _note_bypassed(self, bypassed, services) -> None:
        """Calls a model's own processor made without SDPA (InvokeAI's attention_type sliced, or xformers
        where InvokeAI uses it), said with the processor that ran them."""
        attention_type = getattr(getattr(services, "configuration", None), "attention_type", None)
        for (role, processor), n in sorted(bypassed.items(), key=lambda item: -item[1]):
            setting = f" (InvokeAI's attention_type is {attention_type!r})" if role == "unet" and attention_type else ""
            self.note(f"{readout.ROLE_NAMES.get(role, role)}: {n} attention calls ran on InvokeAI's {processor}"
                      f"{setting}, not through this extension (attention_type torch-sdp or auto routes them)")

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def run(self, invocation, context, services, call, metadata_field):
        """Run one node (``call(services)``, InvokeAI's ``invoke_internal``) as this session routes it."""
        _watch_saves(self, context, metadata_field)
        own = invocation.get_type() == self.choices.node_type  # the Attention backend node passes models on
        role = None if own else choices.role_of(invocation)
        choice = self.choices.get(context._data.source_invocation_id, invocation.id,
                                  context._data.queue_item.session) if role else None
        if choice is None:
            return call(services)
        targets.route()
        told = _watch_steps(context, role in choices.DENOISERS)
        _watch_loads(context)
        with contextlib.ExitStack() as stack:
            config = stack.enter_context(lib_attn.use(**choice.config, hosted=True))
            stack.enter_context(lib_attn.recording(into=self.recording))
            bypassed = collections.Counter()
            stack.enter_context(work.running(role, bypassed))
            # A denoiser starts at step 0 even when it leaves its step count to a preset (Ideogram-4).
            schedule.at_step(0, _steps_asked(invocation) or (FRACTION if role in choices.DENOISERS else None))
            # What chose the configuration is said once its node made calls (a LoRA loader makes none).
            self.running = (choice, self.recording.total())
            keyed_services, cache = node_cache.keyed(services, node_cache.configuration(config))
            before = self.recording.total(role)  # a denoiser's own calls: its VAE's take no step rule
            output = None
            try:
                output = call(keyed_services)
                return output
            finally:
                self._note_bypassed(bypassed, services)
                if cache.hit:
                    # Only an output that would have carried attention: one that passes a model on (a LoRA
                    # loader, FreeU) holds none of it.
                    if output is not None and choices.role_of(output) is None:
                        self.cached.append(invocation.get_type())
                elif role in choices.DENOISERS and not told and self.recording.total(role) > before:
                    asked = _step_askers(config)
                    if asked:
                        self.note(f"{invocation.get_type()} told InvokeAI no step: {asked} took all its calls as "
                                  f"its first step")
                self.touched = time.perf_counter()
                self.said, self.running = self._said(), None


def _listed(names: list) -> str:
    names = list(dict.fromkeys(names))
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _step_askers(config) -> str:
    """What in ``config`` places calls by step ("" when nothing does): the schedule's rules, sparse
    attention's dense windows (both in ``config.positional``)."""
    positional = config.positional
    if positional is None or not positional.asks_step:
        return ""
    own = len(config.schedule.rules) if config.schedule is not None else 0
    found = [what for what, rules in (("the schedule's step rules", positional.rules[:own]),
                                      ("sparse attention's dense windows", positional.rules[own:]))
             if any(r.steps is not None or r.sigmas is not None for r in rules)]
    return " and ".join(found)


def _steps_asked(invocation) -> int | None:
    for name in ("steps", "num_steps"):
        value = getattr(invocation, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


#: The denominator of a position told as a fraction of the run (the progress InvokeAI is signalled).
FRACTION = 1_000_000


def _watch_steps(context, denoiser: bool) -> list:
    """This node's step callbacks tell the schedule the step after the ones done. A node that has none
    (Ideogram-4) signals its progress after each step as the fraction of its steps done, which is where
    the next step starts; it is used until the node makes a step callback (whose own progress signal is
    then ignored; a VAE node's progress, a tiled decode's, is no step). Returns a list that holds True once
    the node told a step."""
    util = context.util
    stepped, told = [], []
    for name in [n for n in dir(type(util)) if n.endswith("step_callback")]:
        real = getattr(util, name)

        def callback(intermediate_state, *args, _real=real, **kwargs):
            stepped.append(True)
            done, total = getattr(intermediate_state, "step", None), getattr(intermediate_state, "total_steps", None)
            if isinstance(done, int) and isinstance(total, int) and total > 0:
                schedule.at_step(min(done, total - 1), total)
                told.append(True)
            return _real(intermediate_state, *args, **kwargs)

        setattr(util, name, callback)
    real_progress = util.signal_progress

    def signal_progress(message, percentage=None, *args, **kwargs):
        if denoiser and percentage is not None and not stepped and 0 <= percentage < 1:
            schedule.at_step(round(percentage * FRACTION), FRACTION)
            told.append(True)
        return real_progress(message, percentage, *args, **kwargs)

    util.signal_progress = signal_progress
    return told


def _watch_loads(context) -> None:
    """After this node loads a model, route the model modules diffusers imported for it, and hook a VAE's
    attention modules (``model_hooks``)."""
    models = context.models
    for name in LOADERS:
        real = getattr(models, name, None)
        if real is None:
            continue

        def load(*args, _real=real, **kwargs):
            loaded = _real(*args, **kwargs)
            targets.route()
            model_hooks.mark(getattr(loaded, "model", None))
            return loaded

        setattr(models, name, load)


def _watch_saves(session: Session, context, metadata_field) -> None:
    """Every image this node saves records the session's attention under ``METADATA_KEY``, beside the
    metadata it would have had (given to ``save``, or the node's own)."""
    images = context.images
    real = images.save

    def save(image, board_id=None, image_category=None, metadata=None):
        base = metadata if metadata else getattr(context._data.invocation, "metadata", None)
        data = dict(base.root) if base is not None else {}
        data[METADATA_KEY] = session.metadata()
        extra = {} if image_category is None else {"image_category": image_category}
        return real(image, board_id=board_id, metadata=metadata_field(data), **extra)

    images.save = save


# --- the sessions ---------------------------------------------------------------------------------

_sessions: dict = {}  # id -> Session, or None: nothing to route; each kept until its queue item ends
_items: dict = {}  # id -> the id of the queue item that runs it
_lock = threading.Lock()
default_choice = [None]  # ATTN_INVOKE_ROUTE's, set at startup


def of(context, node_type: str, device_now=None, services=None) -> Session | None:
    """The session of the queue item ``context`` runs, or None when nothing in it is routed;
    ``device_now()`` gives the device this thread's session runs on (where VRAM is measured). A session
    met for the first time first lets go of the sessions whose queue items have ended (asked of
    ``services.session_queue``), so that a session is kept as long as its queue item runs, however many
    others start meanwhile."""
    item = context._data.queue_item
    session_id = item.session_id
    with _lock:
        if session_id in _sessions:
            return _sessions[session_id]
    if services is not None:
        _end_finished(getattr(services, "session_queue", None))
    graph_choices = choices.GraphChoices(item.session, node_type, default_choice[0])
    made = Session(session_id, graph_choices, device_now() if device_now else None) if graph_choices else None
    with _lock:
        _items.setdefault(session_id, item.item_id)
        return _sessions.setdefault(session_id, made)


def _end_finished(queue) -> None:
    if queue is None:
        return
    with _lock:
        kept = list(_items.items())
    for session_id, item_id in kept:
        if _ended(queue, item_id):
            end(session_id)


def _ended(queue, item_id) -> bool:
    """Whether the queue item ``item_id`` has ended, or is gone (the queue was cleared); a queue that cannot
    answer now keeps the session."""
    try:
        status = queue.get_queue_item(item_id).status
    except Exception as exc:  # noqa: BLE001 - InvokeAI's SessionQueueItemNotFoundError, or the database busy
        return type(exc).__name__ == "SessionQueueItemNotFoundError"
    return status in ENDED


def end(session_id: str) -> None:
    """Let go of a session's recording and stop its VRAM probe."""
    with _lock:
        session = _sessions.pop(session_id, None)
        _items.pop(session_id, None)
    if session is not None:
        with contextlib.suppress(Exception):  # a device gone meanwhile: nothing is left to stop on it
            session.probe.stop()


def reset() -> None:
    with _lock:
        ended = list(_sessions)
    for session_id in ended:
        end(session_id)
