import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Tuning results of the tests (and of the processes they start) never reach the user's cache.
os.environ["LIB_ATTN_CACHE_DIR"] = tempfile.mkdtemp(prefix="lib_attn-tests-")


def _invokeai_double_usable() -> bool:
    """tests/invokeai needs pydantic 2, Python 3.11+ and the InvokeAI release installed (its own venv)."""
    import importlib.util

    if sys.version_info < (3, 11) or importlib.util.find_spec("invokeai") is None:
        return False
    import pydantic

    return pydantic.VERSION.startswith("2.")


# tests/invokeai runs in .venv-invokeai (tools/run_invokeai_tests.sh): the main suite's venvs have pydantic 1
# (gradio 3.41.2) and no InvokeAI, where its double cannot even be imported.
collect_ignore = [] if _invokeai_double_usable() else ["invokeai"]
