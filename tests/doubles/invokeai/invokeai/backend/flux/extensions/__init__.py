"""``invokeai.backend.flux.extensions``: two modules doubled, the rest from the release through the path.

InvokeAI 6.14.2's ``invokeai/backend/flux/model.py`` (the FLUX.1 transformer) and ``custom_block_processor.py``
(which runs its blocks and calls ``attention``) import ``RegionalPromptingExtension`` and
``XLabsIPAdapterExtension`` from here; the release's modules import torchvision and transformers. With these
two doubles the release's own model and block processor load and run.
"""
from invokeai import _reach_release

__path__ = _reach_release(__path__, __name__)
