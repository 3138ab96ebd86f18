"""Double of backend/loader.py (Forge; Forge Neo's is the same to a caller): ``forge_loader(sd,
additional_state_dicts=None)`` builds a new model object from the checkpoint file ``sd`` each time it is
called; Forge never reuses the model it dropped. The files are the tests' own: ``files`` maps a filename to
the function that builds its model (the checkpoint's weights are fixed by it), and a file that is not there
raises as opening a missing file does."""
files = {}


def forge_loader(sd, additional_state_dicts=None):
    build = files.get(sd)
    if build is None:
        raise FileNotFoundError(f"No such file or directory: {sd!r}")
    return build()
