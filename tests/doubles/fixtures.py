"""Install a webui double (A1111 1.10.1, Forge, Forge Neo, reForge or Forge Classic) into this process for
one test.

Usage, in a test module::

    from tests.doubles.fixtures import webui_factory  # noqa: F401  (pytest finds the fixture)

    def test_something(webui_factory):
        webui = webui_factory("a1111", argv=["--opt-flash-attention"])   # or "forge", "neo", "reforge", "classic"
        webui.load_scripts()          # imports scripts/flash_attention.py as the webui does (A1111 also
                                      # rebuilds its optimizer list); returns the script module
        from modules import shared, sd_hijack
        ...
        webui.reload_ui()             # "Reload UI": unload callbacks, then load the scripts again

What it does: puts the host's double root in front of ``tests/doubles/a1111`` on ``sys.path`` (``MODES``),
sets ``sys.argv`` to ``["webui.py", *argv]`` before anything parses it, links this repository as the only
extension so that its ``preload.py`` adds the flags as the webui would, and imports ``modules.shared``.
``modules`` is the A1111 double overlaid with the host's own files (Forge's lines: a stub ``sd_hijack``;
Forge, reForge: an emptied ``sd_hijack_optimizations``; Neo and Classic have none, so importing it fails);
``backend`` (Forge, Neo) or ``ldm_patched`` and ``modules_forge`` (reForge, Classic) are the host's,
CPU-only, chosen as the host chooses on CPU (pass ``--attention-pytorch`` to get SDPA). reForge and
Classic run ``initialize_forge()`` first, as their webui.py does. On exit it runs the unload callbacks,
drops every double module from ``sys.modules``, restores ``sys.path``/``sys.argv`` and resets the engine
configuration layers. One double at a time.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
A1111_ROOT = os.path.join(HERE, "a1111")
FORGE_ROOT = os.path.join(HERE, "forge")
NEO_ROOT = os.path.join(HERE, "neo")
REFORGE_ROOT = os.path.join(HERE, "reforge")
CLASSIC_ROOT = os.path.join(HERE, "classic")
FORGE_JOBS_ROOT = os.path.join(HERE, "forge_jobs")
NEO_JOBS_ROOT = os.path.join(HERE, "neo_jobs")
#: mode -> (roots in front of A1111's, ``modules`` overlays, ``modules.*`` the host does not have)
MODES = {
    "a1111": ((), (), ()),
    "forge": ((FORGE_ROOT,), (os.path.join(FORGE_ROOT, "modules"),), ()),
    "neo": ((NEO_ROOT,), (os.path.join(NEO_ROOT, "modules"),), ("modules.sd_hijack_optimizations",)),
    "reforge": ((REFORGE_ROOT,), (os.path.join(REFORGE_ROOT, "modules"),), ()),
    "classic": ((CLASSIC_ROOT,), (os.path.join(CLASSIC_ROOT, "modules"),), ("modules.sd_hijack_optimizations",)),
}
#: mode -> the job path's roots (``jobs=True``): Forge's and Neo's processing, model reload, refiner and
#: ``main_entry`` in place of the A1111 double's (which the other Forge-line tests keep using)
JOBS = {"forge": (FORGE_JOBS_ROOT,), "neo": (NEO_JOBS_ROOT, FORGE_JOBS_ROOT)}
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
EXTENSION_NAME = "sd-webui-flash-attention"
DOUBLE_PACKAGES = ("modules", "ldm", "sgm", "backend", "launch", "ldm_patched", "modules_forge")

_active = []


class Webui:
    """A running double: ``mode`` (a key of ``MODES``), ``extension_dir`` (this repository)."""

    def __init__(self, mode: str, extension_dir: str):
        self.mode = mode
        self.extension_dir = extension_dir
        self.script_modules = []

    def load_scripts(self):
        """What webui startup does for scripts: ``initialize_rest`` (load scripts, list optimizers)."""
        from modules import initialize, scripts
        initialize.initialize_rest([self.extension_dir])
        self.script_modules = list(scripts.loaded_modules)
        return self.script_modules[0] if self.script_modules else None

    def reload_ui(self):
        """"Reload UI": ``on_script_unloaded`` callbacks, then the scripts again as new module objects."""
        from modules import script_callbacks
        script_callbacks.script_unloaded_callback()
        return self.load_scripts()

    def script_classes(self):
        from modules import scripts
        return [cls for cls, *_ in scripts.scripts_data]


def _drop_double_modules():
    for name in list(sys.modules):
        if name.split(".")[0] in DOUBLE_PACKAGES:
            del sys.modules[name]


@contextlib.contextmanager
def webui_double(mode: str = "a1111", argv=(), jobs: bool = False):
    """Context manager behind ``webui_factory``; yields a ``Webui``. ``jobs``: the host's own job path
    (``JOBS``; Forge and Forge Neo)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    if jobs and mode not in JOBS:
        raise ValueError(f"no job path double for {mode!r}; there is one for {', '.join(JOBS)}")
    if _active:
        raise RuntimeError("a webui double is already installed")
    saved_path, saved_argv = list(sys.path), list(sys.argv)
    saved_env = dict(os.environ)  # preload.py records the host flags it claims there
    tmp = tempfile.TemporaryDirectory()
    extensions_dir = os.path.join(tmp.name, "extensions")
    os.makedirs(extensions_dir)
    os.symlink(REPO_ROOT, os.path.join(extensions_dir, EXTENSION_NAME))
    _drop_double_modules()
    _active.append(mode)
    try:
        roots, overlays, absent = MODES[mode]
        job_roots = JOBS[mode] if jobs else ()
        overlays = (*(os.path.join(root, "modules") for root in job_roots), *overlays)
        sys.path[:0] = [*job_roots, *roots, A1111_ROOT]
        sys.argv = ["webui.py", *argv]
        import modules
        modules.__path__[:0] = [o for o in overlays if os.path.isdir(o)]
        for name in absent:
            sys.modules[name] = None  # the host has no such module: importing it fails
        if mode in ("reforge", "classic"):
            # these hosts parse ldm_patched's own arguments first (initialize_forge)
            from modules_forge.initialization import initialize_forge
            initialize_forge()
        from modules import paths_internal
        paths_internal.extensions_dir = extensions_dir
        paths_internal.data_path = tmp.name   # params.txt and the like: written where the test can see them
        import modules.shared  # noqa: F401  (runs preload.py and parses argv)
        import modules.sd_hijack  # noqa: F401
        # scripts load from the repository itself, so ``webui_attn`` is one package for every test
        yield Webui(mode, REPO_ROOT)
    finally:
        try:
            callbacks = sys.modules.get("modules.script_callbacks")
            if callbacks is not None:
                callbacks.script_unloaded_callback()
        finally:
            _drop_double_modules()
            sys.path[:] = saved_path
            sys.argv[:] = saved_argv
            os.environ.clear()
            os.environ.update(saved_env)
            _active.clear()
            tmp.cleanup()
            layers = sys.modules.get("webui_attn.settings.layers")
            if layers is not None:
                layers.reset()


@pytest.fixture
def webui_factory():
    """``webui_factory(mode="a1111"|"forge"|"neo"|"reforge"|"classic", argv=(), jobs=False)`` -> Webui;
    uninstalled after the test."""
    stack = contextlib.ExitStack()

    def make(mode: str = "a1111", argv=(), jobs: bool = False):
        return stack.enter_context(webui_double(mode, argv, jobs))

    with stack:
        yield make
