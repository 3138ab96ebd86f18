"""Double of modules/sd_hijack.py: optimizer listing, selection and re-application (host-contract A2)."""
import ldm.modules.attention
import ldm.modules.diffusionmodules.model
import sgm.modules.attention
import sgm.modules.diffusionmodules.model

from modules import errors, script_callbacks, sd_hijack_optimizations, shared
from modules.hypernetworks import hypernetwork

# import-time rewiring that keeps the UNet on the patched class
ldm.modules.attention.MemoryEfficientCrossAttention = ldm.modules.attention.CrossAttention
ldm.modules.attention.BasicTransformerBlock.ATTENTION_MODES["softmax-xformers"] = ldm.modules.attention.CrossAttention

optimizers = []
current_optimizer: sd_hijack_optimizations.SdOptimization = None

ldm_original_nonlinearity = ldm.modules.diffusionmodules.model.nonlinearity
sgm_original_nonlinearity = sgm.modules.diffusionmodules.model.nonlinearity


def list_optimizers():
    new_optimizers = script_callbacks.list_optimizers_callback()
    new_optimizers = [x for x in new_optimizers if x.is_available()]
    new_optimizers = sorted(new_optimizers, key=lambda x: x.priority, reverse=True)
    optimizers.clear()
    optimizers.extend(new_optimizers)


def apply_optimizations(option=None):
    global current_optimizer

    undo_optimizations()

    if len(optimizers) == 0:
        current_optimizer = None
        return ''

    ldm.modules.diffusionmodules.model.nonlinearity = _silu
    sgm.modules.diffusionmodules.model.nonlinearity = _silu

    if current_optimizer is not None:
        current_optimizer.undo()
        current_optimizer = None

    selection = option or shared.opts.cross_attention_optimization
    if selection == "Automatic" and len(optimizers) > 0:
        matching_optimizer = next(iter([x for x in optimizers if x.cmd_opt and getattr(shared.cmd_opts, x.cmd_opt, False)]), optimizers[0])
    else:
        matching_optimizer = next(iter([x for x in optimizers if x.title() == selection]), None)

    if selection == "None":
        matching_optimizer = None
    elif selection == "Automatic" and shared.cmd_opts.disable_opt_split_attention:
        matching_optimizer = None
    elif matching_optimizer is None:
        matching_optimizer = optimizers[0]

    if matching_optimizer is not None:
        print(f"Applying attention optimization: {matching_optimizer.name}... ", end='')
        matching_optimizer.apply()
        print("done.")
        current_optimizer = matching_optimizer
        return current_optimizer.name
    print("Disabling attention optimization")
    return ''


def _silu(x):
    import torch
    return torch.nn.functional.silu(x)


def undo_optimizations():
    ldm.modules.diffusionmodules.model.nonlinearity = ldm_original_nonlinearity
    sgm.modules.diffusionmodules.model.nonlinearity = sgm_original_nonlinearity
    ldm.modules.attention.CrossAttention.forward = hypernetwork.attention_CrossAttention_forward
    ldm.modules.diffusionmodules.model.AttnBlock.forward = sd_hijack_optimizations.diffusionmodules_model_AttnBlock_forward
    sgm.modules.attention.CrossAttention.forward = hypernetwork.attention_CrossAttention_forward
    # the real function reuses the ldm variable here: sgm's AttnBlock gets ldm's forward
    sgm.modules.diffusionmodules.model.AttnBlock.forward = sd_hijack_optimizations.diffusionmodules_model_AttnBlock_forward


class StableDiffusionModelHijack:
    def __init__(self):
        self.optimization_method = None
        self.extra_generation_params = {}
        self.comments = []

    def apply_optimizations(self, option=None):
        try:
            self.optimization_method = apply_optimizations(option)
        except Exception as e:
            errors.display(e, "applying cross attention optimization")
            undo_optimizations()

    def hijack(self, m):
        self.apply_optimizations()

    def undo_hijack(self, m):
        # the real one also unwraps the embeddings and clip; what matters here is that it resets the
        # forwards without calling the current optimizer's undo()
        undo_optimizations()

    def redo_hijack(self, m):
        self.undo_hijack(m)
        self.hijack(m)

    def clear_comments(self):
        self.comments = []
        self.extra_generation_params = {}


model_hijack = StableDiffusionModelHijack()
