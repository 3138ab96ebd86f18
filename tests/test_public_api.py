"""The engine's public API is exactly ``lib_attn.__all__``, and the README's engine section documents it."""
import os
import re
import types

import lib_attn

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _engine_section() -> str:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    start = text.index("## Engine API (`lib_attn`)")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def test_every_public_name_is_in_all_and_nothing_leaks():
    public = [n for n in dir(lib_attn) if not n.startswith("_")]
    leaked = [n for n in public if n not in lib_attn.__all__ and not isinstance(getattr(lib_attn, n), types.ModuleType)]
    assert leaked == []
    assert all(hasattr(lib_attn, n) for n in lib_attn.__all__)
    assert len(set(lib_attn.__all__)) == len(lib_attn.__all__)


def test_readme_engine_section_documents_all():
    section = _engine_section()
    named = set(re.findall(r"`(?:lib_attn\.)?([A-Za-z_][A-Za-z0-9_]*)", section))
    assert sorted(n for n in lib_attn.__all__ if n not in named) == []
