"""Double of Forge Neo's backend/loader.py: to a caller the same as Forge's
(``tests/doubles/forge/backend/loader.py``, run here)."""
import os

_FORGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "forge", "backend", "loader.py")
with open(_FORGE, encoding="utf8") as _file:
    exec(compile(_file.read(), _FORGE, "exec"))  # noqa: S102 - the repository's own double
