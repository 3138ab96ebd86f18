import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Tuning results of the tests (and of the processes they start) never reach the user's cache.
os.environ["LIB_ATTN_CACHE_DIR"] = tempfile.mkdtemp(prefix="lib_attn-tests-")
