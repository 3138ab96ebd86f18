"""The engine's version: the bottom of the package, so that any module can read it without
importing the package root (which imports everything)."""

__version__ = "0.1.0"
