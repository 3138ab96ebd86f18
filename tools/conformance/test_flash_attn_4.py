"""FlashAttention-4 (flash-attn-4): its Python needs the CuTe DSL (nvidia-cutlass-dsl) to import and a
GPU to compile anything, so the case reads the release's own ``flash_attn/cute/interface.py``: it runs
the release's head-size validation and architecture parsing (the functions themselves, taken from the
file) against the engine's rules, and checks the call the engine makes against ``flash_attn_func``'s
signature and the tuple its autograd function returns.
"""
from __future__ import annotations

import ast
import functools
import pathlib

import pytest

from .sources import fetch

RELEASES = ["4.0.0b40"]


def _interface(release: str) -> tuple[ast.Module, str]:
    path = pathlib.Path(fetch("flash-attn-4", release, kind="wheel")) / "flash_attn" / "cute" / "interface.py"
    text = path.read_text()
    return ast.parse(text), text


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"interface.py has no top-level {name}()"
    return found[0]


def _package_functions(tree, *names) -> dict:
    """The named top-level functions of interface.py, compiled on their own."""
    import os
    import re

    module = ast.Module(body=[_function(tree, n) for n in names], type_ignores=[])
    namespace = {"lru_cache": functools.lru_cache, "re": re, "os": os}
    exec(compile(module, "flash_attn/cute/interface.py", "exec"), namespace)  # noqa: S102 - the release's own code
    return namespace


@pytest.mark.parametrize("release", RELEASES)
def test_fa4_head_sizes_match_the_release(release):
    from lib_attn.kernels.flash4 import fa4_head_dim_reason

    tree, _ = _interface(release)
    validate = _package_functions(tree, "_validate_head_dims")["_validate_head_dims"]
    checked = 0
    for sm in (90, 100, 110):
        for d in range(1, 300):
            try:
                validate(d, d, sm // 10, 8)  # 16 bytes / 2-byte elements: the fp16/bf16 alignment
                package_takes = True
            except AssertionError:
                package_takes = False
            engine_takes = fa4_head_dim_reason(d, sm) == ""
            assert engine_takes == package_takes, f"sm{sm} d={d}: engine {engine_takes}, flash-attn-4 {package_takes}"
            checked += 1
    assert checked == 3 * 299


@pytest.mark.parametrize("release", RELEASES)
def test_fa4_call_and_result_match_the_release(release):
    from lib_attn.kernels.flash4 import FA4_FAMILIES, FlashAttn4

    tree, text = _interface(release)
    func = _function(tree, "flash_attn_func")
    params = [a.arg for a in func.args.args]
    assert params[:3] == ["q", "k", "v"], params
    assert {"softmax_scale", "causal"} <= set(params), params
    # FlashAttnFunc.forward returns (out, lse): the engine takes the first element.
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "FlashAttnFunc")
    forward = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    returns = [n.value for n in ast.walk(forward) if isinstance(n, ast.Return)]
    assert returns and all(isinstance(r, ast.Tuple) and len(r.elts) == 2 for r in returns), ast.dump(returns[0])

    class Recorder:
        def __call__(self, q, k, v, **kwargs):
            unknown = set(kwargs) - set(params)
            assert not unknown, f"the engine passes {unknown}, which flash_attn_func does not take"
            return ("out", "lse")

    backend = FlashAttn4()
    backend.func = Recorder()
    assert backend.run("q", "k", "v", None, 0.1) == "out"
    # The architectures the engine offers FA4 on are those the release dispatches.
    assert "assert arch // 10 in [8, 9, 10, 11, 12]" in text
    assert set(FA4_FAMILIES) <= {8, 9, 10, 11, 12}
    parse = _package_functions(tree, "_parse_arch_str")["_parse_arch_str"]
    assert [parse(s) for s in ("sm_90a", "100", "sm_120")] == [90, 100, 120]
