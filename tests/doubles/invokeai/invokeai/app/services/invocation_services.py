"""Double of ``InvocationServices`` from ``invokeai/app/services/invocation_services.py`` (InvokeAI 6.14.2):
the container a runner hands to ``invoke_internal`` and a context wraps. It holds the services the doubles
use; tests/doubles/invokeai/invoke_host.py fills it with in-memory ones."""
from typing import Any


class InvocationServices:
    def __init__(self, *, configuration: Any, invocation_cache: Any, logger: Any, images: Any, tensors: Any,
                 conditioning: Any, videos: Any = None, model_manager: Any, events: Any, session_queue: Any) -> None:
        self.configuration = configuration
        self.invocation_cache = invocation_cache
        self.logger = logger
        self.images = images
        self.tensors = tensors
        self.conditioning = conditioning
        self.videos = videos
        self.model_manager = model_manager
        self.events = events
        self.session_queue = session_queue
