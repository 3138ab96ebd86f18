"""The Attention report node in ComfyUI's own page, as a user meets it (headless Chromium + selenium).

Needs a running ComfyUI with this repository in ``custom_nodes/`` and a checkpoint named in the
workflow, Chromium and chromedriver (Debian: ``apt-get install chromium chromium-driver``) and
``pip install selenium`` in the Python that runs this. It opens ``docs/comfyui-workflow.json`` with
the page's Open dialog, makes the graph small enough for a CPU (64x64, 2 steps, fixed seed), runs it,
runs it again, reloads the page, adds a second report node on the (cached) decoded images and runs
it, then types an unknown id into a chain; it saves a screenshot after each step. Last, through the
API, it has ComfyUI's cache drop the report node's entry and runs the graph again, so that the report
node runs on cached images. It prints what it saw as JSON.

    python tools/comfyui_browser_check.py --url http://127.0.0.1:8188 --output-dir COMFY/output --shots DIR
"""
from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
WORKFLOW = os.path.join(os.path.dirname(HERE), "docs", "comfyui-workflow.json")
APP = "window.comfyAPI.app.app"


def browser(width=1600, height=1000):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={width},{height}"):
        options.add_argument(arg)
    options.binary_location = os.environ.get("CHROMIUM", "/usr/bin/chromium")
    return webdriver.Chrome(service=Service(os.environ.get("CHROMEDRIVER", "/usr/bin/chromedriver")), options=options)


def wait_for(driver, script, timeout=120, what="the page"):
    end = time.time() + timeout
    while time.time() < end:
        value = driver.execute_script(script)
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(f"waited {timeout} s for {what}")


def history(url):
    with urllib.request.urlopen(f"{url}/history") as response:
        return json.load(response)


def report_node_state(driver):
    """What the report node shows and what the page would send for it."""
    return driver.execute_async_script(f"""
        const done = arguments[arguments.length - 1];
        const app = {APP};
        const node = app.graph._nodes.find((n) => n.type === "FlashAttentionReport");
        const widget = node.widgets?.find((w) => w.name === "readout");
        app.graphToPrompt().then(({{output, workflow}}) => done({{
            id: node.id, title: node.title, size: node.size,
            shown: widget?.element?.value ?? null, readOnly: widget?.element?.readOnly ?? null,
            tag: widget?.element?.tagName ?? null,
            scroll: widget ? [widget.element.scrollHeight, widget.element.clientHeight,
                              widget.element.scrollWidth, widget.element.clientWidth] : null,
            sent: output[String(node.id)].inputs,
            saved: workflow.nodes.find((n) => n.id === node.id).widgets_values ?? null,
        }}));
    """)


def focus(driver, node_type):
    driver.execute_script(f"""
        const app = {APP};
        const node = app.graph._nodes.find((n) => n.type === arguments[0]);
        app.canvas.ds.scale = 1;
        app.canvas.ds.offset = [120 - node.pos[0], 200 - node.pos[1]];
        app.canvas.setDirty(true, true);
    """, node_type)
    time.sleep(1)


def queue(driver, url, before):
    driver.execute_script(f"{APP}.queuePrompt(0, 1)")
    return wait_for(driver, f"""
        return fetch("/history").then((r) => r.json()).then((h) => {{
            const ids = Object.keys(h).filter((id) => !{json.dumps(list(before))}.includes(id));
            return ids.length && h[ids[ids.length - 1]].status?.completed ? ids[ids.length - 1] : null;
        }});""", 900, "the run to finish")


def post_and_wait(url, prompt):
    request = urllib.request.Request(f"{url}/prompt", data=json.dumps({"prompt": prompt}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as response:
        prompt_id = json.load(response)["prompt_id"]
    while True:
        with urllib.request.urlopen(f"{url}/history/{prompt_id}") as response:
            entry = json.load(response).get(prompt_id)
        if entry and entry["status"].get("completed") is not None:
            return entry
        time.sleep(0.5)


def evicted(url, workflow_path, seed=7):
    """Through the API: the graph, then another graph without the report node (ComfyUI's cache then
    drops the report node's entry and keeps the rest), then the graph again: the report node runs on
    images from the cache."""
    with open(workflow_path) as f:
        graph = json.load(f)
    graph["6"]["inputs"].update(width=64, height=64)
    graph["7"]["inputs"].update(steps=2, seed=seed)
    first = post_and_wait(url, graph)
    other = {k: v for k, v in graph.items() if v["class_type"] not in ("FlashAttentionReport", "SaveImage")}
    other["99"] = {"class_type": "PreviewImage", "inputs": {"images": ["8", 0]}}
    post_and_wait(url, other)
    again = post_and_wait(url, graph)
    report = next(k for k, v in graph.items() if v["class_type"] == "FlashAttentionReport")
    return {"first": first["outputs"][report]["text"], "again": again["outputs"][report]["text"],
            "cached": next((m[1]["nodes"] for m in again["status"]["messages"] if m[0] == "execution_cached"), None)}


def images(folder):
    return sorted(f for f in os.listdir(folder) if f.endswith(".png"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8188")
    parser.add_argument("--output-dir", required=True, help="ComfyUI's output folder (to count saved images)")
    parser.add_argument("--shots", required=True, help="where the screenshots go")
    parser.add_argument("--workflow", default=WORKFLOW)
    args = parser.parse_args(argv)
    os.makedirs(args.shots, exist_ok=True)
    seen = {}
    driver = browser()
    try:
        driver.get(args.url)
        wait_for(driver, f"return !!({APP}?.graph && {APP}.canvas)", what="ComfyUI's page")
        time.sleep(3)
        from selenium.webdriver.common.by import By
        from selenium.webdriver.common.keys import Keys
        driver.find_element(By.TAG_NAME, "body").send_keys(Keys.ESCAPE)  # the templates shown on a first visit
        time.sleep(1)
        # The Open dialog's file input, as a user picking the file.
        driver.find_element(By.CSS_SELECTOR, "input[type=file]").send_keys(os.path.abspath(args.workflow))
        wait_for(driver, f"return {APP}.graph._nodes.some((n) => n.type === 'FlashAttentionReport')",
                 what="the workflow to load")
        seen["fresh"] = report_node_state(driver)
        focus(driver, "FlashAttentionReport")
        driver.save_screenshot(os.path.join(args.shots, "0-loaded.png"))
        driver.execute_script(f"""
            const app = {APP};
            const set = (type, name, value) => {{
                const node = app.graph._nodes.find((n) => n.type === type);
                node.widgets.find((w) => w.name === name).value = value;
            }};
            set("EmptyLatentImage", "width", 64); set("EmptyLatentImage", "height", 64);
            set("KSampler", "steps", 2); set("KSampler", "control_after_generate", "fixed");
            set("FlashAttentionBackend", "chain", "flash-attn, sdpa-cudnn");
        """)
        known = set(history(args.url))
        before = images(args.output_dir)
        first = queue(driver, args.url, known)
        time.sleep(2)
        seen["run"] = report_node_state(driver)
        seen["run"]["new_images"] = len(images(args.output_dir)) - len(before)
        focus(driver, "FlashAttentionReport")
        driver.save_screenshot(os.path.join(args.shots, "1-after-run.png"))

        before = images(args.output_dir)
        second = queue(driver, args.url, known | {first})
        time.sleep(2)
        entry = history(args.url)[second]
        seen["rerun"] = report_node_state(driver)
        seen["rerun"]["new_images"] = len(images(args.output_dir)) - len(before)
        seen["rerun"]["cached"] = next((m[1]["nodes"] for m in entry["status"]["messages"]
                                        if m[0] == "execution_cached"), None)
        focus(driver, "FlashAttentionReport")
        driver.save_screenshot(os.path.join(args.shots, "2-after-rerun.png"))

        driver.refresh()
        wait_for(driver, f"return {APP}.graph?._nodes?.some((n) => n.type === 'FlashAttentionReport')",
                 what="the page to come back")
        wait_for(driver, f"""return {APP}.graph._nodes.find((n) => n.type === 'FlashAttentionReport')
                             .widgets?.find((w) => w.name === 'readout')?.value""", 30, "the restored report")
        seen["reload"] = report_node_state(driver)
        focus(driver, "FlashAttentionReport")
        driver.save_screenshot(os.path.join(args.shots, "3-after-reload.png"))

        # A second report node on the decoded images: it runs, its upstream comes from the cache.
        driver.execute_script(f"""
            const app = {APP};
            const decode = app.graph._nodes.find((n) => n.type === "VAEDecode");
            const first = app.graph._nodes.find((n) => n.type === "FlashAttentionReport");
            const added = window.LiteGraph.createNode("FlashAttentionReport");
            added.pos = [first.pos[0], first.pos[1] + 260];
            app.graph.add(added);
            decode.connect(0, added, 0);
        """)
        known |= {first, second}
        before = images(args.output_dir)
        third = queue(driver, args.url, known)
        known.add(third)
        time.sleep(2)
        entry = history(args.url)[third]
        added = driver.execute_script(f"""
            const nodes = {APP}.graph._nodes.filter((n) => n.type === "FlashAttentionReport");
            return {{id: nodes[1].id, shown: nodes[1].widgets.find((w) => w.name === "readout").value}};""")
        seen["cached_upstream"] = dict(added, new_images=len(images(args.output_dir)) - len(before),
                                       cached=next((m[1]["nodes"] for m in entry["status"]["messages"]
                                                    if m[0] == "execution_cached"), None))
        driver.execute_script(f"{APP}.canvas.ds.offset[1] -= 200; {APP}.canvas.setDirty(true, true);")
        time.sleep(1)
        driver.save_screenshot(os.path.join(args.shots, "4-second-report-on-cached-images.png"))

        focus(driver, "FlashAttentionBackend")
        seen["labels"] = driver.execute_script(f"""
            const node = {APP}.graph._nodes.find((n) => n.type === 'FlashAttentionBackend');
            const w = node.widgets.find((w) => w.name === 'backend');
            w.value = 'flash-attn'; node.setDirtyCanvas(true, true);
            return {{value: w.value, options: w.options.values.map((v) => w.options.getOptionLabel?.(v) ?? v)}};
        """)
        time.sleep(1)
        driver.save_screenshot(os.path.join(args.shots, "5-backend-labels.png"))

        driver.execute_script(f"""
            const node = {APP}.graph._nodes.find((n) => n.type === 'FlashAttentionBackend');
            node.widgets.find((w) => w.name === 'chain').value = 'sdpa, flahs-attn';
        """)
        seen["bad_id"] = driver.execute_async_script(f"""
            const done = arguments[arguments.length - 1];
            const app = {APP};
            app.graphToPrompt().then(({{output}}) => fetch("/prompt", {{method: "POST",
                body: JSON.stringify({{prompt: output}})}})).then((r) => r.json()).then(done);
        """)
        driver.execute_script(f"{APP}.queuePrompt(0, 1)")
        time.sleep(4)
        driver.save_screenshot(os.path.join(args.shots, "6-bad-id.png"))
    finally:
        driver.quit()
    seen["evicted"] = evicted(args.url, args.workflow)
    print(json.dumps(seen, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
