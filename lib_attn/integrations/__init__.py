"""Connections from other libraries to the engine; each module imports its library only when used."""
