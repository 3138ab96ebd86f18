"""What cannot run here, in words a user reads: grouped by cause, each package's family once, each group with
what to do; the whole per-id reasons stay in ``doctor``, the status route and the availability table."""
from __future__ import annotations

import re

import pytest

import lib_attn
from host_attn import status
from lib_attn.kernels import REGISTRY

NO_SAGE = "ModuleNotFoundError: No module named 'sageattention'; hub: the kernels package is not installed (pip install kernels)"


def info(bid, reason=""):
    return lib_attn.BackendInfo(bid, bid, not reason, reason, "", tuple(REGISTRY[bid].packages))


def listed_ids(text: str) -> list[str]:
    """Every backend id the text names, as often as it names it."""
    ids = sorted(lib_attn.BACKEND_IDS, key=len, reverse=True)
    return re.findall(r"(?<![\w-])(" + "|".join(map(re.escape, ids)) + r")(?![\w-])", text)


def test_on_this_machine_the_line_is_short_and_names_every_missing_id_once():
    infos = lib_attn.backends()
    missing = [b.id for b in infos if not b.available and b.id not in status.SITUATIONAL]
    text = status.unavailable_text(status.WEBUI_INSTALL_HINT)
    assert len(text) <= 300, text
    assert sorted(listed_ids(text)) == sorted(missing)
    assert "Error" not in text and "No module named" not in text       # no exception names for users
    device = lib_attn.device_info().type
    for words, names in status.unavailable_groups():
        assert words in text
        if words == "not installed":
            assert f"{words}: {', '.join(names)} — {status.WEBUI_INSTALL_HINT}" in text
    if device == "cpu" and missing:
        assert text.startswith("Not available here: need an NVIDIA or AMD GPU: ")
        assert "SageAttention (sage, sage-triton, sage-cuda, sage-fp8, sage-fp8pp)" in text


def test_a_gpu_machine_with_some_kernels_groups_only_what_is_missing():
    infos = [info("flash-attn"),                                          # installed and loads
             info("xformers", "OSError: libcudart.so.12: cannot open shared object file"),
             info("sdpa-cudnn", "cuDNN is not available in this torch build"),
             info("sdpa-efficient"),
             *(info(bid, NO_SAGE) for bid in ("sage", "sage-triton", "sage-cuda", "sage-fp8", "sage-fp8pp")),
             info("sage3", "ModuleNotFoundError: No module named 'sageattn3'"),
             info("ck-int8", "ModuleNotFoundError: No module named 'comfy_kitchen'"),
             info("flash-attn-4", "needs sm90 or newer: this GPU is sm86"),
             info("sdpa"), info("sdpa-host", "nothing replaced F.scaled_dot_product_attention here")]
    groups = status.unavailable_groups("cuda", infos)
    assert groups == [
        ("not installed", ["SageAttention (sage, sage-triton, sage-cuda, sage-fp8, sage-fp8pp)",
                           "SageAttention 3 (sage3)", "comfy-kitchen (ck-int8)"]),
        ("not in this torch build", ["sdpa-cudnn"]),
        ("installed but does not load (python -m lib_attn doctor says why)", ["xformers"]),
        ("needs sm90 or newer: this GPU is sm86", ["flash-attn-4"]),
    ]
    text = status.unavailable_text(status.INSTALL_HINT, "cuda", infos)
    assert "flash-attn," not in text and "sdpa-efficient" not in text and "sdpa-host" not in text
    assert f"comfy-kitchen (ck-int8) — {status.INSTALL_HINT}" in text
    assert sorted(listed_ids(text)) == sorted(["xformers", "sdpa-cudnn", "sage", "sage-triton", "sage-cuda", "sage-fp8",
                                               "sage-fp8pp", "sage3", "ck-int8", "flash-attn-4"])
    assert status.unavailable_text(status.INSTALL_HINT, "cuda", [info("sdpa"), info("flash-attn")]) == (
        "Every backend is available here.")


def test_labels_say_why_in_a_few_words():
    assert status.short_reason(info("xformers", "ModuleNotFoundError: No module named 'xformers'"), "cuda") == "not installed"
    assert status.short_reason(info("xformers", "ModuleNotFoundError: No module named 'xformers'"), "cpu") == "needs a GPU"
    assert status.short_reason(info("sdpa-cudnn", "cuDNN is not available in this torch build"), "cuda") == "not in this torch"
    assert status.short_reason(info("xformers", "ImportError: undefined symbol: _ZN3c10"), "cuda") == "does not load"


def test_doctor_and_the_status_route_keep_every_ids_whole_reason():
    from lib_attn.commands import doctor

    probes = {b.id: b.reason for b in lib_attn.backends()}
    rows = {row["id"]: row["reason"] for row in status.availability()["backends"]}
    assert rows == {bid: (reason or None) for bid, reason in probes.items()}
    text = doctor.render(doctor.report())
    for bid, reason in probes.items():
        if reason:
            assert reason in text


def test_the_webui_settings_and_accordion_show_the_grouped_line(webui_factory):
    pytest.importorskip("gradio")
    from tests.test_generation import start
    from webui_attn.settings.stored import KEY_BACKEND
    from webui_attn.ui import settings_page

    runner, demo, _ = start(webui_factory)
    line = status.unavailable_text(status.WEBUI_INSTALL_HINT)
    assert settings_page.INFO[KEY_BACKEND]().endswith(line)
    if lib_attn.device_info().type == "cpu":  # what Settings shows under the dropdown, as a whole
        assert len(settings_page.INFO[KEY_BACKEND]()) <= 300
    override = next(block for block in demo.blocks.values()
                    if getattr(block, "elem_id", "") == "flash_attn_txt2img_override")
    assert override.info == line


from tests.doubles.fixtures import webui_factory  # noqa: E402,F401
