"""Mutation score of the last `make mutate`, per mutated module and overall (docs/mutation.md).

Reads mutmut 3's per-file results (``mutants/<path>.meta``, exit code per mutant). Killed means the
unit tests failed (exit 1 or 3) or ran out of time; survived (0) and "no tests" (5, 33: no unit test
calls the function) both count against the score.

    python scripts/mutation_score.py [mutants]
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped",
          36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout"}


def main(root: str = "mutants") -> int:
    metas = sorted(Path(root).rglob("*.py.meta"))
    if not metas:
        print(f"no mutmut results under {root}/; run `make mutate` first", file=sys.stderr)
        return 2
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
    sys.exit(main(*sys.argv[1:]))
