// The web script against the frontend double (doubles/comfy_frontend): node tests/comfy_web_scenario.mjs ROOT INPUT.json
// ROOT holds scripts/ (the double) and extensions/<name>/flash_attention.js, as ComfyUI serves them.
// INPUT: {nodes: {type: nodeData}, lines: [...], later: [...], status: {...}, history: {...}}. Prints what it saw as JSON.
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";

const [root, inputPath] = process.argv.slice(2);
const input = JSON.parse(readFileSync(inputPath, "utf8"));
await import(pathToFileURL(`${root}/document.js`).href);
const { app } = await import(pathToFileURL(`${root}/scripts/app.js`).href);
const { api } = await import(pathToFileURL(`${root}/scripts/api.js`).href);
api.routes["/flash-attention/v1/status"] = input.status;
api.routes["/history"] = {};
await import(pathToFileURL(`${root}/extensions/sd-webui-flash-attention/flash_attention.js`).href);
await app.setup();

const seen = {};
const state = async (node) => {
    const widget = node.widgets.find((w) => w.name === "readout");
    const { output, workflow } = await app.graphToPrompt();
    return {
        shown: widget?.value ?? null, element: widget?.element?.value ?? null, tag: widget?.element?.tagName ?? null,
        readOnly: widget?.element?.readOnly ?? null, height: node.size[1], width: node.size[0],
        minHeight: widget?.computeLayoutSize(node).minHeight ?? null,
        sent: output[String(node.id)].inputs,
        saved: workflow.nodes.find((n) => n.id === node.id).widgets_values ?? null,
    };
};

const backend = await app.addNode(2, input.nodes.FlashAttentionBackend,
                                  { backend: "flash-attn", chain: "", strict: false, fp32: "auto", tune: "auto" });
const vae = await app.addNode(3, input.nodes.FlashAttentionVAEBackend,
                              { backend: "auto", chain: "", strict: false, fp32: "auto" });
const report = await app.addNode(9, input.nodes.FlashAttentionReport);
app.link(8, 0, report, "images");
await new Promise((resolve) => setTimeout(resolve, 0));   // the status fetch behind the labels

seen.created = await state(report);
const label = (node) => {
    const w = node.widgets.find((x) => x.name === "backend");
    return { value: w.value, labels: w.options.values.map((v) => w.options.getOptionLabel?.(v) ?? v) };
};
seen.labels = { backend: label(backend), vae: label(vae) };

app.executed(report, { text: input.lines });
seen.executed = await state(report);

api.message("flash-attention.report", { text: input.later });
seen.message = await state(report);

// Reports name their prompt: this page shows those of the prompts it queued only.
api.promptIds.push("mine-1", "mine-2");
await app.queuePrompt(0);
api.message("flash-attention.report", { text: ["another tab's prompt"], prompt_id: "theirs-1" });
seen.other_prompt = await state(report);
api.message("flash-attention.report", { text: ["this page's prompt"], prompt_id: "mine-1" });
seen.own_prompt = await state(report);
let answer;
api.answerGate = new Promise((resolve) => { answer = resolve; });
const queuing = app.queuePrompt(0);                   // its answer comes after the prompt's first report
await new Promise((resolve) => setTimeout(resolve, 0));
api.message("flash-attention.report", { text: ["early report"], prompt_id: "mine-2" });
seen.before_answer = await state(report);
answer();
await queuing;
seen.after_answer = await state(report);
api.message("flash-attention.report", { text: ["another tab's later prompt"], prompt_id: "theirs-2" });
seen.other_later = await state(report);
seen.queued = api.queued.length;

// Two workflow tabs: a prompt queued from workflow-1 reports while workflow-2 is open.
api.promptIds.push("mine-3", "mine-4");
await app.queuePrompt(0);                             // from workflow-1
app.openWorkflow("workflow-2");
const other = await app.addNode(9, input.nodes.FlashAttentionReport);
app.link(8, 0, other, "images");
await app.loaded();
api.message("flash-attention.report", { text: ["workflow-1's report"], prompt_id: "mine-3" });
seen.other_tab = await state(other);
await app.queuePrompt(0);                             // from workflow-2
api.message("flash-attention.report", { text: ["workflow-2's report"], prompt_id: "mine-4" });
seen.own_tab = await state(other);
api.message("flash-attention.report", { text: ["workflow-1's later report"], prompt_id: "mine-3" });
seen.own_tab_later = await state(other);
app.openWorkflow("workflow-1");

// A page reload: the same workflow, a fresh node, ComfyUI's history with this node's outputs.
app.graph._nodes = [];
api.routes["/history"] = input.history;
const again = await app.addNode(9, input.nodes.FlashAttentionReport);
app.link(8, 0, again, "images");
seen.reloaded_before = await state(again);
await app.loaded();
seen.reloaded = await state(again);
seen.fetched = api.fetched;

const shown = (node) => node.widgets.find((w) => w.name === "readout")?.value ?? null;

// A report node inside a subgraph node (id 5): its id in a prompt and in the history is "5:9".
app.openWorkflow("workflow-3");
const holder = app.addSubgraphNode(5);
const inner = await app.addNode(9, input.nodes.FlashAttentionReport, {}, holder.subgraph);
inner.inputs[0].link = ["8", 0];
api.routes["/history"] = input.subgraph_history;
await app.loaded();
seen.subgraph_restored = shown(inner);
api.promptIds.push("mine-5");
await app.queuePrompt(0);
seen.subgraph_prompt = Object.keys(api.queued.at(-1).prompt);
api.message("flash-attention.report", { text: ["the subgraph's report"], prompt_id: "mine-5" });
seen.subgraph_message = shown(inner);

// Two workflows without an id (the frontend's zero id): neither shows the other's report.
const NO_ID = "00000000-0000-0000-0000-000000000000";
app.openWorkflow(NO_ID);
const first = await app.addNode(9, input.nodes.FlashAttentionReport);
api.routes["/history"] = input.unnamed_history;
await app.loaded();
seen.unnamed_restored = shown(first);
api.promptIds.push("mine-6");
await app.queuePrompt(0);                             // from the first unnamed workflow
app.openWorkflow(NO_ID);
const second = await app.addNode(9, input.nodes.FlashAttentionReport);
await app.loaded();
api.message("flash-attention.report", { text: ["the first unnamed workflow's report"], prompt_id: "mine-6" });
seen.unnamed_other = shown(second);
api.promptIds.push("mine-7");
await app.queuePrompt(0);
api.message("flash-attention.report", { text: ["the second unnamed workflow's report"], prompt_id: "mine-7" });
seen.unnamed_own = shown(second);
// A node's own output ("executed"), which the page hands to the node of that id in the workflow open now:
// shown for this workflow's prompts only, by the prompt ComfyUI runs (its execution_start came first).
app.openWorkflow(NO_ID);
const third = await app.addNode(9, input.nodes.FlashAttentionReport);
await app.loaded();
api.promptIds.push("mine-8");
await app.queuePrompt(0);                             // from the third unnamed workflow
app.openWorkflow(NO_ID);
const fourth = await app.addNode(9, input.nodes.FlashAttentionReport);
await app.loaded();
api.message("execution_start", { prompt_id: "mine-8" });
app.executed(fourth, { text: ["the third unnamed workflow's output"] });
seen.output_other = shown(fourth);
api.promptIds.push("mine-9");
await app.queuePrompt(0);
api.message("execution_start", { prompt_id: "mine-9" });
app.executed(fourth, { text: ["the fourth unnamed workflow's output"] });
seen.output_own = shown(fourth);
api.promptIds.push("mine-10");                        // a prompt served from the cache: output before the answer
let cachedAnswer;
api.answerGate = new Promise((resolve) => { cachedAnswer = resolve; });
const cachedQueuing = app.queuePrompt(0);
await new Promise((resolve) => setTimeout(resolve, 0));
api.message("execution_start", { prompt_id: "mine-10" });
app.executed(fourth, { text: ["a cached prompt's output"] });
seen.output_before_answer = shown(fourth);
cachedAnswer();
await cachedQueuing;
seen.output_after_answer = shown(fourth);
api.message("execution_start", { prompt_id: "theirs-3" });
app.executed(fourth, { text: ["another tab's output"] });
seen.output_other_tab = shown(fourth);
// A workflow opened from an API-format file (the page's loadApiJson): the graph is rebuilt with new nodes
// and no afterConfigureGraph, so two unnamed workflows share one key.
app.openWorkflow(NO_ID);
const fifth = await app.addNode(9, input.nodes.FlashAttentionReport);
await app.loaded();
api.promptIds.push("mine-11");
await app.queuePrompt(0);                             // from the fifth unnamed workflow
app.openWorkflow(NO_ID);
const sixth = await app.addNode(9, input.nodes.FlashAttentionReport);   // no loaded()
api.message("execution_start", { prompt_id: "mine-11" });
api.message("flash-attention.report", { text: ["the fifth unnamed workflow's report"], prompt_id: "mine-11" });
seen.api_file_message = shown(sixth);
app.executed(sixth, { text: ["the fifth unnamed workflow's output"] });
seen.api_file_output = shown(sixth);
api.promptIds.push("mine-12");
await app.queuePrompt(0);
api.message("execution_start", { prompt_id: "mine-12" });
api.message("flash-attention.report", { text: ["the sixth unnamed workflow's report"], prompt_id: "mine-12" });
seen.api_file_own = shown(sixth);
// A refused prompt: ComfyUI's node_errors for a backend node's bad values, as its validation gives them.
seen.refused = {};
for (const [name, nodeErrors] of Object.entries(input.refusals ?? {})) {
    api.refusal = { error: { type: "prompt_outputs_failed_validation", message: "Prompt outputs failed validation",
                             details: "" }, node_errors: nodeErrors };
    api.promptIds.push(`refused-${name}`);
    await app.queuePrompt(0);
    seen.refused[name] = app.lastNodeErrors;
}
api.refusal = null;
console.log(JSON.stringify(seen));
