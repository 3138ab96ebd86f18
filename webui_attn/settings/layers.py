"""One place where every source of the engine's configuration meets.

Sources, weakest first: the host's own attention flags (Forge Neo's ``--sage``, reForge's
``--use-flash-attention``, …), this extension's command-line flags, the A1111 optimizer chosen in the
dropdown, the extension's settings, the per-generation override. Each source sets its layer; the
merged result goes to ``lib_attn.configure``. A layer is a dict with any of ``preference``, ``fp32``,
``strict``, ``tune``, ``avoid``, ``guard``, ``schedule`` (its text; ``"off"`` for none, over the weaker
layers' schedule), ``sparse`` (the sparse settings' text; ``"off"`` likewise); None clears it. A role whose chain a layer leaves out (or sets to
"auto") keeps the chain of the layers below.
"""
from __future__ import annotations

import lib_attn
from lib_attn.config import normalise_preference

ORDER = ("host", "flags", "optimizer", "settings", "generation")
DEFAULTS = {"preference": "auto", "fp32": "cast", "strict": False, "tune": "auto", "avoid": (), "guard": "on",
            "schedule": "", "sparse": ""}

_layers: dict[str, dict | None] = {name: None for name in ORDER}


def merged() -> dict:
    """The configuration the layers add up to. A later layer overrides an earlier one key by key, and
    ``preference`` role by role: a layer that names only the VAE's chain keeps the denoiser's below it."""
    out = dict(DEFAULTS)
    chains = normalise_preference("auto")
    for name in ORDER:
        layer = _layers[name] or {}
        for role, chain in normalise_preference(layer.get("preference")).items():
            if chain is not None:
                chains[role] = chain
        for key, value in layer.items():
            if value is not None and key != "preference":
                out[key] = value
    out["preference"] = chains
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
        lib_attn.configure(**config, hosted=True)
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
