"""Double of Forge's backend/modules/k_model.py: ``memory_required`` and its identity check (B3)."""
import torch

from backend import attention, memory_management


class KModel(torch.nn.Module):
    def __init__(self, computation_dtype=torch.float16):
        super().__init__()
        self.computation_dtype = computation_dtype

    def memory_required(self, input_shape):
        """Bytes Forge reserves for one UNet/DiT call on a latent of ``input_shape`` (b, c, h, w)."""
        area = input_shape[0] * input_shape[2] * input_shape[3]
        dtype_size = memory_management.dtype_size(self.computation_dtype)
        if attention.attention_function in [attention.attention_pytorch, attention.attention_xformers]:
            scaler = 1.28
        else:
            scaler = 1.65
            if attention.get_attn_precision() == torch.float32:
                dtype_size = 4
        return scaler * area * dtype_size * 16384
