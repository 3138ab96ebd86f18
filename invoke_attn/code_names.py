"""The names a piece of code looks up: how the scan tells which modules and processors reach attention
without running them (``targets``, ``model_hooks``)."""
from __future__ import annotations

import types


def names_used(code: types.CodeType) -> set:
    """Every name ``code`` (and the functions defined in it) looks up."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= names_used(const)
    return names
