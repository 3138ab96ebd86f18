"""Double of the step state that InvokeAI 6.14.2's denoise loops hand to their step callbacks.

The release defines it in ``invokeai/backend/stable_diffusion/extensions/preview.py`` (a dataclass) and
re-exports it from ``diffusers_pipeline.py`` and ``invokeai.invocation_api``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class PipelineIntermediateState:
    step: int
    order: int
    total_steps: int
    timestep: int
    latents: torch.Tensor
    predicted_original: Optional[torch.Tensor] = None
