"""The decision path flows one way, and the adapters import each other without circles.

Read from the source (module-level and function-level imports alike): a lib_attn module imports
only modules below it in ``LIB_ATTN_ORDER``; ``host_attn`` (what every host adapter shares) imports no
adapter; no host adapter imports another host's package; the webuis' rooms import one way
(``settings`` <- ``routing`` <- ``ui``); the import graph of the adapters has no cycle; and no module
of the product is longer than ``MAX_LINES``.
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Bottom first: spec -> conditioning -> kernels -> schedule -> sparse settings -> output check -> sparse measurement -> tuning ->
#: output guard -> chains -> decision -> sparse plans -> compile operator -> dispatch, then what uses the engine.
LIB_ATTN_ORDER = [
    "lib_attn._version", "lib_attn.scope", "lib_attn._compat", "lib_attn.device", "lib_attn.spec", "lib_attn.conditioning", "lib_attn.kernels", "lib_attn.schedule",
    "lib_attn.sparse", "lib_attn.config", "lib_attn.sparse_report", "lib_attn.stats", "lib_attn.report", "lib_attn.readout", "lib_attn.file_lock", "lib_attn.shapes", "lib_attn.check", "lib_attn.sparse_measure", "lib_attn.tuning_file",
    "lib_attn.tune", "lib_attn.guard", "lib_attn.chains", "lib_attn.decision", "lib_attn.sparse_plan", "lib_attn.graph_op", "lib_attn.dispatch", "lib_attn", "lib_attn.integrations",
    "lib_attn.commands", "lib_attn.__main__",
]


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _imports(path: str) -> set:
    """Every module a file imports (relative imports resolved), at any depth in the file."""
    name = _module_name(path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            if node.module:  # "from . import x" imports x, not the package's own body again
                found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _files(package: str):
    for folder, _, files in os.walk(os.path.join(ROOT, package)):
        for file in files:
            if file.endswith(".py"):
                yield os.path.join(folder, file)


def _rank(module: str) -> int | None:
    best = None
    for i, prefix in enumerate(LIB_ATTN_ORDER):
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(LIB_ATTN_ORDER[best]):
                best = i
    return best


def test_lib_attn_modules_import_only_below_themselves():
    upward = []
    for path in _files("lib_attn"):
        me = _module_name(path)
        mine = _rank(me)
        assert mine is not None, f"{me} has no place in LIB_ATTN_ORDER"
        for target in _imports(path):
            theirs = _rank(target) if target.split(".")[0] == "lib_attn" else None
            if theirs is not None and theirs > mine:
                upward.append(f"{me} imports {target}")
    assert upward == []


def test_lib_attn_imports_no_host_module():
    hosts = ("modules", "backend", "ldm_patched", "comfy", "gradio", "host_attn", "webui_attn", "comfy_attn", "server",
             "invokeai", "invoke_attn")
    found = [f"{_module_name(p)} imports {t}" for p in _files("lib_attn") for t in _imports(p)
             if t.split(".")[0] in hosts]
    assert found == []


def _cycle(graph: dict):
    seen, stack = set(), []

    def visit(node):
        if node in stack:
            return stack[stack.index(node):] + [node]
        if node in seen:
            return None
        seen.add(node)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            found = visit(nxt)
            if found:
                return found
        stack.pop()
        return None

    for node in sorted(graph):
        found = visit(node)
        if found:
            return found
    return None


ADAPTERS = ("webui_attn", "comfy_attn", "invoke_attn")


def _package_imports(package: str) -> set:
    """(module, the top-level package it imports) for every project package a module of ``package`` imports."""
    ours = ("lib_attn", "host_attn") + ADAPTERS
    return {(_module_name(p), t.split(".")[0]) for p in _files(package) for t in _imports(p) if t.split(".")[0] in ours}


def test_what_every_host_shares_imports_no_adapter():
    assert {(m, t) for m, t in _package_imports("host_attn") if t in ADAPTERS} == set()


def test_no_host_adapter_imports_another_hosts_package():
    for adapter in ADAPTERS:
        others = set(ADAPTERS) - {adapter}
        assert {(m, t) for m, t in _package_imports(adapter) if t in others} == set()


#: The webuis' rooms, bottom first: a room imports only rooms below it.
WEBUI_ROOMS = ["webui_attn.settings", "webui_attn.routing", "webui_attn.ui"]


def test_the_webuis_rooms_import_one_way():
    upward = []
    for room in WEBUI_ROOMS:
        for path in _files(room.replace(".", os.sep)):
            for target in _imports(path):
                theirs = next((r for r in WEBUI_ROOMS if target == r or target.startswith(r + ".")), None)
                if theirs is not None and WEBUI_ROOMS.index(theirs) > WEBUI_ROOMS.index(room):
                    upward.append(f"{_module_name(path)} imports {target}")
    assert upward == []


#: No module of the product (everything but the tests) is longer than this.
MAX_LINES = 600


def test_no_module_is_longer_than_max_lines():
    long = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("tests", "__pycache__", "node_modules")]
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                with open(path, encoding="utf-8") as f:
                    n = sum(1 for _ in f)
                if n > MAX_LINES:
                    long.append(f"{os.path.relpath(path, ROOT)}: {n} lines")
    assert long == []


def test_adapters_have_no_import_cycle():
    modules = {_module_name(p): p for pkg in ("host_attn",) + ADAPTERS for p in _files(pkg)}
    graph = {m: {t for t in _imports(p) if t in modules and t != m} for m, p in modules.items()}
    assert _cycle(graph) is None


def test_a_cycle_is_found_when_there_is_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_invoke_attn_imports_invokeai_only_at_its_edge():
    """InvokeAI's own modules are imported by the nodes and the hook alone; the rest of the adapter works
    on what those hand it (and is tested without InvokeAI's app)."""
    edge = {"invoke_attn.nodes", "invoke_attn.hook"}
    found = sorted(f"{_module_name(p)} imports {t}" for p in _files("invoke_attn") for t in _imports(p)
                   if t.split(".")[0] == "invokeai" and _module_name(p) not in edge)
    assert found == []
    assert {_module_name(p) for p in _files("invoke_attn")
            if any(t.split(".")[0] == "invokeai" for t in _imports(p))} == edge
