"""The launch-time installer of the optional kernels (``install.py`` at the root runs ``main``).

The webuis run ``install.py`` at every launch (a subprocess with the webui root on PYTHONPATH).
By default it installs nothing: it prints one line per optional attention backend saying
whether it is usable and, if not, why and what to do. It reads package metadata only and does
not import torch, so it finishes in a fraction of a second.

Optional backends are installed only on request, through environment variables (set them in
webui-user.bat / webui-user.sh):

  ATTN_INSTALL=flash-attn,xformers,sage   install these, as prebuilt wheels only: flash-attn from
                                           the newest release with a wheel for this torch, xformers
                                           paired with this torch, SageAttention 1.0.6 from PyPI
  ATTN_INSTALL=flash-attn-4                FlashAttention-4 from PyPI (Hopper and Blackwell, Linux)
  ATTN_INSTALL=comfy-kitchen               comfy-kitchen from PyPI: INT8 attention and Sol-Attn (ComfyUI
                                           0.19+ installs it itself)
  ATTN_INSTALL=hub-flash-attn2             the `kernels` package and the Hugging Face kernel hub's
  ATTN_INSTALL=hub-flash-attn3             FA2 / FA3 / SageAttention build for this torch and CUDA
  ATTN_INSTALL=hub-sage                    (builds exist where no wheel does: torch 2.9+, CUDA 13, Windows)
  ATTN_WHEEL_FLASH_ATTN=<file or URL>      use this wheel instead of the default source
  ATTN_WHEEL_XFORMERS=<file or URL>
  ATTN_WHEEL_SAGE=<file or URL>            (SageAttention 2.2 comes only this way)
  ATTN_WHEEL_COMFY_KITCHEN=<file or URL>
  ATTN_INSTALL_DRY_RUN=1                   print the pip command, run nothing

Every install runs pip with `--only-binary=:all:` (never a source build; an ATTN_WHEEL_* value must name a
wheel) and a constraint file holding every installed package at its version (torch and the webui's pins
among them), so pip may only add what the kernel needs, or it changes nothing and the refusal names the
package in the way. pip waits at most PIP_TIMEOUT seconds per answer, and a network failure ends this
launch's installs. The result is re-probed and reported, and the kernel's self-test
(``lib_attn.commands.selftest``: the kernel itself, strictly, against float64) runs on the GPU when there
is one; a kernel that fails it is removed again. ``install.py`` never exits with an error status for a
backend that could not be installed. What is already installed is left alone, so ``ATTN_INSTALL`` may stay
set: a launch that finds it (for the kernel hub, ``kernels`` and the hub's build for this torch in the local
cache) runs no pip, no download and no self-test.
"""

from __future__ import annotations

import os

from .pip import NETWORK, Host, install, requested_backends
from .probe import TAG, probe_torch, say, status
from .wheels import BACKENDS


def main():
    torch = probe_torch()
    requested, unknown = requested_backends(os.environ.get("ATTN_INSTALL", ""))
    for name in unknown:
        print(f"{TAG} ATTN_INSTALL: unknown backend '{name}' "
              f"(known: {', '.join(b.id for b in BACKENDS)})", flush=True)
    host = Host() if requested else None
    dry_run = os.environ.get("ATTN_INSTALL_DRY_RUN", "") not in ("", "0")
    offline = False
    for backend in BACKENDS:
        if backend in requested and offline:
            say(backend, "install requested, not tried: the package index did not answer for an earlier one in "
                         "this launch; nothing done")
        elif backend in requested:
            offline = install(backend, torch, host, dry_run) == NETWORK
        else:
            say(backend, status(backend, torch))
    return 0

