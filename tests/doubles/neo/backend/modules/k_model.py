"""Double of Forge Neo's backend/modules/k_model.py: ``memory_required`` asks ``xformers_enabled()`` and
compares no attention function by identity."""
import math

import torch

from backend import memory_management


class KModel(torch.nn.Module):
    def __init__(self, computation_dtype=torch.float16, memory_usage_factor=2.0):
        super().__init__()
        self.computation_dtype = computation_dtype
        self.memory_usage_factor = memory_usage_factor

    def memory_required(self, input_shape):
        area = input_shape[0] * math.prod(input_shape[2:])
        if memory_management.xformers_enabled():
            return (area * memory_management.dtype_size(self.computation_dtype) * 0.01 * self.memory_usage_factor) \
                * (1024 * 1024)
        return (area * 0.15 * self.memory_usage_factor) * (1024 * 1024)
