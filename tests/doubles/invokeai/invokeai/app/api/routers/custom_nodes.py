"""Double of the Custom Node Manager's pack handling in ``invokeai/app/api/routers/custom_nodes.py``
(InvokeAI 6.14.2), without its HTTP routes, workflows and locks.

As the release: ``_install_pack(source, pack_name, target_dir, owner_user_id)`` refuses a folder that
exists ("Node pack '...' already exists. Uninstall it first to reinstall."), puts the source there (the
release runs ``git clone source target_dir``: here a copy of the source folder), refuses one without an
``__init__.py`` (the folder removed), and loads it with ``_load_node_pack``: skipped when ``pack_name`` is in
``sys.modules``, else imported as a top-level package named ``pack_name`` from its ``__init__.py``, registered
in ``sys.modules`` first. ``_uninstall_pack(pack_name, target_dir)`` deletes the folder, unregisters the pack's
nodes (``InvocationRegistry.unregister_pack``) and drops ``pack_name`` and every ``pack_name.*`` module from
``sys.modules`` (``_purge_pack_modules``). Responses are (success, message) pairs instead of the release's
models.
"""
import logging
import shutil
import sys
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path

from invokeai.app.invocations.baseinvocation import InvocationRegistry

logger = logging.getLogger("InvokeAI")


def _install_pack(source: str, pack_name: str, target_dir: Path, owner_user_id: str) -> tuple[bool, str]:
    if target_dir.exists():
        return False, f"Node pack '{pack_name}' already exists. Uninstall it first to reinstall."
    shutil.copytree(source, target_dir, ignore=shutil.ignore_patterns("__pycache__", ".git", ".venv*"))
    if not (target_dir / "__init__.py").exists():
        shutil.rmtree(target_dir)
        return False, f"Node pack '{pack_name}' does not contain an __init__.py file."
    try:
        _load_node_pack(pack_name, target_dir)
    except Exception as exc:
        if target_dir.exists():
            shutil.rmtree(target_dir)
        return False, f"Installation failed: {exc}"
    return True, f"Successfully installed node pack '{pack_name}'."


def _uninstall_pack(pack_name: str, target_dir: Path) -> tuple[bool, str]:
    if not target_dir.exists():
        return False, f"Node pack '{pack_name}' not found."
    shutil.rmtree(target_dir)
    InvocationRegistry.unregister_pack(pack_name)
    _purge_pack_modules(pack_name)
    return True, f"Successfully uninstalled node pack '{pack_name}'."


def _purge_pack_modules(pack_name: str) -> list[str]:
    """Forgets the pack's package and all its submodules; returns their names."""
    purged = [name for name in list(sys.modules) if f"{name}.".startswith(f"{pack_name}.")]
    for name in purged:
        sys.modules.pop(name)
    return purged


def _load_node_pack(pack_name: str, pack_dir: Path) -> None:
    """Runs the folder's ``__init__.py`` as the top-level package ``pack_name`` (in ``sys.modules`` before its
    code runs); nothing for a folder without one, or a name already imported."""
    entry = pack_dir / "__init__.py"
    if not entry.exists() or pack_name in sys.modules:
        return
    spec = spec_from_file_location(pack_name, entry.absolute())
    if spec is None or spec.loader is None:
        logger.warning(f"node pack {pack_name}: no loader for {entry}")
        return
    package = module_from_spec(spec)
    sys.modules[pack_name] = package
    spec.loader.exec_module(package)
