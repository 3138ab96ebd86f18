"""Double of ComfyUI's nodes.py custom-node loader (``load_custom_node``, async in 0.8.0).

A folder is imported from its ``__init__.py`` as a package whose ``sys.modules`` name is the folder's
path (dots replaced by ``_x_``), a file (ComfyUI's own ``comfy_extras/nodes_*.py``) as a module named by
its path less ``.py`` (``/…/comfy_extras/nodes_sag``, as given: not resolved); the folder is not put on ``sys.path``, so inside it ``from .pkg import``
works and a bare ``import pkg`` of a sibling does not. ``NODE_CLASS_MAPPINGS`` (even empty) makes the load
a success; ``WEB_DIRECTORY`` registers the folder's web files. An exception is logged as the import
failure ComfyUI reports ("IMPORT FAILED") and the load returns False.
"""
import importlib.util
import logging
import os
import sys
import traceback

import comfy.sd  # noqa: F401  (as the real nodes.py: every model family is loaded before custom nodes)

NODE_CLASS_MAPPINGS = {}
NODE_DISPLAY_NAME_MAPPINGS = {}
EXTENSION_WEB_DIRS = {}
LOADED_MODULE_DIRS = {}


def get_module_name(module_path):
    base = os.path.basename(module_path)
    return os.path.splitext(base)[0] if os.path.isfile(module_path) else base


async def load_custom_node(module_path, ignore=set(), module_parent="custom_nodes"):
    module_name = get_module_name(module_path)
    if os.path.isfile(module_path):   # a file (ComfyUI's own comfy_extras/nodes_*.py): its path less .py
        module_name = sys_module_name = os.path.splitext(module_path)[0]
        init = module_path
    else:
        sys_module_name, init = module_path.replace(".", "_x_"), os.path.join(module_path, "__init__.py")
    try:
        spec = importlib.util.spec_from_file_location(sys_module_name, init)
        module = importlib.util.module_from_spec(spec)
        sys.modules[sys_module_name] = module
        spec.loader.exec_module(module)
        LOADED_MODULE_DIRS[module_name] = os.path.abspath(module_path)
        web = getattr(module, "WEB_DIRECTORY", None)
        if web is not None and os.path.isdir(os.path.join(module_path, web)):
            EXTENSION_WEB_DIRS[module_name] = os.path.abspath(os.path.join(module_path, web))
        if getattr(module, "NODE_CLASS_MAPPINGS", None) is not None:
            for name, node_cls in module.NODE_CLASS_MAPPINGS.items():
                if name not in ignore:
                    NODE_CLASS_MAPPINGS[name] = node_cls
                    node_cls.RELATIVE_PYTHON_MODULE = f"{module_parent}.{get_module_name(module_path)}"
            NODE_DISPLAY_NAME_MAPPINGS.update(getattr(module, "NODE_DISPLAY_NAME_MAPPINGS", None) or {})
            return True
        logging.warning(f"Skip {module_path} module for custom nodes due to the lack of NODE_CLASS_MAPPINGS.")
        return False
    except Exception as e:
        logging.warning(traceback.format_exc())
        logging.warning(f"Cannot import {module_path} module for custom nodes: {e}")
        return False
