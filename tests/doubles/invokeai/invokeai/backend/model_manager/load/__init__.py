"""``invokeai.backend.model_manager.load``, doubled for ``LoadedModel`` alone."""
from invokeai import _reach_release

__path__ = _reach_release(__path__, __name__)
