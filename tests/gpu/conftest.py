import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # Every test here needs a CUDA device; without one they skip with the backends' own reason.
    if torch.cuda.is_available():
        return
    import lib_attn

    why = "; ".join(sorted({f"{b.id}: {b.reason}" for b in lib_attn.backends() if not b.available})) or "no CUDA device"
    skip = pytest.mark.skip(reason=f"no CUDA device ({why})")
    for item in items:
        if "tests/gpu" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
