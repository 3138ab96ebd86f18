"""ComfyUI's own attention flags, as this package reads them; standard library only, so that
``prestartup_script.py`` can load it before ComfyUI imports torch.

``--use-flash-attention`` and ``--use-sage-attention`` make ComfyUI stop at startup when their package
is missing. With this package installed they ask for its global route: ``claim`` records them in
``ATTN_COMFY_FLAGS`` and, only where the package is missing, clears the flag for ComfyUI so that it
starts; the engine then serves every model with that kernel first, falling back per call.
"""
import importlib.util
import os

ENV_FLAGS = "ATTN_COMFY_FLAGS"
#: ComfyUI's flag dest -> (its spelling, the engine backend it asks for, the module it needs).
FLAGS = {
    "use_sage_attention": ("--use-sage-attention", "sage", "sageattention"),
    "use_flash_attention": ("--use-flash-attention", "flash-attn", "flash_attn"),
}


def missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def claim(args, environ=os.environ) -> list:
    """Record ComfyUI's flags in ``environ`` and clear those whose package is missing; returns one
    message per cleared flag."""
    if args is None:
        return []
    asked = [b for b in environ.get(ENV_FLAGS, "").split(",") if b]
    messages = []
    for dest, (spelling, backend, module) in FLAGS.items():
        if not getattr(args, dest, False):
            continue
        asked.append(backend)
        if missing(module):
            setattr(args, dest, False)
            messages.append(f"{spelling}: {module} is not installed, which would stop ComfyUI here; every model's "
                            f"attention goes through this extension instead, {backend} first, each call it cannot "
                            f"take falling back to the next kernel, with the reason in the report")
    if asked:
        environ[ENV_FLAGS] = ",".join(dict.fromkeys(asked))
    return messages


def given(args, environ=os.environ) -> list:
    """(spelling, backend) of each of ComfyUI's flags given, claimed or not."""
    flagged = [b for b in environ.get(ENV_FLAGS, "").split(",") if b]
    return [(spelling, backend) for dest, (spelling, backend, _) in FLAGS.items()
            if backend in flagged or getattr(args, dest, False)]
