"""What the InvokeAI 6.14.2 double promises, checked against the real release.

Two kinds of evidence. The release's installed source (``pip install --no-deps invokeai==6.14.2`` in
.venv-invokeai) is read with ``ast``: the double's public names, signatures and model fields must be the
release's. Behaviour was observed by running the release's own modules in a venv with its full dependencies
(``pip install invokeai==6.14.2``, Python 3.11, CPU), importing ``invokeai.invocation_api`` and a node pack
module ``mypack.nodes`` in a script and printing what each call did; the docstrings give the call and what it
printed. The end-to-end graph runs were seen over the HTTP API of a running InvokeAI 6.14.2 (same venv,
a random-weight SD1.5 in diffusers layout).
"""
import ast
import importlib
import inspect
import logging
import sys
import threading
import types
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

import invokeai
from invokeai.app.invocations.baseinvocation import InvalidVersionError, RequiredConnectionException
from invokeai.app.services.shared.graph import Edge, EdgeConnection, Graph, GraphExecutionState, InvalidEdgeError
from invokeai.invocation_api import (
    BaseInvocation,
    BaseInvocationOutput,
    InvocationContext,
    MetadataField,
    StringOutput,
    UNetField,
    invocation,
)
from invokeai_host import insert_on_edge, node_types_by_pack, txt2img_graph, flux_graph, qwen_image_graph

DOUBLES = Path(__file__).resolve().parents[1] / "doubles" / "invokeai"
RELEASE = next(Path(p) for p in invokeai.__path__ if not Path(p).is_relative_to(DOUBLES))


def release_tree(module: str) -> ast.Module:
    """The parsed source of one of the release's modules."""
    path = RELEASE.joinpath(*module.split(".")[1:])
    source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    return ast.parse(source.read_text())


def release_class(module: str, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(release_tree(module)) if isinstance(n, ast.ClassDef) and n.name == name)


def arg_names(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]


def annotated_fields(cls: ast.ClassDef) -> list[str]:
    return [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


def define_pack_module(name: str, source: str) -> types.ModuleType:
    """A node pack module named ``name`` (e.g. ``mypack.nodes``), as if a pack folder had been imported."""
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


PACK_SOURCE = '''
from invokeai.invocation_api import (BaseInvocation, ImageOutput, Input, InputField, InvocationContext, UNetField,
                                     UNetOutput, WithMetadata, invocation)

@invocation("mypack_pass", title="Pass", version="1.0.0")
class Pass(BaseInvocation):
    unet: UNetField = InputField(description="u", input=Input.Connection)

    def invoke(self, context: InvocationContext) -> UNetOutput:
        context.logger.info(f"pass {self.unet.unet.name}")
        return UNetOutput(unet=self.unet)

@invocation("mypack_save", version="1.0.0")
class Save(BaseInvocation, WithMetadata):
    def invoke(self, context: InvocationContext) -> ImageOutput:
        from PIL import Image
        return ImageOutput.build(context.images.save(image=Image.new("RGB", (8, 8))))
'''


def context_for(host, node):
    """The context the runner would build for ``node`` (a one-node session of its own)."""
    from invokeai.app.services.shared.invocation_context import InvocationContextData, build_invocation_context

    item = host.session_queue.enqueue(Graph(nodes={node.id: node}))
    data = InvocationContextData(queue_item=item, invocation=node, source_invocation_id=node.id)
    return build_invocation_context(host.services, data, lambda: False)


@pytest.fixture
def mypack():
    yield define_pack_module("mypack.nodes", PACK_SOURCE)
    sys.modules.pop("mypack.nodes", None)


# --- The package: double where the app layer is, the release everywhere else ---------------------------------


def test_the_app_layer_is_the_double_and_the_backend_the_release():
    import invokeai.backend.flux.custom_block_processor as processor
    import invokeai.backend.flux.math as flux_math
    import invokeai.backend.flux.modules.layers as layers
    import invokeai.invocation_api as api

    for module in (flux_math, layers, processor):
        assert Path(module.__file__).is_relative_to(RELEASE), module.__name__
    for module in (api, inspect.getmodule(InvocationContext)):
        assert Path(module.__file__).is_relative_to(DOUBLES), module.__name__
    # The release's FLUX layers and block processor call the release's attention, imported by name.
    assert layers.attention is flux_math.attention and processor.attention is flux_math.attention


@pytest.mark.parametrize("module", [
    "invokeai.backend.flux.modules.autoencoder", "invokeai.backend.anima.anima_transformer",
    "invokeai.backend.krea2.attention", "invokeai.backend.ideogram4.modeling_ideogram4", "invokeai.backend.flux.model",
])
def test_release_backend_modules_import(module):
    assert Path(importlib.import_module(module).__file__).is_relative_to(RELEASE)


def test_invocation_api_exports_release_names_from_the_release_modules():
    """Every name of the double's ``invocation_api.__all__`` is in the release's ``__all__`` and is imported
    there from the same module."""
    import invokeai.invocation_api as api

    tree = release_tree("invokeai.invocation_api")
    real_all = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                    and getattr(n.targets[0], "id", None) == "__all__")
    source_module = {alias.name: n.module for n in tree.body if isinstance(n, ast.ImportFrom) for alias in n.names}
    assert set(api.__all__) <= set(real_all)
    for name in api.__all__:
        obj = getattr(api, name)
        if isinstance(obj, type) or inspect.isfunction(obj):
            assert obj.__module__ == source_module[name], name
    assert "WanTransformerField" not in real_all  # lives in invokeai.app.invocations.model only


SIGNATURES = [
    ("invokeai.app.invocations.baseinvocation", None, "invocation"),
    ("invokeai.app.invocations.baseinvocation", None, "invocation_output"),
    ("invokeai.app.invocations.baseinvocation", "BaseInvocation", "invoke_internal"),
    ("invokeai.app.invocations.fields", None, "InputField"),
    ("invokeai.app.services.shared.invocation_context", None, "build_invocation_context"),
    ("invokeai.app.services.shared.invocation_context", "ImagesInterface", "save"),
    ("invokeai.app.services.shared.invocation_context", "ModelsInterface", "load"),
    ("invokeai.app.services.shared.invocation_context", "UtilInterface", "sd_step_callback"),
    ("invokeai.app.services.shared.invocation_context", "UtilInterface", "flux_step_callback"),
    ("invokeai.app.services.shared.invocation_context", "UtilInterface", "flux2_step_callback"),
    ("invokeai.app.services.shared.invocation_context", "UtilInterface", "signal_progress"),
    ("invokeai.app.services.session_processor.session_processor_default", "DefaultSessionRunner", "__init__"),
    ("invokeai.app.services.session_processor.session_processor_default", "DefaultSessionRunner", "start"),
    ("invokeai.app.services.session_processor.session_processor_default", "DefaultSessionRunner", "run_node"),
    ("invokeai.app.invocations.load_custom_nodes", None, "load_custom_nodes"),
    ("invokeai.app.api.routers.custom_nodes", None, "_install_pack"),
    ("invokeai.app.api.routers.custom_nodes", None, "_uninstall_pack"),
    ("invokeai.app.api.routers.custom_nodes", None, "_purge_pack_modules"),
    ("invokeai.app.api.routers.custom_nodes", None, "_load_node_pack"),
]


@pytest.mark.parametrize("module,cls,fn", SIGNATURES, ids=lambda x: x or "-")
def test_signatures_are_the_release_ones(module, cls, fn):
    scope = release_class(module, cls).body if cls else release_tree(module).body
    real = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == fn)
    double = getattr(importlib.import_module(module), cls) if cls else importlib.import_module(module)
    assert [p for p in inspect.signature(getattr(double, fn)).parameters if p != "self"] == \
        [a for a in arg_names(real) if a != "self"]


@pytest.mark.parametrize("module,cls", [
    ("invokeai.app.invocations.model", "ModelIdentifierField"), ("invokeai.app.invocations.model", "UNetField"),
    ("invokeai.app.invocations.model", "CLIPField"), ("invokeai.app.invocations.model", "VAEField"),
    ("invokeai.app.invocations.model", "TransformerField"), ("invokeai.app.invocations.model", "WanTransformerField"),
    ("invokeai.app.invocations.fields", "ImageField"), ("invokeai.app.invocations.fields", "LatentsField"),
    ("invokeai.app.invocations.fields", "MetadataField"), ("invokeai.app.invocations.primitives", "ImageOutput"),
    ("invokeai.app.invocations.primitives", "LatentsOutput"), ("invokeai.app.invocations.primitives", "StringOutput"),
    ("invokeai.app.services.shared.invocation_context", "InvocationContextData"),
    ("invokeai.backend.stable_diffusion.extensions.preview", "PipelineIntermediateState"),
])
def test_model_fields_are_the_release_ones(module, cls):
    double_module = ("invokeai.backend.stable_diffusion.diffusers_pipeline" if module.endswith("preview") else module)
    double = getattr(importlib.import_module(double_module), cls)
    fields = list(getattr(double, "model_fields", None) or double.__dataclass_fields__)
    if issubclass(double, BaseInvocationOutput):  # the base's output_meta and the decorator's type
        fields = [f for f in fields if f not in ("output_meta", "type")]
    assert fields == annotated_fields(release_class(module, cls))


def test_session_queue_item_has_the_release_fields():
    from invokeai.app.services.session_queue.session_queue_common import SessionQueueItem

    real = annotated_fields(release_class("invokeai.app.services.session_queue.session_queue_common",
                                          "SessionQueueItem"))
    assert set(SessionQueueItem.model_fields) <= set(real)
    assert {"item_id", "session_id", "session", "queue_id", "user_id", "status"} <= set(SessionQueueItem.model_fields)


# --- The decorator and the fields, as observed in the release ------------------------------------------------


def test_node_pack_is_the_first_part_of_the_module_name(mypack):
    """Real: ``Pass.UIConfig.node_pack`` of a class defined in module ``mypack.nodes`` printed "mypack"; that
    of ``main_model_loader`` "invokeai"; over HTTP, ``GET /api/v2/custom_nodes/`` listed a pack's types."""
    from invokeai.app.invocations.baseinvocation import InvocationRegistry

    assert mypack.Pass.UIConfig.node_pack == "mypack"
    assert InvocationRegistry.get_invocation_for_type("main_model_loader").UIConfig.node_pack == "invokeai"
    assert node_types_by_pack()["mypack"] == ["mypack_pass", "mypack_save"]


def test_connection_input_is_optional_until_run(mypack, host):
    """Real: ``Pass.model_fields["unet"]`` had ``json_schema_extra`` {"input": "connection", "field_kind":
    "input", "orig_required": True}, annotation ``UNetField | None``, default None; ``use_cache`` default True;
    ``Pass(id="p").invoke_internal(context=None, services=...)`` raised RequiredConnectionException
    "Node mypack_pass missing connections for field unet"."""
    field = mypack.Pass.model_fields["unet"]
    assert field.json_schema_extra == {"input": "connection", "field_kind": "input", "orig_required": True}
    assert field.annotation == (UNetField | None) and field.default is None
    assert mypack.Pass.model_fields["type"].default == "mypack_pass"
    assert mypack.Pass.model_fields["use_cache"].default is True
    node = mypack.Pass(id="p")
    with pytest.raises(RequiredConnectionException, match="^Node mypack_pass missing connections for field unet$"):
        node.invoke_internal(context=context_for(host, node), services=host.services)


def test_version_rules_and_override_warnings(mypack, caplog):
    """Real: ``@invocation("mypack_badver", version="1.0")`` raised InvalidVersionError 'Invalid version string
    for node "mypack_badver": "1.0"'; without a version it warned 'No version specified for node
    "mypack_nover", using "1.0.0"'; re-registering "noise" from mypack warned 'Overriding core node "noise" with
    node from "mypack"', and "mypack_pass" from a module of otherpack: 'Overriding node "mypack_pass" from
    "otherpack" with node from "mypack"' (the release words it that way round)."""
    def node(name, module):
        cls = type(name, (BaseInvocation,), {"__module__": module, "invoke": lambda self, context: None})
        cls.invoke.__annotations__["return"] = StringOutput
        return cls

    with pytest.raises(InvalidVersionError, match='^Invalid version string for node "mypack_badver": "1.0"$'):
        invocation("mypack_badver", version="1.0")(node("Bad", "mypack.nodes"))
    with caplog.at_level(logging.WARNING, logger="InvokeAI"):
        assert invocation("mypack_nover")(node("NoVer", "mypack.nodes")).UIConfig.version == "1.0.0"
        invocation("noise", version="9.0.0")(node("MyNoise", "mypack.nodes"))
        invocation("mypack_pass", version="1.0.0")(node("Pass2", "otherpack.nodes"))
    assert caplog.messages == ['No version specified for node "mypack_nover", using "1.0.0"',
                               'Overriding core node "noise" with node from "mypack"',
                               'Overriding node "mypack_pass" from "otherpack" with node from "mypack"']


def test_invocation_cache_rules(host):
    """Real, with the release's MemoryInvocationCache(max_cache_size=4) and node_cache_size=4: nodes "a" and
    "b" of one counting type gave "1", "1" (b from the cache: the key leaves out the id), "c" with
    use_cache=False "2", and with node_cache_size=0 "d" gave "3"."""
    from invokeai.app.services.invocation_cache.invocation_cache_memory import MemoryInvocationCache

    calls = []

    @invocation("mypack_count", version="1.0.0")
    class Count(BaseInvocation):
        def invoke(self, context) -> StringOutput:
            calls.append(1)
            return StringOutput(value=str(len(calls)))

    host.configuration.node_cache_size = 4
    host.services.invocation_cache = MemoryInvocationCache(max_cache_size=4)

    def run(node):
        return node.invoke_internal(context_for(host, node), host.services).value

    values = [run(Count(id="a")), run(Count(id="b")), run(Count(id="c", use_cache=False))]
    host.configuration.node_cache_size = 0
    values.append(run(Count(id="d")))
    assert values == ["1", "1", "2", "3"]


def test_images_save_takes_the_node_metadata_unless_given(mypack, host):
    """Real, with ``build_invocation_context`` around a recording ``images.create``: a WithMetadata node with
    metadata {"from": "node"} saved with metadata '{"from":"node"}'; ``metadata=`` {"from": "argument"} won;
    without either, None. Each save first signalled progress "Saving image"; the graph went as JSON."""
    from invokeai.app.services.shared.invocation_context import InvocationContextData, build_invocation_context
    from PIL import Image

    graph = Graph()
    graph.add_node(mypack.Save(id="s"))
    queue_item = types.SimpleNamespace(workflow=None, session=types.SimpleNamespace(graph=graph), session_id="sess",
                                       user_id="system")

    def save(node, **kwargs):
        data = InvocationContextData(queue_item=queue_item, invocation=node, source_invocation_id="s")
        dto = build_invocation_context(host.services, data, lambda: False).images.save(Image.new("RGB", (8, 8)),
                                                                                       **kwargs)
        return host.images.saved[dto.image_name]

    with_metadata = mypack.Save(id="s", metadata=MetadataField.model_validate({"from": "node"}))
    assert save(with_metadata).metadata == '{"from":"node"}'
    assert save(with_metadata, metadata=MetadataField.model_validate({"from": "argument"})).metadata == \
        '{"from":"argument"}'
    saved = save(mypack.Save(id="s"))
    assert saved.metadata is None and saved.dto.node_id == "s" and saved.dto.session_id == "sess"
    assert Graph.model_validate_json(saved.graph).nodes["s"].get_type() == "mypack_save"
    progress = [e["message"] for e in host.events.events if e["event"] == "invocation_progress"]
    assert progress == ["Saving image"] * 3


# --- Graphs ---------------------------------------------------------------------------------------------------


def test_bad_node_field_fails_when_the_graph_is_built():
    """Real: ``Graph.model_validate({"nodes": {"d": {"id": "d", "type": "denoise_latents", "steps": 0}}})``
    raised pydantic's ValidationError with one error at "nodes.d.denoise_latents.steps", type "greater_than";
    an unknown type gave "union_tag_invalid". (Over HTTP such a graph was refused at enqueue with a 422.)"""
    with pytest.raises(ValidationError) as bad_steps:
        Graph.model_validate({"nodes": {"d": {"id": "d", "type": "denoise_latents", "steps": 0}}, "edges": []})
    assert [(".".join(map(str, e["loc"])), e["type"]) for e in bad_steps.value.errors()] == \
        [("nodes.d.denoise_latents.steps", "greater_than")]
    with pytest.raises(ValidationError) as bad_type:
        Graph.model_validate({"nodes": {"d": {"id": "d", "type": "no_such_node"}}, "edges": []})
    assert [e["type"] for e in bad_type.value.errors()] == ["union_tag_invalid"]


def test_one_edge_per_input_and_fresh_prepared_ids(mypack):
    """Real: a second edge into c.unet raised InvalidEdgeError "Edge already exists (b.unet -> c.unet)";
    ``GraphExecutionState(graph=...).next()`` returned a copy of node "x" with a new id, mapped back to "x"."""
    graph = Graph(nodes={n: mypack.Pass(id=n) for n in "abc"})
    graph.add_edge(Edge(source=EdgeConnection(node_id="a", field="unet"), destination=EdgeConnection(node_id="c", field="unet")))
    with pytest.raises(InvalidEdgeError, match=r"^Edge already exists \(b.unet -> c.unet\)$"):
        graph.add_edge(Edge(source=EdgeConnection(node_id="b", field="unet"),
                            destination=EdgeConnection(node_id="c", field="unet")))
    state = GraphExecutionState(graph=Graph(nodes={"x": mypack.Save(id="x")}))
    prepared = state.next()
    assert prepared.id != "x" and state.prepared_source_mapping[prepared.id] == "x"
    assert state.source_prepared_mapping == {"x": {prepared.id}}


# --- Runs -----------------------------------------------------------------------------------------------------


def count_calls(monkeypatch, owner, name):
    calls = []
    original = getattr(owner, name)

    def counting(*args, **kwargs):
        calls.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return calls


def test_txt2img_runs_attention_and_saves_the_metadata(host, monkeypatch):
    """Real (HTTP API, the same graph on a random-weight SD1.5): the item completed; the image's metadata was
    core_metadata's fields plus "app_version" "6.14.2"; without core_metadata it was null. The step callback
    order is the release's pipeline's (read in diffusers_pipeline.py): step 0 before the loop with timestep
    num_train_timesteps, then 1..N."""
    sdpa = count_calls(monkeypatch, torch.nn.functional, "scaled_dot_product_attention")
    item = host.run_graph(txt2img_graph(seed=42, steps=2))
    assert item.status == "completed", item.error_traceback
    saved = host.saved_image(item)
    assert (saved.dto.width, saved.dto.height, saved.image.mode) == (64, 64, "RGB")
    metadata = host.images.get_metadata(saved.dto.image_name).root
    assert metadata["seed"] == 42 and metadata["app_version"] == "6.14.2" and metadata["generation_mode"] == "txt2img"
    steps = [(e["state"].step, e["state"].total_steps, e["state"].timestep, e["base_model"].value)
             for e in host.events.steps(item.session_id)]
    assert [s[:2] for s in steps] == [(0, 2), (1, 2), (2, 2)] and steps[0][2] == 1000
    assert {s[3] for s in steps} == {"sd-1"}
    assert len(sdpa) > 0  # the UNet's and the VAE's AttnProcessor2_0
    plain = host.run_graph(txt2img_graph(seed=42, steps=2, metadata=False))
    assert host.images.get_metadata(host.saved_image(plain).dto.image_name) is None


def test_a_node_on_the_unet_edge_changes_nothing_but_the_graph(host, mypack, caplog):
    """Real (HTTP API): a pass-through pack node inserted between model_loader.unet and denoise.unet ran (its
    log line appeared) and the pixels equalled the plain run's with the same seed."""
    plain = host.run_graph(txt2img_graph(seed=7))
    graph = insert_on_edge(txt2img_graph(seed=7), {"type": "mypack_pass", "id": "unet_pass", "use_cache": False},
                           destination=("denoise", "unet"), input_field="unet")
    with caplog.at_level(logging.INFO, logger="InvokeAI"):
        item = host.run_graph(graph)
    assert item.status == "completed", item.error_traceback
    assert "pass tiny-sd15" in caplog.messages
    assert host.output(item, "unet_pass").unet == host.output(plain, "model_loader").unet
    assert host.saved_image(item).image.tobytes() == host.saved_image(plain).image.tobytes()


def test_flux_runs_the_release_attention(host, monkeypatch):
    """The release's FLUX.1 model runs its blocks through custom_block_processor, which calls ``attention``
    (from invokeai.backend.flux.math) once per double and per single block; its loop calls the step callback
    only after each step (read in invokeai/backend/flux/denoise.py)."""
    import invokeai.backend.flux.custom_block_processor as processor

    calls = count_calls(monkeypatch, processor, "attention")
    item = host.run_graph(flux_graph(steps=2))
    assert item.status == "completed", item.error_traceback
    assert len(calls) == 2 * 2  # 2 steps x (1 double block + 1 single block)
    steps = [(e["state"].step, e["state"].total_steps, e["base_model"].value) for e in host.events.steps()]
    assert steps == [(1, 2, "flux"), (2, 2, "flux")]
    assert host.events.steps()[0]["state"].latents.shape == (16, 4, 4)


def test_qwen_image_runs_dispatch_attention_fn(host, monkeypatch):
    """diffusers 0.40's QwenImage processors call ``dispatch_attention_fn`` (once per block and model call);
    the release's loop calls the step callback at step 0 and after each step (qwen_image_denoise.py)."""
    import diffusers.models.transformers.transformer_qwenimage as qwen

    calls = count_calls(monkeypatch, qwen, "dispatch_attention_fn")
    item = host.run_graph(qwen_image_graph(steps=2))
    assert item.status == "completed", item.error_traceback
    assert len(calls) == 2 * 2  # 2 steps x (positive + negative)
    assert [(e["state"].step, e["base_model"].value) for e in host.events.steps()] == \
        [(0, "qwen-image"), (1, "qwen-image"), (2, "qwen-image")]


def test_two_sessions_run_at_once_in_two_threads(host, monkeypatch):
    """The release runs one session per generation device, each on a thread session_processor_N; the model
    cache gives every session the same model object."""
    alone = [host.saved_image(host.run_graph(txt2img_graph(seed=s))).image.tobytes() for s in (1, 2)]
    host.events.events.clear()
    sdpa = count_calls(monkeypatch, torch.nn.functional, "scaled_dot_product_attention")
    items = host.run_concurrently([txt2img_graph(seed=1), txt2img_graph(seed=2)])
    assert [i.status for i in items] == ["completed", "completed"]
    assert [host.saved_image(i).image.tobytes() for i in items] == alone
    threads = {i.session_id: {e["thread"] for e in host.events.steps(i.session_id)} for i in items}
    assert sorted(t for names in threads.values() for t in names) == ["session_processor_0", "session_processor_1"]
    assert set(sdpa) == {"session_processor_0", "session_processor_1"}


def test_a_failing_node_fails_the_item(host):
    """Real (HTTP API): a graph naming an unknown model key failed with error_type "Exception" and
    error_message "Unknown model no-such-key"."""
    graph = txt2img_graph()
    graph.nodes["model_loader"].model.key = "no-such-key"
    item = host.run_graph(graph)
    assert (item.status, item.error_type, item.error_message) == ("failed", "Exception", "Unknown model no-such-key")
    assert list(item.session.errors.values()) == ["Exception: Unknown model no-such-key"]


def test_node_packs_load_as_top_level_packages(host, tmp_path):
    """Real (a pack linked into ROOT/nodes): imported as a package named after the folder, not on sys.path
    (relative imports work); folders starting with "_" are skipped; GET /api/v2/custom_nodes/ listed its
    node types under that name."""
    pack = tmp_path / "linkpack"
    pack.mkdir()
    (pack / "__init__.py").write_text("from .nodes import *  # noqa\n")
    (pack / "nodes.py").write_text(PACK_SOURCE.replace("mypack_", "linkpack_"))
    (tmp_path / "_hidden").mkdir()
    (tmp_path / "_hidden" / "__init__.py").write_text("raise RuntimeError('must not load')\n")
    try:
        assert host.load_node_packs(tmp_path) == ["linkpack"]
        assert str(pack) not in sys.path and sys.modules["linkpack"].__package__ == "linkpack"
        assert node_types_by_pack()["linkpack"] == ["linkpack_pass", "linkpack_save"]
    finally:
        for name in ("linkpack", "linkpack.nodes"):
            sys.modules.pop(name, None)


def test_a_canceled_session_stops_without_an_error(host):
    """As the release's runner (read in session_processor_default.py): the step callback raises
    CanceledException once the cancel event is set; run_node records no error, the loop ends, and the item is
    neither failed nor completed (the queue marks it canceled)."""
    from invokeai.app.services.session_processor.session_processor_default import DefaultSessionRunner

    cancel = threading.Event()

    def cancel_at_denoise(invocation, queue_item):
        if invocation.get_type() == "denoise_latents":
            cancel.set()

    item = host.run_graph(txt2img_graph(), cancel_event=cancel,
                          runner=DefaultSessionRunner(on_before_run_node_callbacks=[cancel_at_denoise]))
    assert (item.status, item.session.errors, host.images.saved) == ("in_progress", {}, {})
    assert "denoise" not in item.session.executed and host.events.steps() == []


# --- The node cache and the preparation of connected values, as the release has them ---------------------------


def _method_signatures(cls_node: ast.ClassDef) -> dict:
    return {n.name: [a for a in arg_names(n) if a != "self"] for n in cls_node.body if isinstance(n, ast.FunctionDef)}


def test_the_invocation_cache_has_the_release_methods():
    """Every method of the release's MemoryInvocationCache (its deletion hooks included), with its arguments."""
    from invokeai.app.services.invocation_cache.invocation_cache_memory import CachedItem, MemoryInvocationCache

    module = "invokeai.app.services.invocation_cache.invocation_cache_memory"
    real = _method_signatures(release_class(module, "MemoryInvocationCache"))
    double = {name: [p for p in inspect.signature(fn).parameters if p != "self"]
              for name, fn in vars(MemoryInvocationCache).items() if inspect.isfunction(getattr(fn, "__func__", fn))}
    assert double == real
    assert isinstance(vars(MemoryInvocationCache)["create_key"], staticmethod)
    assert list(CachedItem.__dataclass_fields__) == annotated_fields(release_class(module, "CachedItem"))


def _cache_calls(fn: ast.FunctionDef) -> list:
    """The methods of ``services.invocation_cache`` a function calls, in source order."""
    return [n.func.attr for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and ast.unparse(n.func.value) == "services.invocation_cache"]


def test_invoke_internal_goes_through_the_cache_as_the_release():
    from invokeai.app.invocations.baseinvocation import BaseInvocation

    real = next(n for n in release_class("invokeai.app.invocations.baseinvocation", "BaseInvocation").body
                if isinstance(n, ast.FunctionDef) and n.name == "invoke_internal")
    source = inspect.getsource(BaseInvocation.invoke_internal)
    double = ast.parse(__import__("textwrap").dedent(source)).body[0]
    assert _cache_calls(double) == _cache_calls(real) == ["create_key", "get", "save"]
    for tree in (real, double):  # both skip the cache on node_cache_size 0 and on the node's use_cache
        text = ast.unparse(tree)
        assert "services.configuration.node_cache_size == 0" in text and "self.use_cache" in text


def test_deleting_an_image_drops_the_cached_outputs_that_name_it(host, mypack):
    """As the release's ``start``: the stores' ``on_deleted`` call ``_delete_by_match`` with the name."""
    node = mypack.Save(id="s")
    output = node.invoke_internal(context_for(host, node), host.services)
    assert host.invocation_cache.get_status()["size"] == 1
    host.images.delete(output.image.image_name)
    assert host.invocation_cache.get_status()["size"] == 0


def test_the_string_primitive_is_the_release_one():
    from invokeai.app.invocations.primitives import StringInvocation

    real = release_class("invokeai.app.invocations.primitives", "StringInvocation")
    assert [f for f in StringInvocation.model_fields if f not in ("id", "is_intermediate", "use_cache", "type")] == \
        annotated_fields(real)
    decorator = next(d for d in real.decorator_list if isinstance(d, ast.Call))
    assert StringInvocation.get_type() == ast.literal_eval(decorator.args[0]) == "string"
    version = next(k.value for k in decorator.keywords if k.arg == "version")
    assert StringInvocation.UIConfig.version == ast.literal_eval(version)


def test_connected_values_are_set_when_the_node_is_handed_out():
    """As the release's ``next()`` (read in graph.py): every node that can be is prepared first, a copy with
    its typed values (``_prepare_until_node_ready``), and a node's connected values are set on it only when
    ``next()`` returns it (``_prepare_inputs``), through validated assignment: a refused value is a
    ``NodeInputError``."""
    from invokeai.app.services.shared.graph import NodeInputError

    real_next = next(n for n in release_class("invokeai.app.services.shared.graph", "GraphExecutionState").body
                     if isinstance(n, ast.FunctionDef) and n.name == "next")
    text = ast.unparse(real_next)
    assert text.index("_prepare_until_node_ready") < text.index("_prepare_inputs(next_node)")
    assert "raise NodeInputError(next_node, e)" in text

    graph = Graph.model_validate({"nodes": {"a": {"id": "a", "type": "string", "value": "given"},
                                            "b": {"id": "b", "type": "string", "value": "typed"}},
                                  "edges": [{"source": {"node_id": "a", "field": "value"},
                                             "destination": {"node_id": "b", "field": "value"}}]})
    state = GraphExecutionState(graph=graph)
    first = state.next()
    (b,) = state.source_prepared_mapping["b"]
    assert state.prepared_source_mapping[first.id] == "a" and state.execution_graph.nodes[b].value == "typed"
    state.complete(first.id, StringOutput(value="given"))
    assert state.next().value == "given"

    checked = define_pack_module("checkpack.nodes", CHECKED_SOURCE)
    try:
        state = GraphExecutionState(graph=Graph.model_validate(
            {"nodes": {"a": {"id": "a", "type": "string", "value": "bad"}, "c": {"id": "c", "type": "checkpack_checked"}},
             "edges": [{"source": {"node_id": "a", "field": "value"}, "destination": {"node_id": "c", "field": "text"}}]}))
        state.complete(state.next().id, StringOutput(value="bad"))
        with pytest.raises(NodeInputError, match=r"has invalid incoming input for text$") as refused:
            state.next()
        assert isinstance(refused.value.node, checked.Checked)
    finally:
        sys.modules.pop("checkpack.nodes", None)


CHECKED_SOURCE = '''
from pydantic import field_validator
from invokeai.invocation_api import BaseInvocation, InputField, InvocationContext, StringOutput, invocation

@invocation("checkpack_checked", version="1.0.0")
class Checked(BaseInvocation):
    text: str = InputField(default="ok", description="t")

    @field_validator("text")
    @classmethod
    def _not_bad(cls, value):
        if value == "bad":
            raise ValueError("bad text")
        return value

    def invoke(self, context: InvocationContext) -> StringOutput:
        return StringOutput(value=self.text)
'''


def _calls(fn: ast.FunctionDef, names: set) -> list:
    """The calls of ``fn`` to any of ``names`` (a function or a method's last name), in source order."""
    found = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name in names:
                found.append((node.lineno, node.col_offset, name))
    return [name for *_, name in sorted(found)]


def test_the_custom_node_manager_uninstalls_and_loads_as_the_release():
    """Uninstall: the folder deleted, the pack's nodes unregistered, then its modules purged; install: refused
    over an existing folder, then the pack loaded (skipped when its name is in sys.modules)."""
    import invokeai.app.api.routers.custom_nodes as double

    module = "invokeai.app.api.routers.custom_nodes"
    steps = {"_uninstall_pack": {"exists", "rmtree", "unregister_pack", "_purge_pack_modules"},
             "_install_pack": {"_load_node_pack"}, "_load_node_pack": {"exists", "exec_module"}}
    for name, wanted in steps.items():
        real = next(n for n in release_tree(module).body if isinstance(n, ast.FunctionDef) and n.name == name)
        mine = ast.parse(__import__("textwrap").dedent(inspect.getsource(getattr(double, name)))).body[0]
        assert _calls(mine, wanted) == _calls(real, wanted), name
        assert _calls(mine, {"exists"})[:1] == _calls(real, {"exists"})[:1] == ["exists"], name  # checked first
    loader = next(n for n in release_tree(module).body if isinstance(n, ast.FunctionDef) and n.name == "_load_node_pack")
    assert "if pack_name in sys.modules" in ast.unparse(loader)
    purge = next(n for n in release_tree(module).body if isinstance(n, ast.FunctionDef)
                 and n.name == "_purge_pack_modules")
    assert 'name == pack_name or name.startswith(prefix)' in ast.unparse(purge)


def test_a_node_s_result_is_checked_against_the_registered_outputs_as_the_release():
    """The release's InvocationCompleteEvent types its result AnyInvocationOutput, validated through the
    registry's output union: an output of a class no longer registered (a pack reinstalled) fails the node."""
    real = release_class("invokeai.app.services.events.events_common", "InvocationCompleteEvent")
    assert {n.target.id: ast.unparse(n.annotation) for n in real.body if isinstance(n, ast.AnnAssign)}["result"] == \
        "AnyInvocationOutput"
    from invokeai_host import EventLog

    import typing

    class Stale(BaseInvocationOutput):  # what an earlier copy of a pack registered under the same type
        type: typing.Literal["string_output"] = "string_output"
        value: str

    stale = Stale(value="x")
    with pytest.raises(ValidationError):
        EventLog().emit_invocation_complete(types.SimpleNamespace(session_id="s"), types.SimpleNamespace(
            id="n", get_type=lambda: "string"), stale)
