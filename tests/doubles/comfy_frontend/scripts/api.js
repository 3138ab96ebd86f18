// ComfyApi as an extension meets it: fetchApi, and server messages as events with a detail.
class Api extends EventTarget {
    constructor() {
        super();
        this.routes = {};     // route -> JSON body the fake server answers with
        this.fetched = [];
    }

    async fetchApi(route) {
        this.fetched.push(route);
        const path = route.split("?")[0];
        if (!(path in this.routes)) return { ok: false, status: 404, json: async () => ({}) };
        const body = this.routes[path];
        return { ok: true, status: 200, json: async () => JSON.parse(JSON.stringify(body)) };
    }

    message(type, detail) {
        this.dispatchEvent(new CustomEvent(type, { detail }));
    }
}

export const api = new Api();
