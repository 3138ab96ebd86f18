"""Double of modules/shared_items.py: the choices of the "Cross attention optimization" dropdown."""


def cross_attention_optimizations():
    from modules import sd_hijack

    if not hasattr(sd_hijack, "optimizers"):
        return ["Automatic"]  # Forge: the stub sd_hijack has no optimizer list
    return ["Automatic"] + [x.title() for x in sd_hijack.optimizers] + ["None"]
