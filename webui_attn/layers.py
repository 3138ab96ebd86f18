"""One place where every source of the engine's configuration meets.

Sources, weakest first: command-line flags, the A1111 optimizer chosen in the dropdown, the extension's
settings, the per-generation override. Each source sets its layer; the merged result goes to
``lib_attn.configure``. A layer is a dict with any of ``preference``, ``fp32``, ``strict``; None clears it.
"""
from __future__ import annotations

import lib_attn

ORDER = ("flags", "optimizer", "settings", "generation")
DEFAULTS = {"preference": "auto", "fp32": "cast", "strict": False}

_layers: dict[str, dict | None] = {name: None for name in ORDER}


def merged() -> dict:
    """The configuration the layers add up to; a later layer overrides an earlier one key by key."""
    out = dict(DEFAULTS)
    for name in ORDER:
        for key, value in (_layers[name] or {}).items():
            if value is not None:
                out[key] = value
    return out


def set_layer(name: str, layer: dict | None) -> dict:
    """Replace one layer and push the merged configuration to the engine; returns what was applied."""
    if name not in _layers:
        raise ValueError(f"layer {name!r} is not one of {', '.join(ORDER)}")
    unknown = set(layer or ()) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"layer keys {sorted(unknown)} are not among {sorted(DEFAULTS)}")
    previous = _layers[name]
    _layers[name] = dict(layer) if layer else None
    config = merged()
    try:
        lib_attn.configure(**config)
    except ValueError:
        _layers[name] = previous
        raise
    return config


def get_layer(name: str) -> dict | None:
    return None if _layers[name] is None else dict(_layers[name])


def reset() -> None:
    """Clear every layer (tests, and the host's script unload)."""
    for name in ORDER:
        _layers[name] = None
    lib_attn.configure(**DEFAULTS)
