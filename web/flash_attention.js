// The Attention report node's readout, the backend dropdowns' labels, and a backend node's refused values
// shown each on its own input.
//
// The readout is a DOM widget (a read-only textarea, as ComfyUI's own "Preview as Text" node shows
// text) that is never serialised: neither into the prompt, where it would become an input of the
// node and change its cache key, nor into the saved workflow. It shows the lines the node's run
// returned ("text" in its ui output), the reports the server sends as "flash-attention.report"
// while a routed sampling or VAE pass ends, and after a page reload the node's last output in
// ComfyUI's history. A report message names its prompt: the page shows only those of the prompts it
// queued itself (two tabs can share a client id, and a report of another tab's, user's or script's
// prompt must not overwrite what this page's node says), and only while the workflow that queued the
// prompt is the open one (the page keeps several workflows open in one graph; going back to that
// workflow brings its report back from the history). A workflow is known by its id; one without an id
// (the frontend's zero id) is known only while it stays open, and gets nothing from the history, so it
// never shows another workflow's report. Report nodes inside subgraphs are reached too: their id in a
// prompt and in the history is the path of node ids from the root graph, joined by ":".
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const REPORT_NODE = "FlashAttentionReport";
const BACKEND_NODES = ["FlashAttentionBackend", "FlashAttentionVAEBackend"];
const READOUT = "readout";
const STATUS_ROUTE = "/flash-attention/v1/status";
const LINE_HEIGHT = 16;   // px per line of the readout's monospace text
const CHAR_WIDTH = 7.2;   // px per character of it
const MAX_WIDTH = 640;    // px: longer lines wrap instead of widening the node over its neighbours
const MIN_WIDTH = 320;    // px: room for the title and one short line
const NO_ID = "00000000-0000-0000-0000-000000000000";   // the frontend's id of a graph that has none
const DEPTH = 32;         // subgraphs inside subgraphs, at most

export function reportText(lines) {
    return Array.isArray(lines) ? lines.join("\n") : String(lines ?? "");
}

function readout(node) {
    let widget = node.widgets?.find((w) => w.name === READOUT);
    if (widget) return widget;
    const area = document.createElement("textarea");
    area.className = "comfy-multiline-input";
    area.readOnly = true;
    area.spellcheck = false;
    Object.assign(area.style, { whiteSpace: "pre-wrap", overflowWrap: "anywhere", overflow: "auto",
                                fontFamily: "monospace", fontSize: "12px", lineHeight: `${LINE_HEIGHT}px` });
    area.placeholder = "the attention report of the next run";
    widget = node.addDOMWidget(READOUT, "customtext", area, {
        getValue: () => area.value,
        setValue: (value) => { area.value = value; },
        getMinHeight: () => LINE_HEIGHT * Math.max(2, rows(area.value, node.size?.[0] ?? MIN_WIDTH)) + 12 + (widget.slack ?? 0),
        serialize: false,   // graphToPrompt leaves it out: the node's only input stays its image
    });
    widget.serialize = false;   // and the saved workflow keeps no copy of it
    widget.inputEl = area;
    widget.slack = 0;   // px the estimate fell short by, measured once the text is on the page
    widget.fit = () => {
        const short = area.scrollHeight - area.clientHeight;
        if (short > 0 && area.isConnected) {
            widget.slack += short;
            node.setSize?.([node.size[0], node.computeSize?.()[1] ?? node.size[1] + short]);
            node.setDirtyCanvas?.(true, true);
        }
    };
    return widget;
}

// Lines of monospace text ``text`` takes in a readout ``width`` px wide (long lines wrap).
export function rows(text, width) {
    const perRow = Math.max(20, Math.floor((width - 40) / CHAR_WIDTH));
    return String(text).split("\n").reduce((n, line) => n + Math.max(1, Math.ceil(line.length / perRow)), 0);
}

export function show(node, lines) {
    const widget = readout(node);
    widget.value = reportText(lines);
    const longest = Math.max(0, ...widget.value.split("\n").map((line) => line.length));
    const width = Math.min(MAX_WIDTH, Math.max(MIN_WIDTH, node.size?.[0] ?? 0, Math.ceil(longest * CHAR_WIDTH) + 40));
    widget.slack = 0;
    node.setSize?.([width, node.size?.[1] ?? 0]);
    node.setSize?.([width, node.computeSize?.()[1] ?? node.size?.[1]]);
    node.setDirtyCanvas?.(true, true);
    globalThis.requestAnimationFrame?.(() => globalThis.requestAnimationFrame(() => widget.fit()));
}

// Every report node of ``graph`` and of the subgraphs inside it, each with its id in a prompt
// ("outer:inner" for a node inside a subgraph node).
export function reportNodes(graph, prefix = "", depth = 0) {
    const found = [];
    for (const node of graph?._nodes ?? graph?.nodes ?? []) {
        const id = prefix ? `${prefix}:${node.id}` : String(node.id);
        if (node.type === REPORT_NODE) found.push([node, id]);
        if (node.subgraph && depth < DEPTH) found.push(...reportNodes(node.subgraph, id, depth + 1));
    }
    return found;
}

// The open workflow, as reports are matched to it: its id, or for a workflow without one, this
// opening of it (a number that changes each time a workflow is opened).
let opened = 0;
function workflowKey() {
    const id = app.graph?.id;
    return id && id !== NO_ID ? id : `unnamed-${opened}`;
}

// The newest history entry in which this node (same id, same class, same workflow) returned a report;
// nothing for a workflow without an id (the history cannot tell its prompts from another's).
export function lastOutput(history, node, workflowId, executionId = String(node.id)) {
    if (!workflowId || workflowId === NO_ID) return null;
    let found = null;
    for (const entry of Object.values(history ?? {})) {
        const [, , prompt, extra] = entry?.prompt ?? [];
        const text = entry?.outputs?.[executionId]?.text;
        if (!text || prompt?.[executionId]?.class_type !== REPORT_NODE) continue;
        if (extra?.extra_pnginfo?.workflow?.id !== workflowId) continue;
        found = text;   // history lists prompts oldest first
    }
    return found;
}

async function restore() {
    const nodes = reportNodes(app.graph);
    if (!nodes.length) return;
    try {
        const response = await api.fetchApi("/history?max_items=64");
        const history = await response.json();
        for (const [node, id] of nodes) {
            const text = lastOutput(history, node, app.graph?.id, id);
            if (text && !node.widgets?.find((w) => w.name === READOUT)?.value) show(node, text);
        }
    } catch (error) {
        console.warn("[flash-attention] could not read the last report from the history:", error);
    }
}

// The prompts this page queued, each with the id of the workflow (graph) that queued it, and the
// latest report of each prompt not yet known to be one of them (its first report can arrive before
// the answer to the page's own /prompt request).
const queued = new Map();
const early = new Map();
const QUEUED_KEPT = 4096;   // a long queue's prompts, oldest forgotten first
const EARLY_KEPT = 16;

function keep(map, key, value, kept) {
    map.delete(key);
    map.set(key, value);
    if (map.size > kept) map.delete(map.keys().next().value);
}

// The report nodes an unnamed workflow had when it queued a prompt: opening a workflow from an API-format
// file rebuilds the graph without the frontend's afterConfigureGraph, so the key alone cannot tell two
// unnamed workflows apart; their nodes can (a workflow opened is made of new nodes).
const queuedNodes = new Map();

function mayShowIn(node, id, graphId) {
    if (graphId !== workflowKey()) return false;   // another workflow's prompt: its report waits in the history
    const nodes = queuedNodes.get(id);
    return !nodes || nodes.has(node);
}

function showInReportNodes(lines, graphId, id) {
    for (const [node] of reportNodes(app.graph)) if (mayShowIn(node, id, graphId)) show(node, lines);
}

// A node's own output ("executed"): ComfyUI's page hands it to the node of that id in the workflow open
// now, whichever workflow queued the prompt, so it is shown by the same rule as a message, for the
// prompt ComfyUI runs now (its "execution_start" comes first). Without one seen (the page opened while
// the prompt ran), the node shows it as before.
let running = null;
const earlyOutputs = new Map();   // prompt id -> [[node, lines], ...] before the page knows it queued it

export function executionStarted(detail) {
    running = detail?.prompt_id ?? null;
}

export function onExecutedText(node, lines) {
    const id = running;
    if (id === null || id === undefined) {
        show(node, lines);
    } else if (queued.has(id)) {
        if (mayShowIn(node, id, queued.get(id))) show(node, lines);
    } else {
        keep(earlyOutputs, id, [...(earlyOutputs.get(id) ?? []), [node, lines]], EARLY_KEPT);
    }
}

export function onReport(detail) {
    const id = detail?.prompt_id;
    if (id === undefined || id === null) {
        showInReportNodes(detail?.text, workflowKey());
    } else if (queued.has(id)) {
        showInReportNodes(detail?.text, queued.get(id), id);
    } else {
        keep(early, id, detail?.text, EARLY_KEPT);
    }
}

export function promptQueued(id, graphId, nodes) {
    if (id === undefined || id === null) return;
    keep(queued, id, graphId, QUEUED_KEPT);
    if (nodes && String(graphId).startsWith("unnamed-")) keep(queuedNodes, id, nodes, QUEUED_KEPT);
    if (early.has(id)) {
        showInReportNodes(early.get(id), graphId, id);
        early.delete(id);
    }
    if (earlyOutputs.has(id)) {
        if (graphId === workflowKey()) {
            const present = new Set(reportNodes(app.graph).map(([node]) => node));
            for (const [node, lines] of earlyOutputs.get(id)) {
                if (present.has(node) && mayShowIn(node, id, graphId)) show(node, lines);
            }
        }
        earlyOutputs.delete(id);
    }
}

// ComfyUI reports a failed VALIDATE_INPUTS once on every input the check takes, each with the same text;
// the backend nodes' text has a line per bad value, starting with the name of the input that holds it
// ("chain: unknown backend id …", "schedule rule 2 (…): …"). Each input keeps the lines that name it, so
// a bad value is shown once, on its own input. ``nodeErrors``: the /prompt answer's node_errors, changed
// in place.
const CUSTOM_CHECK = "custom_validation_failed";

function ownLines(error) {
    const name = error?.extra_info?.input_name;
    const head = `${name} - `;
    const details = String(error?.details ?? "");
    if (!name || !details.startsWith(head)) return [error];
    const lines = details.slice(head.length).split("\n")
        .filter((line) => line.startsWith(`${name} `) || line.startsWith(`${name}: `))
        .map((line) => (line.startsWith(`${name}: `) ? line.slice(name.length + 2) : line));
    return lines.length ? [{ ...error, details: head + lines.join("\n") }] : [];
}

export function oneErrorPerValue(nodeErrors) {
    for (const entry of Object.values(nodeErrors ?? {})) {
        if (!BACKEND_NODES.includes(entry?.class_type) || !Array.isArray(entry.errors)) continue;
        const kept = entry.errors.flatMap((error) => (error?.type === CUSTOM_CHECK ? ownLines(error) : [error]));
        if (kept.length) entry.errors = kept;   // text of another form: left as ComfyUI sent it
    }
    return nodeErrors;
}

// api.queuePrompt answers with the prompt id ComfyUI gave the prompt this page queued; the workflow
// open when it was called is the one that queued it. A refused prompt's errors (the answer of a queue
// with some outputs refused, or the error thrown for a prompt refused whole) are put on their inputs
// before the page shows them.
function watchQueue() {
    const queue = api.queuePrompt;
    if (typeof queue !== "function" || queue.flashAttention) return;
    const watched = async function (...args) {
        const graphId = workflowKey();
        const nodes = new Set(reportNodes(app.graph).map(([node]) => node));
        let answer;
        try {
            answer = await queue.apply(this, args);
        } catch (error) {
            oneErrorPerValue(error?.response?.node_errors);
            throw error;
        }
        oneErrorPerValue(answer?.node_errors);
        promptQueued(answer?.prompt_id, graphId, nodes);
        return answer;
    };
    watched.flashAttention = true;
    api.queuePrompt = watched;
}

// The backends that cannot run here, each with a few words on why (the status route's short_reason).
let unavailable = null;
export function unavailableIds() {
    unavailable ??= api.fetchApi(STATUS_ROUTE)
        .then((response) => response.json())
        .then((status) => new Map(status.availability.backends.filter((b) => !b.available)
            .map((b) => [b.id, b.short_reason ?? "unavailable"])))
        .catch(() => new Map());
    return unavailable;
}

// A backend dropdown shows "id — why" for a backend that cannot run here (``flash-attn — needs a GPU``, the
// words of the webuis' lists); the value stays the id.
export async function labelBackends(node) {
    const widget = node.widgets?.find((w) => w.name === "backend");
    if (!widget) return;
    const missing = await unavailableIds();
    widget.options.getOptionLabel = (value) => (missing.has(value) ? `${value} — ${missing.get(value)}`
                                                                   : String(value ?? ""));
    node.setDirtyCanvas?.(true, true);
}

app.registerExtension({
    name: "flash_attention.report",
    async beforeRegisterNodeDef(nodeType, nodeData) {
        if (BACKEND_NODES.includes(nodeData.name)) {
            const created = nodeType.prototype.onNodeCreated;
            nodeType.prototype.onNodeCreated = function () {
                const result = created?.apply(this, arguments);
                labelBackends(this);
                return result;
            };
        }
        if (nodeData.name !== REPORT_NODE) return;
        const created = nodeType.prototype.onNodeCreated;
        nodeType.prototype.onNodeCreated = function () {
            const result = created?.apply(this, arguments);
            readout(this);
            this.setSize?.([Math.max(MIN_WIDTH, this.size?.[0] ?? 0), this.computeSize?.()[1] ?? this.size?.[1]]);
            return result;
        };
        const executed = nodeType.prototype.onExecuted;
        nodeType.prototype.onExecuted = function (message) {
            executed?.apply(this, arguments);
            if (message?.text) onExecutedText(this, message.text);
        };
    },
    // A workflow opened (also each tab switch, and after a page reload): its report nodes, subgraphs'
    // included, show their last output from the history.
    async afterConfigureGraph() {
        opened += 1;
        await restore();
    },
    setup() {
        watchQueue();
        api.addEventListener("flash-attention.report", (event) => onReport(event.detail));
        api.addEventListener("execution_start", (event) => executionStarted(event.detail));
    },
});
