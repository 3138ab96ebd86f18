"""What the user sees: the accordion and its per-generation override, the readout and infotext, the
status route."""
