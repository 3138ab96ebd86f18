// The Attention report node's readout: the lines its run returned ("text" in its ui output), and
// the reports the server sends as "flash-attention.report" when a routed sampling or VAE pass ends.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const NODE = "FlashAttentionReport";

function show(node, lines) {
    const text = Array.isArray(lines) ? lines.join("\n") : String(lines ?? "");
    let widget = node.widgets?.find((w) => w.name === "readout");
    if (!widget) {
        widget = node.addWidget("text", "readout", "", () => {}, { multiline: true });
        if (widget.inputEl) {
            widget.inputEl.readOnly = true;
            widget.inputEl.style.opacity = 0.85;
        }
    }
    widget.value = text;
    node.setDirtyCanvas?.(true, true);
}

app.registerExtension({
    name: "flash_attention.report",
    async beforeRegisterNodeDef(nodeType, nodeData) {
        if (nodeData.name !== NODE) return;
        const executed = nodeType.prototype.onExecuted;
        nodeType.prototype.onExecuted = function (message) {
            executed?.apply(this, arguments);
            if (message?.text) show(this, message.text);
        };
    },
    setup() {
        api.addEventListener("flash-attention.report", (event) => {
            const lines = event.detail?.text;
            for (const node of app.graph?._nodes ?? []) {
                if (node.type === NODE) show(node, lines);
            }
        });
    },
});
