"""Mutation score of the last `make mutate`, per mutated module and overall (docs/mutation.md).

Reads mutmut 3's per-file results (``mutants/<path>.meta``, exit code per mutant). Killed means the
unit tests failed (exit 1 or 3) or ran out of time; survived (0) and "no tests" (5, 33: no unit test
calls the function) both count against the score. ``--survivors`` lists every mutant not killed with the
line it changed (read from mutmut's mutated copy, as ``mutmut show`` prints it, for all of them in one pass).

    python scripts/mutation_score.py [--survivors] [mutants]
"""

from __future__ import annotations

import ast
import difflib
import json
import sys
from collections import Counter
from pathlib import Path

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped",
          36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout"}


def _functions(source: str) -> dict[str, str]:
    """Every function's source in a mutated file, by its mangled name (``x_f__mutmut_3``, ``xǁCǁm__mutmut_orig``)."""
    lines = source.splitlines()
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and "__mutmut_" in node.name:
            out[node.name] = "\n".join(lines[node.lineno - 1:node.end_lineno])
    return out


def changed_line(functions: dict[str, str], mutant: str) -> str:
    """The mutant's lines that differ from the original function's, joined (what ``mutmut show`` marks ``+``)."""
    name = mutant.rsplit(".", 1)[-1]
    orig = functions.get(name.rsplit("__mutmut_", 1)[0] + "__mutmut_orig", "")
    mutated = functions.get(name, "")
    plus = [ln[1:].strip() for ln in difflib.unified_diff(orig.splitlines(), mutated.splitlines(), lineterm="", n=0)
            if ln.startswith("+") and not ln.startswith("+++")]
    # the def line differs by name only; the body lines are the mutation
    return " / ".join(p for p in plus if not p.startswith(("def ", "async def ")))


def survivors(metas: list[Path]) -> None:
    for meta in metas:
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        left = sorted(k for k, code in codes.items() if code is not None and STATUS.get(code) in ("survived", "no tests"))
        if not left:
            continue
        functions = _functions(meta.with_suffix("").read_text())
        for key in left:
            print(f"{key}\t{STATUS[codes[key]]}\t{changed_line(functions, key)}")


def main(argv: list[str]) -> int:
    listing = "--survivors" in argv
    args = [a for a in argv if a != "--survivors"]
    root = Path(args[0] if args else "mutants")
    metas = sorted(root.rglob("*.py.meta"))
    if not metas:
        print(f"no mutmut results under {root}/; run `make mutate` first", file=sys.stderr)
        return 2
    if listing:
        survivors(metas)
        return 0
    total: Counter[str] = Counter()
    print(f"{'module':<32} {'killed':>7} {'survived':>9} {'no tests':>9} {'score':>7}")
    for meta in metas:
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        c = Counter(STATUS.get(code, "other") if code is not None else "not run" for code in codes.values())
        if not codes:
            continue
        total.update(c)
        killed = c["killed"] + c["timeout"]
        judged = max(1, sum(c.values()) - c["skipped"] - c["not run"])
        module = str(meta.relative_to(root))[: -len(".py.meta")].replace("/", ".")
        print(f"{module:<32} {killed:>7} {c['survived']:>9} {c['no tests']:>9} {100 * killed / judged:>6.1f}%")
    killed = total["killed"] + total["timeout"]
    judged = max(1, sum(total.values()) - total["skipped"] - total["not run"])
    print(f"mutation score: {killed} of {judged} mutants killed ({100 * killed / judged:.1f}%)"
          + (f"; {total['not run']} not run" if total["not run"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
