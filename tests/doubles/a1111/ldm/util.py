"""Double of ldm/util.py (the helpers attention code uses)."""
from inspect import isfunction


def exists(x):
    return x is not None


def default(val, d):
    if exists(val):
        return val
    return d() if isfunction(d) else d
