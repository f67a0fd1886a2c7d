"""The size rules (issue 24): no module in kvmap/ over 400 lines, no function or method over 80 (ast: the `def`
line to the last line of its body, `end_lineno - lineno + 1`; decorators not counted). Each break is listed."""

from __future__ import annotations

import ast
from pathlib import Path

from .conftest import ROOT

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def oversized(package: Path) -> list[str]:
    """Every module of `package` over MAX_MODULE_LINES and every function over MAX_FUNCTION_LINES, one line each."""
    out = []
    for path in sorted(package.rglob("*.py")):
        src = path.read_text()
        name = path.relative_to(package.parent)
        n = len(src.splitlines())
        if n > MAX_MODULE_LINES:
            out.append(f"{name}: {n} lines (module)")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    out.append(f"{name}:{node.lineno}: {node.name} {length} lines (function)")
    return out


def test_no_module_over_400_lines_and_no_function_over_80():
    assert oversized(ROOT / "kvmap") == []


def test_the_check_sees_each_limit_and_not_one_line_less(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()

    def function(name: str, lines: int) -> str:  # `def` line + body lines
        return f"def {name}():\n" + "    x = 0\n" * (lines - 1)

    (pkg / "at_limits.py").write_text(function("f", 80) + "\n" * (400 - 80))
    (pkg / "over.py").write_text(function("g", 81) + "class C:\n" + "    " + function("m", 81).replace(
        "\n    ", "\n        ") + "\n" * (401 - 81 - 1 - 81))
    assert oversized(pkg) == ["pkg/over.py: 401 lines (module)", "pkg/over.py:1: g 81 lines (function)",
                              "pkg/over.py:83: m 81 lines (function)"]
