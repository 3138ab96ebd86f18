"""The values a user picks a backend with: the dropdowns' choices and what a chosen value names.

Shared by the settings, the per-generation override and the API, so that a label shown anywhere
(Forge's ``/sdapi/v1/script-info`` lists labels, and API users send back what it lists) names its id.
"""
from __future__ import annotations

import lib_attn
from host_attn.status import short_reason

USE_SETTING = "use setting"


def choice_label(info) -> str:
    """A backend's dropdown label: its id, and when it cannot run here why in a few words (``xformers —
    not installed``; the whole reason goes in the availability table, where it has room)."""
    return info.id if info.available else f"{info.id} — {short_reason(info)}"


def backend_from_choice(value) -> str | None:
    """The backend id a dropdown value names: the id itself, or a label shown for it. None otherwise."""
    if not isinstance(value, str):
        return None
    text = value.strip()
    if text in lib_attn.BACKEND_IDS:
        return text
    head, _, rest = text.partition(" ")
    return head if head in lib_attn.BACKEND_IDS and rest.startswith(("(", "—")) else None


def choices(first: str, pairs: bool = False) -> list:
    """``first`` then every backend id; with ``pairs`` (gradio 4) as (label, id) so unavailable ids are marked."""
    if not pairs:
        return [first, *lib_attn.BACKEND_IDS]
    return [(first, first), *((choice_label(b), b.id) for b in lib_attn.backends())]


def override_choices(pairs: bool = False) -> list:
    """"use setting" then every backend id."""
    return choices(USE_SETTING, pairs)


