"""The webuis' adapter: A1111 1.10, Forge, Forge Neo, reForge and Forge Classic, in three rooms.

* ``routing``: which webui runs (``detect``) and how its attention reaches the engine: A1111's
  optimizer entries and class-level forwards, the ``backend`` line (Forge, Forge Neo), the
  ``ldm_patched`` line (reForge, Forge Classic), and where sampling is (``sampling``).
* ``settings``: what the user sets and how it becomes the engine's configuration: the command-line
  flags, the Settings page's options and their stored values, the dropdowns' choices, the layers.
* ``ui``: what the user sees: the accordion and the per-generation override (``panel``), the
  readout and infotext, the status route and its credentials.

Importing this package imports no webui module; each module that needs one imports it at the edge.
The entry script is ``scripts/flash_attention.py``.
"""
