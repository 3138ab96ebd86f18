"""Host adapters of sd-webui-flash-attention: A1111 and Forge glue around ``lib_attn``.

Importing this package imports no webui module; each submodule that needs one imports it at the edge.
"""
