"""Shared helper for the UI tests: find what a real gradio Blocks runs when a component fires."""


def event_handler(demo, trigger):
    """The function gradio runs when ``trigger`` fires, and the ids of its output components
    (gradio 3 keeps events in ``dependencies`` beside ``fns``; gradio 4 in ``fns`` by id)."""
    if isinstance(demo.fns, dict):
        for fn in demo.fns.values():
            if trigger._id in [t[0] for t in fn.targets]:
                return fn.fn, [block._id for block in fn.outputs]
    else:
        for dep, fn in zip(demo.dependencies, demo.fns):
            if trigger._id in [t if isinstance(t, int) else t[0] for t in dep["targets"]]:
                return fn.fn, dep["outputs"]
    raise AssertionError("no event handler on the component")
