"""The node pack in the InvokeAI double: loading, the nodes, which nodes a session routes, the report,
the image's metadata, schedules by InvokeAI's step callbacks, the environment's default, and two
sessions at once. The graphs run the double's core nodes on tiny real models (a diffusers UNet and VAE,
InvokeAI's own FLUX.1 model, diffusers' Qwen-Image transformer)."""
import contextlib
import os

import numpy as np
import pytest
import torch
from pydantic import ValidationError

import lib_attn
from invoke_attn import choices, hook, sessions, startup, targets
from invokeai_host import insert_on_edge, flux_graph, node_types_by_pack, qwen_image_graph, txt2img_graph

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACK = "sd-webui-flash-attention"


@pytest.fixture(autouse=True)
def pack(tmp_path):
    """The repository loaded from a nodes folder the way InvokeAI loads it, under its folder's name; the
    defaults, sessions and stand-ins cleared after the test."""
    folder = tmp_path / "nodes"
    folder.mkdir()
    (folder / PACK).symlink_to(ROOT, target_is_directory=True)
    from invokeai.app.invocations.load_custom_nodes import load_custom_nodes
    import logging

    for name in [n for n in list(__import__("sys").modules) if n.startswith(f"{PACK}")]:
        del __import__("sys").modules[name]
    load_custom_nodes(folder, logging.getLogger("InvokeAI"))
    yield __import__("sys").modules[f"{PACK}.attention_nodes"]
    sessions.default_choice[0] = None
    sessions.reset()
    targets.undo()
    lib_attn.configure(schedule="")


def _attention(node_id="attn", **fields):
    return {"type": "flash_attention_backend", "id": node_id, "use_cache": False, **fields}


def _with_nodes(graph, attention=None, report_after="l2i"):
    """``graph`` with an Attention backend node (unconnected: the whole graph) and a report node."""
    if attention is not None:
        graph.add_node(_validated(attention))
    if report_after:
        graph.add_node(_validated({"type": "flash_attention_report", "id": "report", "use_cache": False}))
        from invokeai.app.services.shared.graph import Edge, EdgeConnection
        graph.add_edge(Edge(source=EdgeConnection(node_id=report_after, field="image"),
                            destination=EdgeConnection(node_id="report", field="image")))
    return graph


def _validated(node):
    from invokeai.app.invocations.baseinvocation import InvocationRegistry

    return InvocationRegistry.get_invocation_typeadapter().validate_python(node)


def _image_calls(host, item, node="l2i"):
    """{(role, backend): n} as the session's image records them."""
    attention = host.images.get_metadata(host.output(item, node).image.image_name).root["attention"]
    return {(c["role"], c["backend"]): c["count"] for c in attention["calls"]}


def _pixels(host, item):
    return np.asarray(host.saved_image(item).image).astype(int)


@contextlib.contextmanager
def _sdpa_calls():
    """Counts PyTorch's SDPA calls while no node is routed: the calls the engine must count when one is."""
    real, counted = torch.nn.functional.scaled_dot_product_attention, [0]

    def counting(*args, **kwargs):
        counted[0] += 1
        return real(*args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = counting
    try:
        yield counted
    finally:
        torch.nn.functional.scaled_dot_product_attention = real


def test_the_pack_loads_under_its_folder_name(pack):
    assert node_types_by_pack()[PACK] == ["flash_attention_backend", "flash_attention_report"]
    assert pack.AttentionBackendInvocation.UIConfig.node_pack == PACK


def test_a_graph_without_the_node_runs_as_before(host):
    plain = host.run_graph(txt2img_graph(seed=3))
    assert plain.status == "completed", plain.error_traceback
    assert "attention" not in host.images.get_metadata(host.output(plain, "l2i").image.image_name).root
    assert targets.routed() == []  # nothing was put anywhere


def test_the_node_routes_the_unet_and_the_vae_and_the_image_stays(host):
    with _sdpa_calls() as counted:
        plain = host.run_graph(txt2img_graph(seed=5))
    routed = host.run_graph(_with_nodes(txt2img_graph(seed=5), _attention()))
    assert routed.status == "completed", routed.error_traceback
    # The same kernel (Auto picks PyTorch's SDPA on a CPU in fp32): the same pixels, bit for bit.
    assert np.array_equal(_pixels(host, plain), _pixels(host, routed))

    text = host.output(routed, "report").report
    session = sessions._sessions[routed.session_id]
    assert session.recording.total() == counted[0] > 0
    assert session.recording.total("unet") > 0 and session.recording.total("vae") == 1
    assert text.splitlines()[0].startswith("UNet: sdpa") and f"×{session.recording.total('unet')}" in text
    assert "VAE: sdpa" in text and "×1" in text

    metadata = host.images.get_metadata(host.output(routed, "l2i").image.image_name).root
    assert metadata["seed"] == 5 and metadata["generation_mode"] == "txt2img"  # InvokeAI's own, kept
    attention = metadata["attention"]
    assert attention["text"][0].startswith("UNet: sdpa")
    assert attention["configuration"] == [{"backend": "auto", "vae": "auto", "guard": "on", "schedule": None,
                                           "strict": False, "sparse": None, "said_by": "node attn"}]
    assert {(c["role"], c["backend"]): c["count"] for c in attention["calls"]} == dict(session.recording.calls)


def test_a_chain_chosen_in_the_node_runs_and_stays_within_one_level(host):
    plain = host.run_graph(txt2img_graph(seed=6))
    routed = host.run_graph(_with_nodes(txt2img_graph(seed=6), _attention(backend="sdpa-math", vae_chain="math")))
    calls = sessions._sessions[routed.session_id].recording.calls
    assert set(calls) == {("unet", "sdpa-math"), ("vae", "math")}
    assert np.abs(_pixels(host, plain) - _pixels(host, routed)).max() <= 1


def test_a_connected_node_routes_only_the_nodes_that_get_their_model_through_it(host):
    graph = insert_on_edge(txt2img_graph(seed=7), _attention(backend="sdpa-math"), destination=("denoise", "unet"),
                           input_field="unet")
    item = host.run_graph(_with_nodes(graph))
    assert item.status == "completed", item.error_traceback
    recording = sessions._sessions[item.session_id].recording
    assert recording.total("unet") > 0 and recording.total("vae") == 0  # l2i gets its VAE from the loader
    assert "VAE" not in host.output(item, "report").report


@pytest.mark.parametrize("field,value,said", [
    ("chain", "flash-atn,sdpa", "unknown backend id 'flash-atn'; valid ids: flash-attn"),
    ("vae_chain", "nope", "unknown backend id 'nope'"),
    ("schedule", "0-50%: sdpa; 50-120%: math", "schedule rule 2 ('50-120%: math')"),
    ("sparse", "sol, budget=2", "sparse budget '2' is outside (0, 1]"),
    ("sparse", "dense-ish", "sparse method 'dense-ish' is not one of auto, sol, block-sparse"),
    ("sparse", "block-sparse, min_tokens=0.5", "sparse min_tokens '0.5' must be a whole number >= 1"),
    ("backend", "flash", "flash_attention_backend.backend"),
])
def test_a_bad_value_is_refused_when_the_graph_is_made(field, value, said):
    from invokeai.app.services.shared.graph import Graph

    data = txt2img_graph().model_dump(mode="json")
    data["nodes"]["attn"] = _attention(**{field: value})
    with pytest.raises(ValidationError) as caught:
        Graph.model_validate(data)
    assert said in str(caught.value)


def _rules(session):
    return {(label, role, backend): n for (_, label, role, backend), n in session.recording.rules.items()}


@pytest.mark.parametrize("make,role", [(txt2img_graph, "unet"), (flux_graph, "dit"), (qwen_image_graph, "dit")])
def test_the_schedule_gets_the_step_from_invokeai_callbacks(host, make, role):
    """SD and Qwen-Image call back with step 0 before the loop, FLUX.1 only after each step: the step
    rules hold as written either way (2 steps: the first on sdpa, the second on sdpa-math)."""
    graph = _with_nodes(make(steps=2), _attention(schedule="0-50%: sdpa; 50-100%: sdpa-math"), report_after=None)
    item = host.run_graph(graph)
    assert item.status == "completed", item.error_traceback
    rules = _rules(sessions._sessions[item.session_id])
    first, second = rules.get(("0-50%", role, "sdpa"), 0), rules.get(("50-100%", role, "sdpa-math"), 0)
    assert first > 0 and first == second


def test_flux1_and_qwen_image_run_on_the_engine_with_the_same_output(host):
    for make in (flux_graph, qwen_image_graph):
        plain = host.run_graph(make(seed=4))
        routed = host.run_graph(_with_nodes(make(seed=4), _attention(), report_after=None))
        assert routed.status == "completed", routed.error_traceback
        recording = sessions._sessions[routed.session_id].recording
        assert recording.total("dit") > 0 and recording.total() == recording.total("dit")
        a, b = host.output(plain, "denoise").latents.latents_name, host.output(routed, "denoise").latents.latents_name
        torch.testing.assert_close(host.services.tensors.load(b), host.services.tensors.load(a), rtol=0, atol=0)


def test_two_sessions_at_once_keep_their_kernels_and_their_counts(host):
    with _sdpa_calls() as counted:
        host.run_graph(txt2img_graph(seed=8))
    one = _with_nodes(txt2img_graph(seed=8), _attention(backend="sdpa"))
    two = _with_nodes(txt2img_graph(seed=9), _attention(backend="sdpa-math", vae_chain="math"))
    first, second = host.run_concurrently([one, two])
    assert first.status == second.status == "completed"
    # From the images: a session that ended before the other's first node is let go of by then.
    calls_one, calls_two = (_image_calls(host, item) for item in (first, second))
    assert set(calls_one) == {("unet", "sdpa"), ("vae", "sdpa")}
    assert set(calls_two) == {("unet", "sdpa-math"), ("vae", "math")}
    assert sum(calls_one.values()) == sum(calls_two.values()) == counted[0]
    assert "sdpa-math" not in host.output(first, "report").report
    assert "sdpa-math" in host.output(second, "report").report


def test_the_environment_routes_every_session_without_a_node(host):
    startup.start(PACK, environ={choices.ENV_ROUTE: "sdpa-math", choices.ENV_SCHEDULE: "cross: sdpa"})
    item = host.run_graph(_with_nodes(txt2img_graph(seed=10)))
    session = sessions._sessions[item.session_id]
    assert {b for _, b in session.recording.calls} == {"sdpa", "sdpa-math"}  # cross on sdpa, the rest sdpa-math
    attention = host.images.get_metadata(host.output(item, "l2i").image.image_name).root["attention"]
    assert attention["configuration"][0]["said_by"] == "ATTN_INVOKE_ROUTE=sdpa-math"
    # A node beats the variable for the nodes it applies to.
    item = host.run_graph(_with_nodes(txt2img_graph(seed=10), _attention(backend="sdpa")))
    assert {b for _, b in sessions._sessions[item.session_id].recording.calls} == {"sdpa"}
    # Connected on the UNet only: the VAE decode keeps the variable's (a chain is the denoisers'; the VAE
    # runs Auto); the metadata names both, and only what made calls (not the Attention backend node
    # itself, which has a UNet input).
    graph = insert_on_edge(txt2img_graph(seed=10), _attention(backend="sdpa"), destination=("denoise", "unet"),
                           input_field="unet")
    item = host.run_graph(graph)
    assert set(sessions._sessions[item.session_id].recording.calls) == {("unet", "sdpa"), ("vae", "sdpa")}
    attention = host.images.get_metadata(host.output(item, "l2i").image.image_name).root["attention"]
    assert [c["said_by"] for c in attention["configuration"]] == ["node attn", "ATTN_INVOKE_ROUTE=sdpa-math"]


def test_a_bad_environment_value_is_said_and_routes_nothing(host, capsys):
    startup.start(PACK, environ={choices.ENV_ROUTE: "flash-atn", choices.ENV_SCHEDULE: "0-200%: sdpa"})
    out = capsys.readouterr().out
    assert "ATTN_INVOKE_ROUTE='flash-atn': unknown backend id 'flash-atn'" in out
    assert "ATTN_INVOKE_SCHEDULE='0-200%: sdpa'" in out
    item = host.run_graph(txt2img_graph(seed=11))
    assert sessions._sessions[item.session_id] is None


def test_sparse_settings_in_the_node_reach_the_session_and_its_metadata(host, capsys, monkeypatch):
    startup.start(PACK, environ={choices.ENV_SPARSE: "sol, min_tokens=0"})
    assert ("ATTN_INVOKE_SPARSE='sol, min_tokens=0': sparse min_tokens '0' must be a whole number >= 1"
            in capsys.readouterr().out) and lib_attn.config().sparse is None
    text = "block-sparse, budget=0.1, min_tokens=100000"
    seen = []
    real = lib_attn.use

    def use(**config):
        seen.append(config.get("sparse"))
        return real(**config)

    monkeypatch.setattr(sessions.lib_attn, "use", use)
    plain = host.run_graph(txt2img_graph(seed=14))
    item = host.run_graph(_with_nodes(txt2img_graph(seed=14), _attention(sparse=text)))
    assert item.status == "completed", item.error_traceback
    assert seen and all(s.text == text + ", topk=0.1, dense=0-20%; first 1" for s in seen)
    attention = host.images.get_metadata(host.output(item, "l2i").image.image_name).root["attention"]
    assert attention["configuration"][0]["sparse"] == text + ", topk=0.1, dense=0-20%; first 1"
    # every call below min_tokens: dense, the same pixels as without the node's sparse settings
    assert np.array_equal(_pixels(host, plain), _pixels(host, item))
    assert lib_attn.config().sparse is None


def test_the_report_without_anything_routed_says_so(host):
    item = host.run_graph(_with_nodes(txt2img_graph(seed=12)))
    text = host.output(item, "report").report
    assert "InvokeAI's own attention, not through this extension" in text and "ATTN_INVOKE_ROUTE" in text


@pytest.mark.parametrize("attention_type", ["sliced", "xformers", "torch-sdp", "auto"])
def test_the_attention_type_note_is_where_invokeai_s_processor_ran(host, attention_type):
    """``sliced`` gives the UNet diffusers' sliced processor, which never calls SDPA: its calls are said with
    the processor that ran them, and only the VAE is routed. ``xformers`` is used only with xformers on a
    GPU of compute capability 7 or lower: here the UNet keeps its SDPA processor and is routed, and no
    note says otherwise."""
    host.configuration.attention_type = attention_type
    item = host.run_graph(_with_nodes(txt2img_graph(seed=13), _attention()))
    assert item.status == "completed", item.error_traceback
    session = sessions._sessions[item.session_id]
    report = host.output(item, "report").report
    if attention_type == "sliced":
        assert session.recording.total("unet") == 0 and session.recording.total("vae") == 1
        (note,) = [n for n in session.notes if "SlicedAttnProcessor" in n]
        assert note.startswith("UNet: ") and "(InvokeAI's attention_type is 'sliced'), not through this" in note
        from invokeai_host import InvokeHost

        with _sdpa_calls() as counted:  # the UNet's attention calls, on its SDPA processor
            InvokeHost().run_graph(txt2img_graph(seed=13))
        assert int(note.split()[1]) == counted[0] - 1 and note in report
    else:
        assert session.recording.total("unet") > 0 and not session.notes
        assert "attention_type" not in report


def test_the_hook_comes_off_exactly():
    from invokeai.app.invocations.baseinvocation import BaseInvocation

    hooked = BaseInvocation.invoke_internal
    original = hooked.__wrapped__
    assert hook.remove() == 1
    assert BaseInvocation.invoke_internal is original
    hook.install("flash_attention_backend", f"{PACK}.attention_nodes")
    assert BaseInvocation.invoke_internal is not original


def test_uninstalling_the_pack_takes_the_hook_and_the_stand_ins_off(host, pack):
    """InvokeAI's Custom Node Manager unregisters the pack's nodes and drops its modules from sys.modules."""
    import sys

    from invokeai.app.invocations.baseinvocation import BaseInvocation, InvocationRegistry

    host.run_graph(_with_nodes(txt2img_graph(seed=14), _attention()))
    assert targets.routed()
    original = BaseInvocation.invoke_internal.__wrapped__
    InvocationRegistry.unregister_pack(PACK)
    for name in [n for n in sys.modules if n == PACK or n.startswith(f"{PACK}.")]:
        del sys.modules[name]
    plain = host.run_graph(txt2img_graph(seed=14))
    assert plain.status == "completed", plain.error_traceback
    assert BaseInvocation.invoke_internal is original
    assert targets.routed() == []


def test_the_shipped_workflow_matches_the_nodes(pack):
    """docs/invokeai-workflow.json (imported by the Custom Node Manager) names the nodes' current version and
    every one of their inputs, and the graph it describes is one the nodes accept."""
    import json

    with open(os.path.join(ROOT, "docs", "invokeai-workflow.json"), encoding="utf-8") as f:
        workflow = json.load(f)
    base = {"id", "type", "is_intermediate", "use_cache"}
    ours = {pack.BACKEND_TYPE: pack.AttentionBackendInvocation, pack.REPORT_TYPE: pack.AttentionReportInvocation}
    versions = {pack.BACKEND_TYPE: pack.BACKEND_VERSION, pack.REPORT_TYPE: pack.REPORT_VERSION}
    seen = set()
    for node in workflow["nodes"]:
        data = node["data"]
        if data["type"] in ours:
            cls = ours[data["type"]]
            seen.add(data["type"])
            assert data["version"] == versions[data["type"]] == cls.UIConfig.version and data["nodePack"] == PACK
            assert set(data["inputs"]) == set(cls.model_fields) - base
            values = {k: v["value"] for k, v in data["inputs"].items() if "value" in v}
            cls(id=data["id"], **values)  # the values pass the node's own checks
    assert seen == set(ours)
    wired = {(e["source"], e["sourceHandle"], e["target"], e["targetHandle"]) for e in workflow["edges"]}
    assert ("decode", "image", "report", "image") in wired
    assert not any("attention" in (e["source"], e["target"]) for e in workflow["edges"])  # routes the whole graph


def test_vram_is_measured_on_the_device_of_the_session_s_thread(host, monkeypatch):
    """InvokeAI pins each session thread to its GPU (``TorchDevice.choose_torch_device``); the session's
    VRAM probe asks it once, when the session starts."""
    asked = []
    monkeypatch.setattr(hook, "session_device", lambda: asked.append(1) or torch.device("cpu"))
    item = host.run_graph(_with_nodes(txt2img_graph(seed=15), _attention()))
    assert asked == [1]
    assert sessions._sessions[item.session_id].probe.device == torch.device("cpu")


# --- InvokeAI's node cache -------------------------------------------------------------------------------------


def _routed_unet_and_vae(graph, **fields):
    """``graph`` (use_cache on) with an Attention backend node between the loader and both the denoise node
    and l2i, as a user wires it, and a report node after l2i."""
    from invokeai.app.services.shared.graph import Edge, EdgeConnection

    graph = insert_on_edge(graph, _attention(use_cache=True, **fields), destination=("denoise", "unet"),
                           input_field="unet")
    (old,) = graph._get_input_edges("l2i", "vae")
    graph.delete_edge(old)
    graph.add_edge(Edge(source=old.source, destination=EdgeConnection(node_id="attn", field="vae")))
    graph.add_edge(Edge(source=EdgeConnection(node_id="attn", field="vae"), destination=old.destination))
    return _with_nodes(graph)


def _ran(host, item):
    """The routed session's calls {(role, backend): n}, its report, and the name of the image l2i gave."""
    session = sessions._sessions[item.session_id]
    return dict(session.recording.calls), host.output(item, "report").report, host.output(item, "l2i").image.image_name


def test_a_changed_setting_never_takes_an_output_cached_under_another(host):
    """With InvokeAI's cache on (node_cache_size 512, use_cache on every node): a plain run, then the node
    with sdpa-math, then with sdpa: each runs its denoise and decode on its own kernels and saves its own
    image; the last graph again comes from the cache, and the report says so."""
    plain = host.run_graph(txt2img_graph(seed=21, use_cache=True))
    assert plain.status == "completed", plain.error_traceback
    seen = set()
    for backend in ("sdpa-math", "sdpa"):
        item = host.run_graph(_routed_unet_and_vae(txt2img_graph(seed=21, use_cache=True), backend=backend,
                                                   vae_chain=backend))
        assert item.status == "completed", item.error_traceback
        calls, report, image = _ran(host, item)
        assert set(calls) == {("unet", backend), ("vae", backend)} and calls[("vae", backend)] == 1
        assert "InvokeAI's own attention" not in report and "node cache" not in report
        metadata = host.images.get_metadata(image).root["attention"]
        assert metadata["configuration"][0]["backend"] == backend
        seen.add(image)
    assert len(seen | {host.output(plain, "l2i").image.image_name}) == 3  # three runs, three images

    again = host.run_graph(_routed_unet_and_vae(txt2img_graph(seed=21, use_cache=True), backend="sdpa",
                                                vae_chain="sdpa"))
    calls, report, image = _ran(host, again)
    assert calls == {} and image in seen  # nothing ran: the sdpa run's image
    assert "note: denoise_latents and l2i: from InvokeAI's node cache" in report
    assert "InvokeAI's own attention" not in report
    # The plain graph again is still the plain run's, from the cache, untouched by the routed runs.
    assert host.output(host.run_graph(txt2img_graph(seed=21, use_cache=True)), "l2i").image.image_name == \
        host.output(plain, "l2i").image.image_name


def test_equal_configurations_share_cached_outputs(host):
    """The same configuration said by a node on the edges and by one routing the whole graph: the second
    session takes the first one's outputs (the configuration, not the graph around it, is in the key)."""
    first = host.run_graph(_routed_unet_and_vae(txt2img_graph(seed=22, use_cache=True), backend="sdpa-math"))
    first_calls, _, first_image = _ran(host, first)  # read before the next session lets the ended one go
    assert sum(first_calls.values()) > 0
    second = host.run_graph(_with_nodes(txt2img_graph(seed=22, use_cache=True),
                                        _attention(backend="sdpa-math", use_cache=True)))
    calls, report, image = _ran(host, second)
    assert calls == {} and image == first_image and "from InvokeAI's node cache" in report


@pytest.mark.parametrize("how", ["use_cache", "node_cache_size"])
def test_without_the_cache_every_routed_node_runs(how):
    from invokeai_host import InvokeHost

    host = InvokeHost(node_cache_size=0 if how == "node_cache_size" else 512)
    images = set()
    for _ in range(2):
        graph = _routed_unet_and_vae(txt2img_graph(seed=23, use_cache=how != "use_cache"), backend="sdpa-math")
        item = host.run_graph(graph)
        calls, report, image = _ran(host, item)
        assert sum(calls.values()) > 0 and "node cache" not in report
        images.add(image)
    assert len(images) == 2


# --- Values connected to the node's inputs ---------------------------------------------------------------------


def _string_into(graph, node_id, field, value, string_id="text"):
    from invokeai.app.services.shared.graph import Edge, EdgeConnection

    graph.add_node(_validated({"type": "string", "id": string_id, "value": value, "use_cache": False}))
    graph.add_edge(Edge(source=EdgeConnection(node_id=string_id, field="value"),
                        destination=EdgeConnection(node_id=node_id, field=field)))
    return graph


def test_a_connected_value_is_the_one_that_applies(host):
    """A String node gives ``chain`` (the typed value says otherwise): the chain InvokeAI sets on the prepared
    node is the one that runs, and the one the metadata names."""
    graph = _string_into(_routed_unet_and_vae(txt2img_graph(seed=24), backend="sdpa"), "attn", "chain", "sdpa-math")
    item = host.run_graph(graph)
    assert item.status == "completed", item.error_traceback
    calls, report, image = _ran(host, item)
    assert {backend for role, backend in calls if role == "unet"} == {"sdpa-math"}
    assert host.images.get_metadata(image).root["attention"]["configuration"][0]["backend"] == "sdpa-math"


def test_a_connected_value_changes_the_cache_key(host):
    runs = []
    for chain in ("sdpa-math", "sdpa", "sdpa"):
        graph = _string_into(_routed_unet_and_vae(txt2img_graph(seed=25, use_cache=True)), "attn", "chain", chain)
        runs.append(_ran(host, host.run_graph(graph)))
    assert {b for _, b in runs[0][0]} == {"sdpa-math", "sdpa"} and {b for _, b in runs[1][0]} == {"sdpa"}
    assert runs[2][0] == {} and runs[2][2] == runs[1][2] and "node cache" in runs[2][1]


def test_a_bad_connected_value_fails_the_session_naming_the_field(host):
    """InvokeAI sets a connected value through the node's own validators, as it checks a typed one."""
    item = host.run_graph(_string_into(_routed_unet_and_vae(txt2img_graph(seed=26)), "attn", "chain", "flash-atn"))
    assert (item.status, item.error_type) == ("failed", "NodeInputError")
    assert item.error_message.endswith("has invalid incoming input for chain")
    assert "unknown backend id 'flash-atn'" in item.error_traceback
    assert not host.images.saved  # nothing ran on another chain than the one asked


def test_a_value_connected_to_a_node_that_routes_the_whole_graph_is_refused(host):
    """Connected to no model, the node need not run before the nodes it routes (InvokeAI orders ready nodes
    by class), so a connected value might apply to some and not others: the first routed node says so."""
    graph = _string_into(_with_nodes(txt2img_graph(seed=27), _attention(backend="sdpa")), "attn", "chain", "sdpa-math")
    item = host.run_graph(graph)
    assert item.status == "failed" and not host.images.saved
    assert item.error_message.startswith("Attention backend node attn: chain connected from other nodes, while the "
                                         "node is connected to no model; connect its outputs")


def test_a_node_with_a_model_connected_in_but_no_outputs_routes_the_whole_graph(host):
    """The loader's unet goes into the node, nothing comes out of it: its model input holds no value of the
    configuration, so it routes the whole graph with its typed values."""
    from invokeai.app.services.shared.graph import Edge, EdgeConnection

    graph = _with_nodes(txt2img_graph(seed=28), _attention(backend="sdpa-math"))
    graph.add_edge(Edge(source=EdgeConnection(node_id="model_loader", field="unet"),
                        destination=EdgeConnection(node_id="attn", field="unet")))
    item = host.run_graph(graph)
    assert item.status == "completed", item.error_traceback
    calls = sessions._sessions[item.session_id].recording.calls
    assert {backend for role, backend in calls if role == "unet"} == {"sdpa-math"}


REREAD_SOURCE = '''
from invokeai.invocation_api import BaseInvocation, InvocationContext, StringOutput, invocation

@invocation("rereadpack_chain", title="Chain", version="1.0.0")
class Chain(BaseInvocation):
    """Gives a chain, after the queue item's execution state was read again into a new object, as the return
    from a called workflow resumes its parent."""

    def invoke(self, context: InvocationContext) -> StringOutput:
        item = context._data.queue_item
        item.session = item.session.model_copy(deep=True)
        return StringOutput(value="sdpa-math")
'''


@pytest.fixture
def reread_node():
    import sys
    from invokeai.app.invocations.baseinvocation import InvocationRegistry
    from test_doubles import define_pack_module

    yield define_pack_module("rereadpack.nodes", REREAD_SOURCE)
    InvocationRegistry.unregister_pack("rereadpack")
    sys.modules.pop("rereadpack.nodes", None)


def test_a_connected_value_applies_after_the_execution_state_was_read_again(host, reread_node):
    """The node's chain comes from a node that replaced the item's execution state; the Attention backend
    node runs after it, recorded in the new state only: its connected value is found there."""
    from invokeai.app.services.shared.graph import Edge, EdgeConnection

    graph = _routed_unet_and_vae(txt2img_graph(seed=34), backend="sdpa")
    graph.add_node(_validated({"type": "rereadpack_chain", "id": "chain", "use_cache": False}))
    graph.add_edge(Edge(source=EdgeConnection(node_id="chain", field="value"),
                        destination=EdgeConnection(node_id="attn", field="chain")))
    item = host.run_graph(graph)
    assert item.status == "completed", (item.error_message, item.error_traceback)
    calls, _, _ = _ran(host, item)
    assert {backend for role, backend in calls if role == "unet"} == {"sdpa-math"}


# --- A VAE run inside a denoise node -----------------------------------------------------------------------------


def _reference_image(host):
    from PIL import Image

    pixels = (np.random.default_rng(0).random((32, 32, 3)) * 255).astype(np.uint8)
    return host.images.create(Image.fromarray(pixels), image_origin="external", image_category="user").image_name


def test_flux2_reference_images_are_encoded_as_vae_calls(host):
    """FLUX.2 encodes its reference images with its VAE inside ``flux2_denoise`` (a ``dit`` node): those
    calls count, chain and report as the VAE's; the transformer's stay the denoiser's."""
    from invokeai_host import flux2_graph

    reference = _reference_image(host)
    with _sdpa_calls() as counted:
        plain = host.run_graph(flux2_graph(references=(reference,)))
    assert plain.status == "completed", plain.error_traceback
    vae = host.services.model_manager.load.load_model(
        next(c for c in __import__("invokeai_tiny_models").INSTALLED if c.name == "tiny-flux2"),
        __import__("invokeai.backend.model_manager.taxonomy", fromlist=["SubModelType"]).SubModelType.VAE).model
    with _sdpa_calls() as encode_calls:
        vae.encode(torch.zeros(1, 3, 32, 32))
    assert encode_calls[0] == 1  # the encoder's mid-block attention

    graph = _with_nodes(flux2_graph(references=(reference,)), _attention(backend="sdpa", vae_chain="math"),
                        report_after=None)
    routed = host.run_graph(graph)
    assert routed.status == "completed", routed.error_traceback
    calls = dict(sessions._sessions[routed.session_id].recording.calls)
    assert calls[("vae", "math")] == encode_calls[0]
    assert calls[("dit", "sdpa")] == counted[0] - encode_calls[0]
    assert set(calls) == {("vae", "math"), ("dit", "sdpa")}
    a, b = host.output(plain, "denoise").latents.latents_name, host.output(routed, "denoise").latents.latents_name
    torch.testing.assert_close(host.services.tensors.load(b), host.services.tensors.load(a), rtol=1e-5, atol=1e-5)

    without = host.run_graph(_with_nodes(flux2_graph(), _attention(vae_chain="math"), report_after=None))
    assert {role for role, _ in sessions._sessions[without.session_id].recording.calls} == {"dit"}


def test_a_vae_hook_changes_nothing_where_no_node_is_routed():
    """The hooks stay on the shared VAE: a call made while no node is routed keeps no role, and a routed
    node's role comes back after the VAE's call, an error included."""
    from diffusers import AutoencoderKL

    from invoke_attn import model_hooks, work

    vae = AutoencoderKL(block_out_channels=(32,), norm_num_groups=32, latent_channels=4).eval()
    attention = next(m for m in vae.modules() if hasattr(m, "processor"))
    assert model_hooks.mark(vae) == 2 and model_hooks.mark(vae) == 0
    seen, fail = [], []

    def inside(module, args):  # runs inside the attention module's call, after the hook that sets the role
        seen.append(work.role())
        if fail:
            raise RuntimeError("failed inside the VAE's attention")

    attention.register_forward_pre_hook(inside)
    try:
        vae.encode(torch.zeros(1, 3, 16, 16))
        with work.running("dit"):
            vae.encode(torch.zeros(1, 3, 16, 16))
            assert work.role() == "dit"
            fail.append(1)
            with pytest.raises(RuntimeError, match="inside the VAE"):
                vae.encode(torch.zeros(1, 3, 16, 16))
            assert work.role() == "dit"
        assert seen == [None, "vae", "vae"]
    finally:
        model_hooks.undo()
    fail.clear()
    with work.running("dit"):
        vae.encode(torch.zeros(1, 3, 16, 16))
    assert seen[-1] == "dit"  # unhooked: the node's role again


# --- A family without step callbacks ----------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [None, 4], ids=["preset-steps", "steps-set"])
def test_ideogram4_is_told_its_steps_from_its_progress(host, steps):
    """Ideogram-4 has no step callback and by default no ``steps``: it signals the fraction of its steps done
    after each step. A two-rule schedule splits its calls at half the run (12 preset steps or 4 set ones,
    two transformer calls per step), with no note that steps were unknown."""
    from invokeai_host import ideogram4_graph

    graph = _with_nodes(ideogram4_graph(steps=steps), _attention(schedule="0-50%: sdpa; 50-100%: sdpa-math"),
                        report_after=None)
    item = host.run_graph(graph)
    assert item.status == "completed", item.error_traceback
    session = sessions._sessions[item.session_id]
    total = 2 * (steps or 12)
    assert _rules(session) == {("0-50%", "dit", "sdpa"): total // 2, ("50-100%", "dit", "sdpa-math"): total // 2}
    assert not any("no step" in note for note in session.notes)
    progress = [e["percentage"] for e in host.events.events
                if e["event"] == "invocation_progress" and e["percentage"] is not None]
    assert progress[-1] == 1.0 and len(progress) == (steps or 12)  # the node's own signals, passed on


def test_a_denoiser_that_tells_no_step_is_said_in_the_report(host, monkeypatch):
    """A node that signals no progress (Ideogram-4's loop without its callback): every call is the first
    step's, and the report says so."""
    import invokeai.app.invocations.ideogram4_denoise as ideogram4
    from invokeai_host import ideogram4_graph

    loop = ideogram4.run_ideogram4_denoise
    monkeypatch.setattr(ideogram4, "run_ideogram4_denoise", lambda **kwargs: loop(**{**kwargs, "step_callback": None}))
    graph = _with_nodes(ideogram4_graph(steps=2), _attention(schedule="0-50%: sdpa; 50-100%: sdpa-math"),
                        report_after=None)
    item = host.run_graph(graph)
    session = sessions._sessions[item.session_id]
    assert _rules(session) == {("0-50%", "dit", "sdpa"): 4}
    assert "ideogram4_denoise told InvokeAI no step: the schedule's step rules took all its calls as its first " \
           "step" in session.notes


MASK_SOURCE = '''
import torch
from invokeai.invocation_api import (BaseInvocation, Input, InputField, InvocationContext, StringOutput, UNetField,
                                     VAEField, invocation)

@invocation("maskpack_mask", title="Mask", version="1.0.0")
class Mask(BaseInvocation):
    """Create Gradient Mask's shape: a unet and a vae in; it only encodes an image through the VAE."""
    unet: UNetField = InputField(description="u", input=Input.Connection)
    vae: VAEField = InputField(description="v", input=Input.Connection)

    @torch.no_grad()
    def invoke(self, context: InvocationContext) -> StringOutput:
        with context.models.load(self.vae.vae) as vae:
            vae.encode(torch.zeros(1, 3, 32, 32))
        return StringOutput(value="mask")
'''


@pytest.fixture
def mask_node():
    import sys
    from invokeai.app.invocations.baseinvocation import InvocationRegistry
    from test_doubles import define_pack_module

    yield define_pack_module("maskpack.nodes", MASK_SOURCE)
    InvocationRegistry.unregister_pack("maskpack")
    sys.modules.pop("maskpack.nodes", None)


def test_a_denoiser_shaped_node_that_only_runs_its_vae_gets_no_step_note(host, mask_node):
    """A node with unet and vae inputs (Create Gradient Mask) whose calls are all VAE calls: step rules never
    apply to them, so its telling no step is not said."""
    from invokeai.app.services.shared.graph import Edge, EdgeConnection

    graph = _with_nodes(txt2img_graph(seed=29), _attention(schedule="0-50%: sdpa; 50-100%: sdpa-math"))
    graph.add_node(_validated({"type": "maskpack_mask", "id": "mask", "use_cache": False}))
    for field in ("unet", "vae"):
        graph.add_edge(Edge(source=EdgeConnection(node_id="model_loader", field=field),
                            destination=EdgeConnection(node_id="mask", field=field)))
    item = host.run_graph(graph)
    assert item.status == "completed", item.error_traceback
    session = sessions._sessions[item.session_id]
    assert session.recording.total("vae") > 1  # the mask node's encode and l2i's decode ran routed
    assert not any("told InvokeAI no step" in note for note in session.notes), session.notes


PASS_SOURCE = '''
from invokeai.invocation_api import (BaseInvocation, Input, InputField, InvocationContext, UNetField, UNetOutput,
                                     invocation)

@invocation("passpack_pass", title="Pass", version="1.0.0")
class Pass(BaseInvocation):
    """A LoRA loader's shape: a unet in, the unet out."""
    unet: UNetField = InputField(description="u", input=Input.Connection)

    def invoke(self, context: InvocationContext) -> UNetOutput:
        return UNetOutput(unet=self.unet)
'''


@pytest.fixture
def pass_node():
    import sys
    from invokeai.app.invocations.baseinvocation import InvocationRegistry
    from test_doubles import define_pack_module

    yield define_pack_module("passpack.nodes", PASS_SOURCE)
    InvocationRegistry.unregister_pack("passpack")
    sys.modules.pop("passpack.nodes", None)


def test_a_node_that_passes_a_model_on_is_no_cache_note(host, pass_node):
    """A model-passing node between the loader and denoise, answered from the cache on a second run with a
    new seed: its output carried no attention, so the report names no cached node (the denoise ran)."""
    def graph(seed):
        made = insert_on_edge(txt2img_graph(seed=seed, use_cache=True),
                              {"type": "passpack_pass", "id": "pass", "use_cache": True},
                              destination=("denoise", "unet"), input_field="unet")
        return _with_nodes(made, _attention(backend="sdpa-math"))

    host.run_graph(graph(32))
    item = host.run_graph(graph(33))
    assert item.status == "completed", item.error_traceback
    session = sessions._sessions[item.session_id]
    assert session.recording.total("unet") > 0  # a new seed: the denoise ran
    assert session.cached == [] and "node cache" not in host.output(item, "report").report


def test_the_pack_s_node_classes_never_share_a_key_even_at_a_reused_address():
    """id() is an address: a class made after an earlier one was freed can get it again; its key is new."""
    import gc

    from invoke_attn import node_cache
    from pydantic import BaseModel

    def make():
        class AttentionBackendInvocation(BaseModel):
            backend: str = "auto"
        return AttentionBackendInvocation

    for _ in range(20):
        first = make()
        address, key = id(first), node_cache.of_class(first)
        del first
        gc.collect()
        second = make()
        if id(second) == address:
            assert node_cache.of_class(second) != key
            assert node_cache.of_class(second) == node_cache.of_class(second)
            return
    pytest.skip("no class got a freed class's address in 20 tries")


def test_the_cache_key_holds_the_configuration_itself_not_a_number_of_this_process(host):
    """After an update replaced the engine in the same process, its configurations are numbered anew:
    the key says what the configuration is (and the pack's code), so a new number never meets an
    output made under another configuration."""
    from invoke_attn import node_cache

    def key(**config):
        with lib_attn.use(**config) as made:
            services, _ = node_cache.keyed(host.services, node_cache.configuration(made))  # as sessions.run does
        return services.invocation_cache.create_key(_validated({"type": "noise", "id": "n"}))

    import sys

    math, sdpa = key(preference={"unet": ("sdpa-math",)}), key(preference={"unet": ("sdpa",)})
    numbers = sys.modules["lib_attn.config"]._TOKENS
    kept = dict(numbers)
    numbers.clear()  # the numbers of a fresh engine module: sdpa now gets the number sdpa-math had
    try:
        assert key(preference={"unet": ("sdpa",)}) == sdpa and key(preference={"unet": ("sdpa-math",)}) == math
    finally:
        numbers.clear()
        numbers.update(kept)
    assert math != sdpa


def test_a_denoiser_that_tells_no_step_is_said_with_sparse_attentions_dense_windows(host, monkeypatch):
    """Sparse on and no schedule: the dense window 0-20% asks for steps, so a node that signals no progress
    would have every call in it, and the report says why. (Ideogram-4's attention carries its text padding
    mask, so here its calls are dense for that reason first.)"""
    import invokeai.app.invocations.ideogram4_denoise as ideogram4
    from invokeai_host import ideogram4_graph

    loop = ideogram4.run_ideogram4_denoise
    monkeypatch.setattr(ideogram4, "run_ideogram4_denoise", lambda **kwargs: loop(**{**kwargs, "step_callback": None}))
    graph = _with_nodes(ideogram4_graph(steps=2), _attention(sparse="block-sparse, min_tokens=1, dense=0-20%"),
                        report_after=None)
    item = host.run_graph(graph)
    assert item.status == "completed", item.error_traceback
    session = sessions._sessions[item.session_id]
    assert session.recording.sparse.settings.startswith("block-sparse") and session.recording.sparse.dense_calls == 4
    assert "ideogram4_denoise told InvokeAI no step: sparse attention's dense windows took all its calls as its " \
           "first step" in session.notes


# --- a session's recording and its VRAM, however long it runs -------------------------------------------------

def test_the_report_and_every_saved_image_carry_peak_vram(host, monkeypatch):
    """On a (simulated) CUDA device: the decode's save reads the session's VRAM probe without ending it, so the
    report node after the decode shows peak VRAM too, and so does every later save."""
    from tests.simulated_cuda import GIB, SimulatedDevice

    device = SimulatedDevice(total=24 * GIB).install(monkeypatch)
    monkeypatch.setattr(hook, "session_device", lambda: torch.device("cuda", 0))
    device.alloc(3 * GIB)  # what the session's models take on the device
    graph = _with_nodes(txt2img_graph(seed=44), _attention())
    item = host.run_graph(graph)
    assert item.status == "completed", item.error_traceback
    metadata = host.images.get_metadata(host.output(item, "l2i").image.image_name).root["attention"]
    assert metadata["vram"]["active_peak_bytes"] == 3 * GIB and metadata["seconds"] > 0
    report = host.output(item, "report").report
    assert "peak VRAM: allocated " in report and "of 24.00 GiB" in report
    session = sessions._sessions[item.session_id]
    for _ in range(3):  # more saves: each one still measures
        assert session.metadata()["vram"]["total_bytes"] == 24 * GIB
    sessions.reset()  # while the simulated device is there


def _small_routed_graph(n):
    """A session that routes (an unconnected Attention backend node) and runs no model: a String node."""
    from invokeai.app.services.shared.graph import Graph

    return Graph.model_validate({"nodes": {
        "attn": {**_attention(), "id": "attn"},
        "text": {"type": "string", "id": "text", "value": f"session {n}", "use_cache": False}}, "edges": []})


def test_a_session_keeps_its_recording_however_many_sessions_start_meanwhile(host):
    """While one session's denoise has run and its decode and report have not, 40 other sessions start and end
    (another GPU's queue): the open session's report and image still have the denoiser's calls. Ended sessions
    are let go of once a new one starts."""
    from invokeai.app.services.session_processor.session_processor_default import DefaultSessionRunner

    others = []

    def after_node(invocation, queue_item, output):
        if invocation.get_type() == "denoise_latents" and not others:
            others.extend(host.run_graph(_small_routed_graph(n)) for n in range(40))

    item = host.run_graph(_with_nodes(txt2img_graph(seed=45), _attention()),
                          runner=DefaultSessionRunner(on_after_run_node_callbacks=[after_node]))
    assert item.status == "completed", item.error_traceback
    assert len(others) == 40 and all(o.status == "completed" for o in others)
    session = sessions._sessions[item.session_id]
    assert session.recording.total("unet") > 0 and session.recording.total("vae") == 1
    assert host.output(item, "report").report.startswith("UNet: sdpa")
    metadata = host.images.get_metadata(host.output(item, "l2i").image.image_name).root["attention"]
    assert {c["role"] for c in metadata["calls"]} == {"unet", "vae"}
    assert len(sessions._sessions) <= 2  # the 39 others that ended before the last one started are gone
    last = host.run_graph(_small_routed_graph(41))
    assert set(sessions._sessions) == {last.session_id}  # every ended one let go of


def test_a_session_whose_queue_item_was_deleted_is_let_go_of(host):
    first = host.run_graph(_small_routed_graph(0))
    host.session_queue.items[first.item_id].status = "in_progress"  # as if it still ran ...
    host.session_queue.delete_queue_item(first.item_id)  # ... when the queue was cleared
    second = host.run_graph(_small_routed_graph(1))
    assert first.session_id not in sessions._sessions and second.session_id in sessions._sessions


# --- the nodes' versions, and two Attention backend nodes for the whole graph ----------------------------------

#: The Attention backend node's inputs in each version: adding one without a new version fails here.
BACKEND_INPUTS = {
    "1.0.0": {"unet", "transformer", "wan_transformer", "vae", "backend", "chain", "vae_chain", "guard", "schedule",
              "strict", "fp32", "tune"},
    "1.1.0": {"unet", "transformer", "wan_transformer", "vae", "backend", "chain", "vae_chain", "guard", "schedule",
              "sparse", "strict", "fp32", "tune"},
}


def test_a_new_input_comes_with_a_new_minor_version(pack):
    """InvokeAI's editor offers "Update Node" for a saved node whose version is below the node's, same major."""
    cls = pack.AttentionBackendInvocation
    version = cls.UIConfig.version
    inputs = set(cls.model_fields) - {"id", "type", "is_intermediate", "use_cache"}
    assert inputs == BACKEND_INPUTS[version], "an input was added or removed: add a version to BACKEND_INPUTS"
    newest = max(BACKEND_INPUTS, key=lambda v: tuple(map(int, v.split("."))))
    assert version == newest
    for older in BACKEND_INPUTS:
        if older != version:
            assert older.split(".")[0] == version.split(".")[0]  # an update, not a break
    # A node saved before ``sparse`` existed runs with its default.
    typed = {"backend": "sdpa-math", "chain": "", "vae_chain": "", "guard": "on", "schedule": "", "strict": False,
             "fp32": "auto", "tune": "auto"}
    assert set(typed) < BACKEND_INPUTS["1.0.0"]
    assert _validated({**_attention(), **typed}).sparse == ""


def test_two_attention_backend_nodes_connected_to_nothing_are_refused(host):
    graph = txt2img_graph(seed=46)
    graph.add_node(_validated(_attention("attn_a", backend="sdpa-math")))
    graph.add_node(_validated(_attention("attn_b")))
    item = host.run_graph(graph)
    assert item.status == "failed"
    assert "Attention backend nodes attn_a, attn_b are each connected to nothing" in item.error_message
    assert not host.images.saved  # refused before anything ran
