"""One webui line's routing, for the lines whose attention is a function the host chose once: the
``backend`` line (Forge, Forge Neo) and the ``ldm_patched`` line (reForge, Forge Classic). ``Line`` is
the interface their adapter modules expose to the entry script and the UI: ``install``, ``routing``,
``uninstall``, ``apply``, ``register``.
"""
from __future__ import annotations

import sys

from host_attn import voice
from host_attn.rebind import Held, Router, copies, import_quietly

from ..settings import flags


def script_copies(source, names, values) -> list[Held]:
    """The extensions' script files the webui has loaded so far (by path, kept in
    ``modules.script_loading.loaded_scripts``; not in ``sys.modules``) that hold one of ``values`` as
    one of ``names``: copies of the host's chosen function made before this extension loaded. They
    serve the UNet (the extensions' attention patches)."""
    loaded = getattr(sys.modules.get("modules.script_loading"), "loaded_scripts", None) or {}
    return [Held(module, path, name) for path, module, name in copies(source, names, values=values,
                                                                     modules=list(loaded.items()))
            if module is not source]


class Line:
    """One host line's routing. ``running()`` says which host of the line runs (a ``detect.Host``); ``make_router(attention)`` builds
    the ``Router`` for the host's attention module ``source``; ``route(router, attention)`` routes every
    target of the line."""

    def __init__(self, source: str, running, make_router, route):
        self.source = source
        self.running = running
        self.make_router = make_router
        self.route = route
        self.router: Router | None = None

    def install(self) -> list[str]:
        """Route every target the host has; returns what is routed. Harmless when already routed."""
        if self.router is not None and self.router.patches.active:
            return self.router.patches.targets()
        attention, why = import_quietly(self.source)
        if attention is None:
            voice.log_once(("import", self.source), f"{self.source} not patched: {why or 'not importable'}")
            return []
        self.router = self.make_router(attention)
        self.route(self.router, attention)
        return self.router.patches.targets()

    def routing(self) -> voice.Routing:
        """Routed when every rebinding made at startup is still in place; else what runs instead."""
        name = self.running().name
        if self.router is None:
            return voice.Routing(False, f"{name}'s own attention ({self.source})",
                                "this extension's patches are not in place; the startup log says why")
        return self.router.routing(name, self.source)

    def uninstall(self) -> int:
        """Put every original back; safe to call again."""
        return self.router.undo() if self.router is not None else 0

    def apply(self) -> list[str]:
        """The host's own attention flags and this extension's into the engine, then the routing; safe
        to call twice."""
        from modules import shared

        flags.apply_host(self.running())
        flags.apply(shared.cmd_opts)
        return self.install()

    def register(self, script_callbacks) -> None:
        """Called at entry-script import: route now (these hosts have no optimizer hook), undo on unload."""
        self.apply()
        from modules import shared

        flags.say_startup(shared.cmd_opts)
        if self.router is not None:
            self.router.say(self.running().name)
        script_callbacks.on_script_unloaded(self.uninstall)
