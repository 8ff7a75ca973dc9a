"""The shape of ``jdist/rpc`` (issue 42): no function over 60 lines or of cyclomatic
complexity 15 or more, no class over 300 lines, and no special case keyed on a layer
class or on ``jdist.testing`` (a module opts into shape buckets by ``bucket_call``).

Complexity is McCabe's as ruff's C901 counts it (``ruff`` is in the test extra).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

RPC = Path(__file__).resolve().parents[2] / "jdist" / "rpc"
MAX_FUNCTION_LINES, MAX_COMPLEXITY, MAX_CLASS_LINES = 60, 14, 300


def _defs(kinds):
    for path in sorted(RPC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, kinds):
                yield f"{path.relative_to(RPC.parent.parent)}:{node.lineno} {node.name}", \
                    node.end_lineno - node.lineno + 1


def test_no_long_function():
    long = [(w, n) for w, n in _defs((ast.FunctionDef, ast.AsyncFunctionDef))
            if n > MAX_FUNCTION_LINES]
    assert long == [], f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_long_class():
    long = [(w, n) for w, n in _defs(ast.ClassDef) if n > MAX_CLASS_LINES]
    assert long == [], f"classes over {MAX_CLASS_LINES} lines: {long}"


def test_no_complex_function():
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "C901",
         "--config", f"lint.mccabe.max-complexity={MAX_COMPLEXITY}",
         "--output-format", "concise", str(RPC)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_no_layer_or_testing_special_case():
    hits = [f"{p.relative_to(RPC.parent.parent)}:{i}" for p in sorted(RPC.rglob("*"))
            if p.suffix in (".py", ".md")
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if "EmbeddingBag" in line or "jdist.testing" in line]
    assert hits == [], hits
