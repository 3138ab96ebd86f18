"""Double of ComfyUI's server.py ``PromptServer``: one ``instance``, its aiohttp ``routes`` table (custom
nodes add routes to it while they load; the app takes them afterwards), ``send_sync`` (queued to the
UI's websocket for the client ``sid``, to every client when None; recorded here), ``client_id`` (the
client that queued the prompt being executed, set by the executor for each prompt) and
``last_prompt_id`` (set by main.py for each prompt it executes)."""
from aiohttp import web


class PromptServer:
    instance = None

    def __init__(self, loop=None):
        PromptServer.instance = self
        self.routes = web.RouteTableDef()
        self.app = web.Application()
        self.client_id = None
        self.last_prompt_id = None
        self.last_node_id = None
        self.sent = []

    def send_sync(self, event, data, sid=None):
        self.sent.append((event, data, sid))

    def add_routes(self):
        self.app.add_routes(self.routes)
