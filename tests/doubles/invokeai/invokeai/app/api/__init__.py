"""Double of InvokeAI 6.14.2 (see tests/doubles/invokeai/README.md)."""
