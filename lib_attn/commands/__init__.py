"""The ``python -m lib_attn`` commands, apart from the engine (which never imports them):

* ``doctor``: what this machine has and what the engine would run for each model's calls;
* ``bench``: every backend timed on the attention calls of real models;
* ``tune``: the engine's tuning run ahead of time over a model's call kinds, and stored.

``cli`` parses all three and prints their results; ``environment``, ``dtypes`` and ``formats`` are
what they share (the machine's description, dtype names, text formats).
"""
