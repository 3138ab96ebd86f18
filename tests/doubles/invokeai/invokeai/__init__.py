"""Double of InvokeAI 6.14.2's ``invokeai`` package (see ../README.md).

The release ships ``invokeai`` as a namespace package. This regular package comes first on ``sys.path``, and
its ``__path__`` goes on to the installed release's ``invokeai`` folder (the one holding ``invocation_api``):
a module this double does not define (``invokeai.backend.flux.math`` ...) is imported from the release.
``_reach_release`` does the same for the double's subpackages. Only the release's folder is added, never
another ``invokeai`` folder on ``sys.path`` (such as a test folder of that name).
"""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _release_roots() -> list[str]:
    roots = []
    for entry in sys.path:
        candidate = os.path.abspath(os.path.join(entry or os.curdir, "invokeai"))
        if candidate != _HERE and candidate not in roots \
                and os.path.isfile(os.path.join(candidate, "invocation_api", "__init__.py")):
            roots.append(candidate)
    return roots


_RELEASE_ROOTS = _release_roots()
__path__ = [*__path__, *_RELEASE_ROOTS]


def _reach_release(path: list[str], name: str) -> list[str]:
    """A double subpackage's ``__path__``: its own folder, then the same subpackage's folder in the release."""
    parts = name.split(".")[1:]
    release = [os.path.join(root, *parts) for root in _RELEASE_ROOTS]
    return [*path, *(p for p in release if os.path.isdir(p))]
