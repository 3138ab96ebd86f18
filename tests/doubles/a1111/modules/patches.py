"""Double of modules/patches.py: book-kept monkeypatching that raises on double patch or undo."""
from collections import defaultdict


def patch(key, obj, field, replacement):
    patch_key = (obj, field)
    if patch_key in originals[key]:
        raise RuntimeError(f"patch for {field} is already applied")
    original_func = getattr(obj, field)
    originals[key][patch_key] = original_func
    setattr(obj, field, replacement)
    return original_func


def undo(key, obj, field):
    patch_key = (obj, field)
    if patch_key not in originals[key]:
        raise RuntimeError(f"there is no patch for {field} to undo")
    original_func = originals[key].pop(patch_key)
    setattr(obj, field, original_func)
    return None


def original(key, obj, field):
    return originals[key].get((obj, field), None)


originals = defaultdict(dict)
