"""ComfyUI adapter: the engine as custom nodes, an optional global route, the status route.

ComfyUI loads this repository's root ``__init__.py``, which makes ``lib_attn``, ``host_attn`` and
this package importable and exports the nodes. Nothing here imports ComfyUI at import time; the
``comfy`` modules are read when a node runs or the global route is switched on.
"""
