"""For a double that differs from another in a few functions: ``extend(namespace, name)`` runs the
A1111 double's ``modules/<name>.py`` in the calling module's namespace, which then defines what its
host does otherwise. The module keeps its host's name (``modules.<name>``) and every function, including
the A1111 ones it keeps, looks names up in it."""
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def extend(namespace: dict, name: str, root: str = "a1111") -> None:
    """``root``: the double whose module is run (a folder of ``tests/doubles``; Forge Neo's job path
    extends Forge's)."""
    path = os.path.join(HERE, root, "modules", f"{name}.py")
    with open(path, encoding="utf8") as file:
        exec(compile(file.read(), path, "exec"), namespace)  # noqa: S102 - the repository's own double
