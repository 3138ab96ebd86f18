"""``invokeai.backend.model_manager``: the release's ``__init__`` imports its model probes (onnxruntime and
more), so this one imports nothing; the path still reaches the release for the modules not doubled here."""
from invokeai import _reach_release

__path__ = _reach_release(__path__, __name__)
