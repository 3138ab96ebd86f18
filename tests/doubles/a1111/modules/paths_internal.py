"""Double of A1111's modules/paths_internal.py: where the webui and its extensions live."""
import os

script_path = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
data_path = script_path
#: Set by the fixture before ``modules.shared`` is imported (the real one derives it from --data-dir).
extensions_dir = os.path.join(data_path, "extensions")
extensions_builtin_dir = os.path.join(script_path, "extensions-builtin")
