"""The device a diffusers model or pipeline runs its calls on, which is not always where its weights are:
``enable_model_cpu_offload`` keeps them on the CPU between calls and Accelerate's hooks move them to the
execution device for each call; ``enable_sequential_cpu_offload`` (and models loaded empty) keep them on
the ``meta`` device, where nothing runs."""
from __future__ import annotations

import torch


def run_device(model_or_pipeline, models) -> torch.device | None:
    """The device the calls of ``models`` ((module, role) pairs of ``model_or_pipeline``) run on: a
    pipeline's own ``_execution_device``, else an Accelerate hook's ``execution_device``, else the
    first weight's device; None (this machine's default device) where only ``meta`` is known."""
    found = None
    if not isinstance(model_or_pipeline, torch.nn.Module):
        try:
            found = model_or_pipeline._execution_device
        except Exception:  # noqa: BLE001 - an object without it, or a pipeline whose property fails: the weights tell
            found = None
    if found is None:
        found = next((m._hf_hook.execution_device for model, _ in models for m in model.modules()
                      if getattr(getattr(m, "_hf_hook", None), "execution_device", None) is not None), None)
    if found is None:
        found = next((p.device for model, _ in models for p in model.parameters()), None)
    device = None if found is None else torch.device(found)
    return None if device is None or device.type == "meta" else device
