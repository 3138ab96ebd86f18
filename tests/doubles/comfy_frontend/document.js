// A browser document just large enough for an extension that builds a widget's element.
class Element {
    constructor(tag) {
        this.tagName = tag.toUpperCase();
        this.style = {};
        this.value = "";
        this.readOnly = false;
        this.className = "";
        this.isConnected = false;
        this.scrollHeight = 0;
        this.clientHeight = 0;
    }
}

globalThis.document = { createElement: (tag) => new Element(tag) };
