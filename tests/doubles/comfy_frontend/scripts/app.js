// ComfyApp and litegraph's node as an extension script meets them (see README.md).
import { api, PromptExecutionError } from "./api.js";

export const NODE_TITLE_HEIGHT = 30;
export const NODE_SLOT_HEIGHT = 20;

export class LGraphNode {
    constructor(title) {
        this.title = title;
        this.widgets = [];
        this.inputs = [];
        this.size = [140, 60];
        this.serialize_widgets = true;
    }

    addWidget(type, name, value, callback, options = {}) {
        const widget = { type, name, value, callback, options };
        this.widgets.push(widget);
        return widget;
    }

    addDOMWidget(name, type, element, options = {}) {
        const widget = { name, type, element, node: this, options: { hideOnZoom: true, ...options } };
        Object.defineProperty(widget, "value", {
            get() { return this.options.getValue?.() ?? ""; },
            set(v) { this.options.setValue?.(v); this.callback?.(this.value); },
        });
        widget.computeLayoutSize = () => ({ minHeight: widget.options.getMinHeight?.() ?? 50, minWidth: 0 });
        this.widgets.push(widget);
        return widget;
    }

    computeSize() {
        let height = NODE_TITLE_HEIGHT + Math.max(1, this.inputs.length) * NODE_SLOT_HEIGHT;
        if (this.widgets.length) {
            for (const w of this.widgets) height += (w.computeLayoutSize ? w.computeLayoutSize(this).minHeight : 20) + 4;
            height += 8;
        }
        return [Math.max(this.size[0], 140), height];
    }

    setSize(size) { this.size = [size[0], size[1]]; }
    setDirtyCanvas() { this.dirty = true; }
}

class App {
    constructor() {
        this.extensions = [];
        this.graph = { id: "workflow-1", _nodes: [] };
        this.links = [];
    }

    registerExtension(extension) { this.extensions.push(extension); }

    // What the page does for a node type from /object_info, then for one node of it (in ``graph``: the
    // root graph, or a subgraph node's ``subgraph``).
    async addNode(id, nodeData, widgets = {}, graph = this.graph) {
        class NodeType extends LGraphNode {}
        for (const ext of this.extensions) await ext.beforeRegisterNodeDef?.(NodeType, nodeData, this);
        const node = new NodeType(nodeData.display_name ?? nodeData.name);
        node.id = id;
        node.type = nodeData.name;
        for (const [name, spec] of Object.entries(nodeData.input?.required ?? {})) {
            if (name in widgets) node.addWidget(Array.isArray(spec[0]) ? "combo" : "text", name, widgets[name], () => {},
                                                Array.isArray(spec[0]) ? { values: spec[0] } : {});
            else node.inputs.push({ name, type: spec[0], link: null });
        }
        node.onNodeCreated?.();
        graph._nodes.push(node);
        return node;
    }

    // A subgraph node: its ``subgraph`` is a graph of its own (the nodes inside, ids local to it).
    addSubgraphNode(id, graph = this.graph) {
        const node = new LGraphNode("New Subgraph");
        node.id = id;
        node.type = `subgraph-${id}`;
        node.subgraph = { id: `subgraph-definition-${id}`, _nodes: [] };
        node.isSubgraphNode = () => true;
        graph._nodes.push(node);
        return node;
    }

    link(fromId, slot, toNode, inputName) {
        toNode.inputs.find((i) => i.name === inputName).link = [String(fromId), slot];
    }

    // A workflow configured: every extension's loadedGraphNode for each node of the root graph, then
    // afterConfigureGraph once.
    async loaded() {
        for (const node of this.graph._nodes) {
            for (const ext of this.extensions) await ext.loadedGraphNode?.(node, this);
        }
        for (const ext of this.extensions) await ext.afterConfigureGraph?.([], this);
    }

    // Another workflow tab opened (loadGraphData): the same graph object takes that workflow's id, and its
    // nodes are made afresh (the caller adds them, then calls loaded()).
    openWorkflow(id) {
        this.graph.id = id;
        this.graph._nodes = [];
    }

    executed(node, output) { node.onExecuted?.(output); }

    // The Run button: the prompt to api.queuePrompt, looked up on the api object at each call. The errors
    // of a refused prompt are what the page shows (lastNodeErrors: the canvas marks each input an error
    // names, the errors panel lists each error's message and details): those of the answer, or of the
    // PromptExecutionError thrown for a prompt refused whole, which the page catches.
    async queuePrompt(number) {
        const p = await this.graphToPrompt();
        try {
            const answer = await api.queuePrompt(number, p, {});
            this.lastNodeErrors = answer?.node_errors ?? null;
            return answer;
        } catch (error) {
            if (!(error instanceof PromptExecutionError)) throw error;
            this.lastNodeErrors = error.response.node_errors ?? null;
            return null;
        }
    }

    async setup() { for (const ext of this.extensions) await ext.setup?.(this); }

    serialize() {
        return {
            id: this.graph.id,
            nodes: this.graph._nodes.map((node) => {
                const out = { id: node.id, type: node.type };
                if (node.serialize_widgets) {
                    out.widgets_values = [];
                    node.widgets.forEach((w, i) => { if (w.serialize !== false) out.widgets_values[i] = w.value; });
                }
                return out;
            }),
        };
    }

    // Every node to run, a subgraph's flattened in: its id the path of node ids joined by ":".
    flattened(graph = this.graph, prefix = "") {
        const found = [];
        for (const node of graph._nodes) {
            const id = prefix ? `${prefix}:${node.id}` : String(node.id);
            if (node.subgraph) found.push(...this.flattened(node.subgraph, id));
            else found.push([id, node]);
        }
        return found;
    }

    async graphToPrompt() {
        const output = {};
        for (const [id, node] of this.flattened()) {
            const inputs = {};
            for (const [i, w] of node.widgets.entries()) {
                if (!w.name || w.options?.serialize === false) continue;
                const value = w.serializeValue ? await w.serializeValue(node, i) : w.value;
                inputs[w.name] = Array.isArray(value) ? { __value__: value } : value;
            }
            for (const input of node.inputs) if (input.link) inputs[input.name] = input.link;
            output[id] = { inputs, class_type: node.type, _meta: { title: node.title } };
        }
        return { workflow: this.serialize(), output };
    }
}

export const app = new App();
