"""Double of ``invokeai.app``. Its ``__path__`` stays on the double: the release's app layer imports
torchvision and its whole server stack, so none of its modules may load here by accident."""
