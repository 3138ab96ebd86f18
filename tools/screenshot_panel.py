"""Serve the extension's accordion with a filled readout on localhost and screenshot it headless.

    python tools/screenshot_panel.py                       # out/panel.png (light) and out/panel-dark.png
    python tools/screenshot_panel.py --report report.json  # a report saved from GET /flash-attention/v1/status
    python tools/screenshot_panel.py --serve               # keep serving at http://127.0.0.1:7871 to look

Without ``--report`` the readout comes from a short run of the real engine on this machine (UNet
calls on the default chain, VAE calls that ask for flash-attn and fall back); on a CPU it has no VRAM
part. Needs gradio and a Chromium (Debian: ``apt-get install chromium``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import lib_attn  # noqa: E402
from lib_attn.report import Report  # noqa: E402
from webui_attn.ui import components, readout  # noqa: E402

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars"]


def engine_report(unet_calls: int = 120, vae_calls: int = 2) -> Report:
    """A report from real engine calls on this machine, shaped like SD1.5 at a small size."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    q = torch.randn(2, 8, 256, 40, device=device, dtype=dtype)
    vq = torch.randn(1, 1, 256, 512, device=device, dtype=dtype)
    with lib_attn.recording() as rec:
        for _ in range(unet_calls):
            lib_attn.attention(q, q, q, role="unet")
        for _ in range(vae_calls):
            lib_attn.attention(vq, vq, vq, role="vae", backend="flash-attn")
    return Report.from_recording(rec)


def build(report: Report):
    import gradio as gr

    with open(os.path.join(ROOT, "style.css"), encoding="utf-8") as f:
        css = f.read()
    # system fonts: the page must render without reaching any font server
    theme = gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                              font_mono=["ui-monospace", "monospace"])
    with gr.Blocks(css=css, theme=theme, title="flash-attention panel") as demo:
        gr.Markdown("### txt2img · Attention backend accordion")
        components.accordion(False, lambda: report, open=True)
        gr.Markdown("### Under the image (the readout lines, next to the webui's own timing line)")
        lines = "".join(f"{components._e(line)}<br>" for line in readout.lines(report))
        gr.HTML(f"<p class='comments'>{lines}</p>")
        gr.Markdown("### Settings › Optimizations · availability table")
        gr.HTML(components.availability_html())
    return demo


def screenshot(url: str, path: str, width: int, height: int) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        raise SystemExit("no Chromium found: apt-get install chromium")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    cmd = [browser, *CHROMIUM_FLAGS, f"--window-size={width},{height}", "--virtual-time-budget=8000",
           f"--screenshot={os.path.abspath(path)}", url]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    print(f"wrote {path}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", help="JSON of a report (the last_report part of the status route, or the whole answer)")
    parser.add_argument("--out", default=os.path.join(ROOT, "out", "panel.png"))
    parser.add_argument("--theme", choices=("light", "dark", "both"), default="both")
    parser.add_argument("--port", type=int, default=7871)
    parser.add_argument("--size", default="1000x1400", help="window WIDTHxHEIGHT")
    parser.add_argument("--serve", action="store_true", help="keep serving after the screenshots")
    args = parser.parse_args(argv)

    if args.report:
        with open(args.report, encoding="utf-8") as f:
            data = json.load(f)
        report = Report.from_dict(data.get("last_report") or data)
    else:
        report = engine_report()
    print(readout.text(report))

    demo = build(report)
    demo.launch(server_name="127.0.0.1", server_port=args.port, prevent_thread_lock=True, show_api=False)
    url = f"http://127.0.0.1:{args.port}/"
    width, height = (int(x) for x in args.size.lower().split("x"))
    try:
        time.sleep(1.0)
        themes = ("light", "dark") if args.theme == "both" else (args.theme,)
        for theme in themes:
            root, ext = os.path.splitext(args.out)
            path = args.out if theme == "light" else f"{root}-dark{ext}"
            screenshot(f"{url}?__theme={theme}", path, width, height)
        if args.serve:
            print(f"serving at {url} (Ctrl+C to stop)")
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        demo.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
