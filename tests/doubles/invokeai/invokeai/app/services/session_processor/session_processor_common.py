"""Double of ``CanceledException`` from ``invokeai/app/services/session_processor/session_processor_common.py``
(InvokeAI 6.14.2): a step callback raises it when the session was canceled; the runner then records no
error for the node."""


class CanceledException(Exception):
    pass
