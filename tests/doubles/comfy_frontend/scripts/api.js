// ComfyApi as an extension meets it: fetchApi, and server messages as events with a detail.

// What queuePrompt throws when ComfyUI refuses a prompt (a status other than 200): the answer's body as
// ``response`` ({error, node_errors}).
export class PromptExecutionError extends Error {
    constructor(response) {
        super("Prompt execution failed");
        this.response = response;
    }
}

class Api extends EventTarget {
    constructor() {
        super();
        this.routes = {};     // route -> JSON body the fake server answers with
        this.fetched = [];
        this.queued = [];
        this.promptIds = [];
        this.answerGate = null;
        this.refusal = null;  // the body of ComfyUI's 400 answer, while a test has the server refuse prompts
    }

    async fetchApi(route) {
        this.fetched.push(route);
        const path = route.split("?")[0];
        if (!(path in this.routes)) return { ok: false, status: 404, json: async () => ({}) };
        const body = this.routes[path];
        return { ok: true, status: 200, json: async () => JSON.parse(JSON.stringify(body)) };
    }

    // POST /prompt with {client_id, prompt, extra_data: {extra_pnginfo: {workflow}}}; ComfyUI answers with the
    // prompt id it gave the prompt. The fake server hands out ``promptIds`` in turn; ``answer`` resolves
    // the request (a test may hold it back, as a slow answer arrives after the prompt's first messages).
    async queuePrompt(number, { output, workflow }, options) {
        this.queued.push({ number, prompt: output, workflow });
        const id = this.promptIds.shift();
        await (this.answerGate ?? Promise.resolve());
        if (this.refusal) throw new PromptExecutionError(JSON.parse(JSON.stringify(this.refusal)));
        return { prompt_id: id, number, node_errors: {} };
    }

    message(type, detail) {
        this.dispatchEvent(new CustomEvent(type, { detail }));
    }
}

export const api = new Api();
