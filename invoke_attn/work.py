"""The role of the node running in this thread or task: what the stand-ins at the models' attention
ask at every call. None (the default, and every node no session routes) means "pass the call on
exactly as made"; InvokeAI runs each session in a thread of its own, so sessions on several devices
each see their own node's role."""
from __future__ import annotations

import contextlib
from contextvars import ContextVar

_role: ContextVar = ContextVar("invoke_attn_role", default=None)
_bypassed: ContextVar = ContextVar("invoke_attn_bypassed", default=None)

#: The role of every call made now: "unet", "dit", "vae", or None.
role = _role.get


def vae_role() -> str | None:
    """For code that only a VAE runs (an autoencoder's module): "vae" whenever a node is routed."""
    return "vae" if _role.get() is not None else None


def bypassed():
    """The running node's count of attention calls its models' processors made without SDPA or diffusers'
    dispatcher, {(role, processor class name): n}; None when no node is routed."""
    return _bypassed.get() if _role.get() is not None else None


def enter_vae():
    """The role "vae" from here, when a node is routed (else nothing changes); the token for ``leave``."""
    return _role.set("vae") if _role.get() is not None else None


def leave(token) -> None:
    if token is not None:
        _role.reset(token)


@contextlib.contextmanager
def running(node_role: str, bypassed=None):
    """``node_role`` in force; ``bypassed``: where to count the calls ``model_hooks`` sees bypass the engine."""
    token, counted = _role.set(node_role), _bypassed.set(bypassed)
    try:
        yield
    finally:
        _bypassed.reset(counted)
        _role.reset(token)
