"""The hosts' attention flags that stop the host at startup when their package is missing: ComfyUI's
and reForge's ``--use-flash-attention`` / ``--use-sage-attention`` (reForge also ``--use-sage-attention3``).

Standard library only, and loaded by file path: ComfyUI's ``prestartup_script.py`` and the webuis'
``preload.py`` run it before the host imports torch and its attention module. ``claim`` records each
such flag in ``ATTN_CLAIMED_FLAGS`` and, only where its package is missing, clears it for the host, so
that the host starts with its usual attention instead of exiting; this extension then puts that
kernel first (where it has one), and each call it cannot take falls back, with the reason counted.
"""
import importlib.util
import os

ENV_CLAIMED = "ATTN_CLAIMED_FLAGS"
#: The host's flag dest -> (its spelling, the engine backend it asks for, the module it needs).
FLAGS = {
    "use_sage_attention3": ("--use-sage-attention3", "sage3", "sageattn"),
    "use_sage_attention": ("--use-sage-attention", "sage", "sageattention"),
    "use_flash_attention": ("--use-flash-attention", "flash-attn", "flash_attn"),
}


def missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def claim(args, environ=os.environ) -> list:
    """Record the host's flags in ``environ`` and clear those whose package is missing; returns one
    message per cleared flag. ``args`` is the host's parsed namespace (None: nothing to do)."""
    if args is None:
        return []
    claimed = [d for d in environ.get(ENV_CLAIMED, "").split(",") if d]
    messages = []
    for dest, (spelling, backend, module) in FLAGS.items():
        if getattr(args, dest, False) is not True:
            continue
        claimed.append(dest)
        if missing(module):
            setattr(args, dest, False)
            then = (f"this extension's engine puts {backend} first and each call it cannot take falls back to the "
                    f"next kernel, with the reason in the report")
            messages.append(f"{spelling}: {module} is not installed, which would stop the program at startup; it "
                            f"starts with its usual attention instead, and {then}")
    if claimed:
        environ[ENV_CLAIMED] = ",".join(dict.fromkeys(claimed))
    return messages


def given(args, environ=os.environ) -> list:
    """(spelling, backend) of each such flag given, claimed or not."""
    claimed = [d for d in environ.get(ENV_CLAIMED, "").split(",") if d]
    return [(spelling, backend) for dest, (spelling, backend, _) in FLAGS.items()
            if dest in claimed or getattr(args, dest, False) is True]
