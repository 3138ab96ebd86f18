"""The double of sd-scripts' ``library`` package (see ../README.md)."""
