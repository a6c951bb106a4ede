"""The score of `make mutation`, per mutated file, from mutmut's results in mutants/.

    python scripts/mutation_report.py               # one line per file, then the total
    python scripts/mutation_report.py --survivors   # and the names of the survivors, per file

score = killed / checked, where checked counts every mutant that ran (killed, survived,
timeout, suspicious, segfault); "no tests" (no selected test reaches the function) and
"not checked" (the run was stopped before it) are shown apart. `mutmut show NAME` prints
one mutant's diff. Reads mutants/**/*.py.meta (mutmut 3's per-file results).
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

from mutmut.stats import status_by_exit_code

COLUMNS = ("killed", "survived", "timeout", "suspicious", "segfault", "no tests", "not checked")
RAN = ("killed", "survived", "timeout", "suspicious", "segfault")


def results(root: Path) -> dict[str, dict[str, str]]:
    """{source file: {mutant name: status}} from mutmut's .meta files."""
    out = {}
    for meta in sorted(root.rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        out[str(meta.relative_to(root))[:-len(".meta")]] = {k: status_by_exit_code[v] for k, v in codes.items()}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mutants", default="mutants", help="mutmut's folder (default: mutants)")
    ap.add_argument("--survivors", action="store_true", help="list the surviving mutants of each file")
    args = ap.parse_args(argv)
    root = Path(args.mutants)
    if not root.is_dir():
        print(f"no {root}/ folder: run `make mutation` first", file=sys.stderr)
        return 2
    by_file = results(root)
    header = f"{'file':40} {'score':>7} " + " ".join(f"{c:>11}" for c in COLUMNS) + f" {'total':>6}"
    print(header)
    total = collections.Counter()
    for path, statuses in by_file.items():
        n = collections.Counter(statuses.values())
        total.update(n)
        print(_line(path, n, len(statuses)))
    print(_line("total", total, sum(total.values())))
    if args.survivors:
        for path, statuses in by_file.items():
            names = sorted(k for k, s in statuses.items() if s == "survived")
            if names:
                print(f"\n{path}: {len(names)} survived")
                print("\n".join(f"  {k}" for k in names))
    return 0


def _line(path: str, n: collections.Counter, total: int) -> str:
    ran = sum(n[c] for c in RAN)
    score = f"{100 * n['killed'] / ran:6.1f}%" if ran else "     - "
    return f"{path:40} {score:>7} " + " ".join(f"{n[c]:>11}" for c in COLUMNS) + f" {total:>6}"


if __name__ == "__main__":
    sys.exit(main())
