"""Double of ``invokeai/app/invocations/load_custom_nodes.py`` (InvokeAI 6.14.2).

As the release: each folder of ``custom_nodes_path`` whose name starts with neither "_" nor "." and that has
an ``__init__.py`` is imported as a top-level package named after the folder (``Path.stem`` of the folder:
a last ".suffix" is dropped), registered in ``sys.modules`` before it runs, and not put on ``sys.path``. A pack
that raises is logged ("Failed to load node pack NAME ...") and loading goes on. Not kept: copying the README.
"""
import logging
import sys
import traceback
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path

# Names the release's loader skips because its own module globals hold them.
_LOADER_GLOBALS = {"logging", "shutil", "sys", "traceback", "Path", "module_from_spec", "spec_from_file_location",
                   "load_custom_nodes"}


def load_custom_nodes(custom_nodes_path: Path, logger: logging.Logger) -> list[str]:
    """Loads the packs; returns the names loaded (the release returns None and logs them)."""
    custom_nodes_path.mkdir(parents=True, exist_ok=True)
    loaded: list[str] = []
    for d in custom_nodes_path.iterdir():
        if not d.is_dir() or d.name.startswith(("_", ".")):
            continue
        init = d / "__init__.py"
        if not init.exists():
            continue
        module_name = init.parent.stem
        if module_name in _LOADER_GLOBALS:
            continue
        spec = spec_from_file_location(module_name, init.absolute())
        if spec is None or spec.loader is None:
            logger.warning(f"Could not load {init}")
            continue
        logger.info(f"Loading node pack {module_name}")
        try:
            module = module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            loaded.append(module_name)
        except Exception:
            logger.error(f"Failed to load node pack {module_name} (may have partially loaded):\n{traceback.format_exc()}")
    if loaded:
        logger.info(f"Loaded {len(loaded)} node pack{'s' if len(loaded) != 1 else ''} from {custom_nodes_path}: "
                    f"{', '.join(loaded)}")
    return loaded
