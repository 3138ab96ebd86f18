"""Double of reForge's modules/sd_hijack_optimizations.py: A1111's optimizers are all commented out there."""
