"""Double of modules/initialize_util.py: the setting whose change re-applies the optimizer."""
from modules import call_queue, shared


def configure_opts_onchange():
    from modules import sd_hijack
    if not hasattr(sd_hijack.model_hijack, "redo_hijack") or not hasattr(sd_hijack, "optimizers"):
        return  # Forge: the onchange is commented out
    shared.opts.onchange("cross_attention_optimization",
                         call_queue.wrap_queued_call(lambda: sd_hijack.model_hijack.redo_hijack(shared.sd_model)),
                         call=False)
