"""The node pack of sd-webui-flash-attention for ComfyUI and for InvokeAI (the webuis load
``scripts/`` instead).

Both import this file as a package named after its folder, from their custom nodes folder, and do
not put the folder on ``sys.path``; the project's packages import one another by their own names, so
each one is loaded here under its name (and only those: the folder's other files stay out of every
import path). InvokeAI has imported its invocations before it loads node packs, which is how this
file tells the two apart.
"""
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _package(name: str):
    if name in sys.modules:  # already imported: a webui or a test put this folder on sys.path
        return sys.modules[name]
    path = os.path.join(_HERE, name)
    spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


IN_INVOKEAI = "invokeai.app.invocations.baseinvocation" in sys.modules

if IN_INVOKEAI:
    # An update through InvokeAI's Custom Node Manager runs this file again in the same process: this
    # copy's code replaces what an earlier copy loaded (invoke_attn/source.py, loaded here by path).
    _spec = importlib.util.spec_from_file_location(f"{__name__}._source",
                                                   os.path.join(_HERE, "invoke_attn", "source.py"))
    _source = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_source)
    with _source.replacing(_HERE, __name__):
        for _name in ("lib_attn", "host_attn", "invoke_attn"):
            _package(_name)
        _source.record_operator(_HERE)
        from invoke_attn import startup as _invoke_startup  # noqa: E402

        _invoke_startup.start(__name__)
else:
    for _name in ("lib_attn", "host_attn", "comfy_attn"):
        _package(_name)

    from comfy_attn import startup  # noqa: E402
    from comfy_attn.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402

    WEB_DIRECTORY = "./web"
    __all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]

    def _start():
        server = getattr(sys.modules.get("server"), "PromptServer", None)
        instance = getattr(server, "instance", None)
        args = getattr(sys.modules.get("comfy.cli_args"), "args", None)
        startup.start(getattr(instance, "routes", None), args)

    _start()
