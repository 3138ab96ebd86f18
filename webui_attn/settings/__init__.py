"""What the user sets (flags, the Settings page, the per-generation choice) and how it becomes the engine's
configuration (``layers``)."""
