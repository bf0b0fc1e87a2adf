"""The funnel stays open (issue 43): no function in harness/ longer than 80 lines, none taking more than 8
positional parameters (a config or a typed record instead of a long list of values).

Read from the source with ``ast``: a function's lines run from its ``def`` (decorators excluded) to its last
statement, docstring and comments inside it included; ``self`` and ``cls`` are not counted as parameters.
"""

from __future__ import annotations

import ast
from pathlib import Path

HARNESS = Path(__file__).resolve().parents[2] / "harness"
MAX_LINES = 80
MAX_POSITIONAL = 8


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _positional(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    names = [a.arg for a in [*fn.args.posonlyargs, *fn.args.args]]
    return len(names) - (1 if names and names[0] in ("self", "cls") else 0)


def _sizes() -> dict[str, tuple[int, int]]:
    sizes = {}
    for path in sorted(HARNESS.rglob("*.py")):
        for fn in _functions(ast.parse(path.read_text(), filename=str(path))):
            where = f"{path.relative_to(HARNESS.parent)}:{fn.lineno} {fn.name}"
            sizes[where] = (fn.end_lineno - fn.lineno + 1, _positional(fn))
    return sizes


def test_the_walk_measures_lines_and_positional_parameters() -> None:
    src = "class C:\n    def m(self, a, b, /, c, *args, d=1, **kw):\n        x = 1\n\n        return x\n"
    (fn,) = _functions(ast.parse(src))
    assert (fn.end_lineno - fn.lineno + 1, _positional(fn)) == (4, 3)  # a, b, c: not self, *args, d, **kw


def test_every_function_in_harness_is_short_and_takes_few_positional_parameters() -> None:
    sizes = _sizes()
    assert len(sizes) > 500, f"only {len(sizes)} functions found under {HARNESS}"
    long = {k: n for k, (n, _) in sizes.items() if n > MAX_LINES}
    wide = {k: p for k, (_, p) in sizes.items() if p > MAX_POSITIONAL}
    assert not long, f"functions over {MAX_LINES} lines (split into named steps): {long}"
    assert not wide, f"functions with over {MAX_POSITIONAL} positional parameters (take a config or a record): {wide}"
