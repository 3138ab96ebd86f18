"""Double of the name ``XLabsIPAdapterExtension`` from ``invokeai/backend/flux/extensions/xlabs_ip_adapter_extension.py``
(InvokeAI 6.14.2). The doubles run FLUX without IP-Adapters (an empty list of extensions), so only the class
is needed; building one is refused rather than imitated."""


class XLabsIPAdapterExtension:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("IP-Adapters are not part of the InvokeAI double")
