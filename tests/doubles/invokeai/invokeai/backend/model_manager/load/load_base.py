"""Double of ``LoadedModel`` from ``invokeai/backend/model_manager/load/load_base.py`` (InvokeAI 6.14.2).

The release's object mediates moving a cached model to the execution device. Nodes use it in two ways,
both kept: ``with loaded as model:`` and ``with loaded.model_on_device() as (cached_weights, model):``
(``cached_weights`` is the CPU copy of the weights when the cache keeps one; here there is none: None).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch


class LoadedModel:
    def __init__(self, config: Any, model: torch.nn.Module):
        self.config = config
        self._model = model

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    def __enter__(self) -> torch.nn.Module:
        return self._model

    def __exit__(self, *args: Any) -> None:
        return None

    @contextmanager
    def model_on_device(self) -> Iterator[tuple[Optional[dict[str, torch.Tensor]], torch.nn.Module]]:
        yield None, self._model
