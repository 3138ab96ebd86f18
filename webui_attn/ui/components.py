"""Gradio parts: the txt2img/img2img accordion, the readout and the availability table.

Works with gradio 3.41 (A1111) and 4.x (Forge): only arguments both versions take are used, and
(label, value) dropdown pairs only where gradio has them (4.x). gradio is imported inside the
builders, so the HTML renderers can be used (and tested) without it.
"""
from __future__ import annotations

import html
import json

from lib_attn.config import GUARD_MODES
from lib_attn.schedule import EXAMPLE as SCHEDULE_EXAMPLE
from lib_attn.sparse import EXAMPLE as SPARSE_EXAMPLE

from lib_attn.readout import guard_lines, sparse_lines
from host_attn.status import WEBUI_INSTALL_HINT, unavailable_text

from ..settings.choices import USE_SETTING, override_choices
from . import api
from .readout import elapsed_text, last_report as last_generation, schedule_text, vram_text

ROLE_LABELS = {"unet": "UNet", "dit": "DiT", "vae": "VAE", "text": "Text encoder"}
ELEM_PREFIX = "flash_attn"


def gradio_major() -> int:
    import gradio as gr

    try:
        return int(str(gr.__version__).split(".")[0])
    except ValueError:
        return 3


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def report_html(report) -> str:
    """The readout of one generation as HTML (a table per backend, fallbacks, the calls per schedule rule,
    time and VRAM)."""
    if report is None:
        return "<div class='flash-attn-readout flash-attn-empty'>No generation yet.</div>"
    rows = []
    for role in report.roles():
        for backend, n in report.backends(role):
            rows.append(f"<tr><td class='flash-attn-role'>{_e(ROLE_LABELS.get(role, role))}</td>"
                        f"<td class='flash-attn-kernel'>{_e(report.describe(backend))}</td>"
                        f"<td class='flash-attn-count'>×{n:,}</td></tr>")
    if not rows:
        ran = f"{report.ran_on}, not through this extension." if report.ran_on else "No attention call ran."
        rows.append(f"<tr><td colspan='3' class='flash-attn-elsewhere'>{_e(ran)}</td></tr>")
    parts = ["<div class='flash-attn-readout'>",
             "<table class='flash-attn-calls'><thead><tr><th>Role</th><th>Kernel</th><th>Calls</th></tr></thead>",
             "<tbody>" + "".join(rows) + "</tbody></table>"]
    if report.fallbacks:
        items = "".join(
            f"<li><span class='flash-attn-role'>{_e(ROLE_LABELS.get(role, role))}</span> "
            f"<code>{_e(backend)}</code> passed over ×{n:,}: {_e(reason)}</li>"
            for (role, backend, reason), n in report.fallback_items())
        parts.append(f"<ul class='flash-attn-fallbacks'>{items}</ul>")
    if report.rules:
        parts.append(f"<p class='flash-attn-schedule'>Schedule: {_e(schedule_text(report))}</p>")
    sparse = sparse_lines(report)
    if sparse:
        parts.append("<ul class='flash-attn-sparse'>" + "".join(f"<li>{_e(line)}</li>" for line in sparse) + "</ul>")
    guard = guard_lines(report)
    if guard:
        parts.append("<ul class='flash-attn-guard'>" + "".join(f"<li>{_e(line)}</li>" for line in guard) + "</ul>")
    notes = [*report.notes, *([report.hint] if report.hint else [])]
    if notes:
        parts.append("<ul class='flash-attn-notes'>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>")
    facts = []
    if report.seconds is not None:
        facts.append(f"<span>Time: {_e(elapsed_text(report.seconds))}</span>")
    if report.vram is not None:
        facts.append(f"<span class='flash-attn-vram'>{_e(vram_text(report.vram))}</span>")
    if facts:
        parts.append("<p class='flash-attn-facts'>" + " · ".join(facts) + "</p>")
    parts.append("</div>")
    return "".join(parts)


def availability_html(data: dict | None = None) -> str:
    """The Settings table: device, torch, each backend with its version or why it cannot run here."""
    if data is None:
        data = api.availability()
    dev = data["device"]
    device = _e(dev["name"] or dev["type"])
    if dev.get("platform") == "rocm":
        from lib_attn.device import miopen_text

        device += f" ({_e(dev['arch'] or 'gfx?')}, ROCm: HIP {_e(dev['hip'] or '?')}, MIOpen {_e(miopen_text(dev['miopen']))})"
    elif dev["capability"]:
        device += f" (compute capability {_e(dev['capability'])})"
    if dev["total_memory_bytes"]:
        device += f", {dev['total_memory_bytes'] / 2**30:.1f} GiB"
    rows = []
    for b in data["backends"]:
        kind = "available" if b["available"] else "unavailable"
        mark = "✓" if b["available"] else "✗"
        detail = _e(b["version"] or "") if b["available"] else _e(b["reason"] or "")
        rows.append(f"<tr class='flash-attn-{kind}'><td><code>{_e(b['id'])}</code></td>"
                    f"<td class='flash-attn-state' title='{kind}'>{mark}</td><td>{_e(b['label'])}</td>"
                    f"<td>{detail}</td></tr>")
    ignored = "".join(f"<li>{_e(m)}</li>" for m in data.get("ignored_settings") or ())
    if ignored:
        ignored = f"<p>Ignored:</p><ul class='flash-attn-ignored'>{ignored}</ul>"
    def chain_list(chains: dict) -> str:
        return "".join(f"<li>{_e(ROLE_LABELS.get(role, role))}: {' → '.join(_e(i) for i in chain)}</li>"
                       for role, chain in chains.items())

    in_force = data.get("chains")
    if in_force and in_force != data["default_chains"]:
        in_force = ("<p>Order in force (flags, the host's own flags and settings):</p>"
                    f"<ul class='flash-attn-chains'>{chain_list(in_force)}</ul>")
    else:
        in_force = ""
    return ("<div class='flash-attn-availability'>"
            f"<p>Device: {device} · torch {_e(data['torch'])}</p>"
            "<table><thead><tr><th>Backend</th><th></th><th>What</th><th>Version, or why not</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>"
            f"<p>Default order on this device (Auto):</p>"
            f"<ul class='flash-attn-chains'>{chain_list(data['default_chains'])}</ul>"
            f"{in_force}{ignored}</div>")


def _host_options():
    try:
        from modules import options
    except ImportError:
        return None
    return options


def availability_option(shared):
    """A settings entry that shows the availability table and is never saved to config.json."""
    import gradio as gr

    text = availability_html()
    option_html = getattr(shared, "OptionHTML", None) or getattr(_host_options(), "OptionHTML", None)
    if option_html is not None:
        return option_html(text)
    info = shared.OptionInfo(text, "", lambda **kwargs: gr.HTML(**{**kwargs, "value": text}))
    info.do_not_save = True
    return info


def accordion(is_img2img: bool, last_report=None, open: bool = False, refresh: bool = True) -> dict:
    """Build the accordion inside the current ``gr.Blocks``; returns its components by name.

    ``override``: the per-generation backend dropdown (the script's first argument); ``guard``: the
    per-generation guard mode (its second); ``schedule``: the per-generation schedule text (its third:
    empty for the setting's, ``off`` for none); ``sparse``: the per-generation sparse settings (its fourth,
    likewise); ``readout``:
    the HTML of the last generation; ``refresh``: the button that reloads it from ``last_report()``, only
    when asked for (a host without a hook to ``follow``), else None. ``last_report``: where the report
    comes from (``readout.last_report`` when None).
    """
    import gradio as gr

    last_report = last_report or last_generation
    tab = "img2img" if is_img2img else "txt2img"
    with gr.Accordion("Attention backend", open=open, elem_id=f"{ELEM_PREFIX}_{tab}"):
        with gr.Row(elem_classes=["flash-attn-row"]):
            override = gr.Dropdown(
                label="Backend for this generation (UNet / DiT)",
                choices=override_choices(pairs=gradio_major() >= 4),
                value=USE_SETTING,
                elem_id=f"{ELEM_PREFIX}_{tab}_override",
                info=unavailable_text(WEBUI_INSTALL_HINT),
            )
            guard = gr.Dropdown(
                label="Guard for this generation",
                choices=[USE_SETTING, *GUARD_MODES],
                value=USE_SETTING,
                elem_id=f"{ELEM_PREFIX}_{tab}_guard",
                info="full: check every attention call's output (slower), to find what makes a black image",
            )
        schedule = gr.Textbox(
            label="Schedule for this generation",
            value="",
            placeholder=SCHEDULE_EXAMPLE,
            elem_id=f"{ELEM_PREFIX}_{tab}_schedule",
            info="Which backends serve which steps, blocks and roles, e.g. "
                 f"'{SCHEDULE_EXAMPLE}'. Empty: the setting's; off: none for this generation.",
        )
        sparse = gr.Textbox(
            label="Sparse attention for this generation",
            value="",
            placeholder=SPARSE_EXAMPLE,
            elem_id=f"{ELEM_PREFIX}_{tab}_sparse",
            info="Long self-attention calls sparse, within an error budget, e.g. "
                 f"'{SPARSE_EXAMPLE}'. Empty: the setting's; off: none for this generation.",
        )
        button = None
        if refresh:
            with gr.Row(elem_classes=["flash-attn-row"]):
                button = gr.Button("Show last readout", elem_id=f"{ELEM_PREFIX}_{tab}_refresh",
                                   elem_classes=["flash-attn-refresh"])
        readout = gr.HTML(value=report_html(last_report()), elem_id=f"{ELEM_PREFIX}_{tab}_readout")
    if button is not None:
        button.click(fn=lambda: report_html(last_report()), inputs=[], outputs=[readout], show_progress="hidden")
    return {"override": override, "guard": guard, "schedule": schedule, "sparse": sparse, "readout": readout,
            "refresh": button}


#: Browser side of ``follow``: passes the trigger's text on to the server only when it differs from the
#: last text this page passed on for the same readout; otherwise it returns a promise that never settles,
#: which is how gradio (3.41 and 4.x alike) skips the server call. gradio 4 fires an HTML component's
#: ``change`` on every re-render, and each server call re-renders the page, so without this the readout
#: would ask the server again and again on an idle page.
FOLLOW_JS = """(text) => {
  const seen = (window.flashAttnSeen = window.flashAttnSeen || {});
  if (seen[%s] === text) return new Promise(() => {});
  seen[%s] = text;
  return text;
}"""


def follow(trigger, readout, last_report=None) -> None:
    """Redraw ``readout`` from ``last_report()`` whenever the text of ``trigger`` (a component the webui
    updates at the end of each generation) changes; call inside the Blocks that holds both."""
    last_report = last_report or last_generation
    key = json.dumps(readout.elem_id)
    js = {"js" if gradio_major() >= 4 else "_js": FOLLOW_JS % (key, key)}
    trigger.change(fn=lambda _text: report_html(last_report()), inputs=[trigger], outputs=[readout],
                   show_progress="hidden", **js)
