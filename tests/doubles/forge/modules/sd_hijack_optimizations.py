"""Double of Forge's modules/sd_hijack_optimizations.py: entirely commented out there, so nothing here."""
