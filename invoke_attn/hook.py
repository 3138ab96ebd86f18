"""The one hook in InvokeAI: ``BaseInvocation.invoke_internal``, through which every node of every
session runs (after InvokeAI has built that node's context). It hands the node to its session
(``sessions``); a node of a session that routes nothing runs exactly as before. ``remove()`` puts
InvokeAI's method back."""
from __future__ import annotations

import sys

from invokeai.app.invocations.baseinvocation import BaseInvocation
from invokeai.app.invocations.fields import MetadataField

try:  # the device of this thread's session (InvokeAI 6.13+ runs one session per GPU, each in a thread)
    from invokeai.backend.util.devices import TorchDevice
    session_device = TorchDevice.choose_torch_device
except Exception:  # noqa: BLE001 - an older release: VRAM measured on the current device
    session_device = None

from host_attn import voice
from host_attn.patching import Patches, passthrough, reads_passthrough

from . import node_cache, sessions, targets

_patches = Patches("InvokeAI node hook")


def install(node_type: str, nodes_module: str) -> None:
    """Hook ``invoke_internal``; sessions are found by their Attention backend nodes of ``node_type``;
    ``nodes_module`` is the nodes' module, gone from ``sys.modules`` once the pack is uninstalled."""
    remove()  # a copy loaded again (an update, another folder name): the hook follows its nodes' module
    original = BaseInvocation.invoke_internal

    @reads_passthrough
    def invoke_internal(self, context, services):
        below = passthrough(invoke_internal)  # another pack's wrapper put on after this one still calls it
        if below is not None:
            return below(self, context, services)
        if nodes_module not in sys.modules:
            removed = remove() + targets.undo()
            sessions.reset()
            voice.log(f"InvokeAI: the pack was uninstalled; {removed} replaced names put back")
            return original(self, context, services)
        if type(self).__module__ == nodes_module:
            services = node_cache.keyed(services, node_cache.of_class(type(self)))[0]
        session = sessions.of(context, node_type, session_device, services)
        if session is None:
            return original(self, context, services)
        return session.run(self, context, services, lambda keyed: original(self, context, keyed), MetadataField)

    invoke_internal.__wrapped__ = original
    _patches.patch(BaseInvocation, "invoke_internal", invoke_internal)


def remove() -> int:
    return _patches.undo()
