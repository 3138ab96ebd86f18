"""``invokeai.backend``: the release's own modules, except the few this double defines.

The release's ``backend/__init__.py`` holds a docstring only. Its ``__path__`` reaches the installed
release, so ``invokeai.backend.flux.math`` and the other model modules are the real files.
"""
from invokeai import _reach_release

__path__ = _reach_release(__path__, __name__)
