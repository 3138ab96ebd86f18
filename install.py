"""Launch-time installer of sd-webui-flash-attention: A1111 and the Forge lines run this file at every
launch (``python install.py``, the webui root on PYTHONPATH). By default it installs nothing and prints
one line per optional attention kernel: usable, or why not and what to do. ``ATTN_INSTALL`` asks for a
kernel's prebuilt wheel; see ``host_attn/install`` (it reads package metadata only, never torch).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from host_attn.install import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
