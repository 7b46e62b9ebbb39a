"""docs/compat.md from the compatibility reports of ``make test`` (one JSON file per torch).

Each ``compat``-marked test is one row's evidence (tests/conftest.py writes the reports);
a row passes on a torch when every test of it passed there.

    python tests/compat_table.py docs/compat.md REPORT.json [REPORT.json ...]
"""

from __future__ import annotations

import datetime
import json
import re
import sys
from typing import Dict, List, Tuple


def _version_key(v: str) -> Tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def cell(tests: Dict[str, str]) -> str:
    """One table cell: ✓ (every test passed), ✗ (which failed), or skipped."""
    failed = sorted(t.split("::", 1)[-1] for t, o in tests.items() if o == "failed")
    passed = sum(o == "passed" for o in tests.values())
    if failed:
        return "✗ " + ", ".join(f"`{t}`" for t in failed)
    if passed == 0:
        return "skipped"
    return f"✓ ({passed} test{'s' if passed > 1 else ''})"


def table(reports: List[dict]) -> str:
    """The markdown page for ``reports`` (one per torch release)."""
    reports = sorted(reports, key=lambda r: _version_key(r["torch"]))
    features = sorted({f for r in reports for f in r["features"]})
    head = ["feature"] + [f"torch {r['torch']}" for r in reports]
    lines = [
        "# Which torch releases ckptrun works on",
        "",
        "Written by `make test` (`tests/compat_table.py`), not by hand: each row is the outcome "
        "of the tests marked `compat(\"<row>\")` (`pytest -m compat`), run in a virtual "
        "environment of each torch release -- the declared floor, the release the main suite "
        "pins, and the newest on the package index -- on the CPU.  A cell lists the tests "
        "that failed, if any.",
        "",
        f"Generated {datetime.date.today().isoformat()}; Python "
        + ", ".join(sorted({r.get('python', '?') for r in reports})) + ".",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for feature in features:
        row = [feature] + [cell(r["features"].get(feature, {})) if feature in r["features"]
                           else "not run" for r in reports]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv: List[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    reports = []
    for path in argv[1:]:
        try:
            with open(path) as f:
                reports.append(json.load(f))
        except (OSError, ValueError) as exc:
            print(f"compat_table: skipping {path}: {exc}", file=sys.stderr)
    if not reports:
        print("compat_table: no report to tabulate", file=sys.stderr)
        return 1
    with open(argv[0], "w") as f:
        f.write(table(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
