"""``invokeai.backend.stable_diffusion``: the release's ``__init__`` imports its whole SD pipeline (and through
it the app's configuration), so this one exports the intermediate state alone; other modules come from the
release through the path."""
from invokeai import _reach_release

__path__ = _reach_release(__path__, __name__)

from invokeai.backend.stable_diffusion.diffusers_pipeline import PipelineIntermediateState  # noqa: E402

__all__ = ["PipelineIntermediateState"]
