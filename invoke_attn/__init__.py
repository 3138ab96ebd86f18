"""InvokeAI node pack: every model InvokeAI runs (SD1.5/SDXL, FLUX.1, the diffusers-class models, their
VAEs) sends its attention through the engine while a node the session routes runs.

InvokeAI loads the repository's root ``__init__.py`` as its node pack; that file loads this package
(``startup.load``), which defines the nodes under the pack's own name, hooks the one method every
node runs through (``hook``), and puts the engine's stand-ins where the models find their attention
(``targets``) the first time a session asks for it. Every ``invokeai`` import is in ``nodes`` and
``hook``; the rest works on what those hand it.
"""
import os as _os

from .source import fingerprint as _fingerprint

#: The digest of the code this package (with lib_attn and host_attn beside it) was loaded from: an update
#: through InvokeAI's Custom Node Manager replaces the packages when it differs (``source``).
SOURCE = _fingerprint(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
