"""The InvokeAI tests (tools/run_invokeai_tests.sh, in .venv-invokeai).

InvokeAI 6.14.2's app layer cannot be installed here (it imports torchvision), so ``tests/doubles/invokeai``
goes first on ``sys.path``: its ``invokeai`` package is the double of the app layer, and reaches the installed
release (``pip install --no-deps invokeai==6.14.2``) for every module it does not define, e.g. the real
``invokeai.backend.flux.math``. ``invokeai_host`` (services, graphs, runner) sits beside it.
"""
import os
import sys

import pytest

DOUBLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "doubles", "invokeai")
if sys.path[0] != DOUBLES:
    sys.path.insert(0, DOUBLES)
if "invokeai" in sys.modules and not sys.modules["invokeai"].__path__[0].startswith(DOUBLES):
    raise RuntimeError("invokeai was imported before the double was put on sys.path")

from invokeai.app.invocations.baseinvocation import InvocationRegistry  # noqa: E402
from invokeai_host import InvokeHost  # noqa: E402  (registers the core nodes once, as a process start does)


@pytest.fixture(autouse=True)
def invocation_registry():
    """The registry as it was before the test: nodes a test registers (a node pack) do not outlive it."""
    invocations = set(InvocationRegistry._invocation_classes)
    outputs = set(InvocationRegistry._output_classes)
    yield InvocationRegistry
    InvocationRegistry._invocation_classes.clear()
    InvocationRegistry._invocation_classes.update(invocations)
    InvocationRegistry._output_classes.clear()
    InvocationRegistry._output_classes.update(outputs)
    InvocationRegistry.invalidate_invocation_typeadapter()
    InvocationRegistry.invalidate_output_typeadapter()


@pytest.fixture
def host():
    """A fresh InvokeAI double: empty image store and event log, its own model cache."""
    return InvokeHost()
