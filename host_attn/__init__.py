"""What every host adapter shares, the webuis' (``webui_attn``) and ComfyUI's (``comfy_attn``) alike.

* ``voice``: the ``[flash-attention]`` lines in the host's console, and what "routed" means.
* ``convention``: attention in the hosts' function convention, ``(q, k, v, heads, ...)``, served by
  the engine; ``rebind`` puts those functions where a host's model code finds its own, and
  ``patching`` records what it replaced, so that undo is exact.
* ``readout``: what a report shows, its text and its JSON; ``status``: the status route's answer.
* ``startup_flags``: the hosts' own attention flags claimed before the host reads them.

Nothing here imports a host module at import, and no host adapter imports another host's package:
each imports the engine (``lib_attn``) and this package.
"""
