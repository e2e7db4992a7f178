"""Line coverage of services/, shared/ and transport/ from a combined coverage.py data file (`make coverage`):
one line per folder and the total; the per-file table goes to coverage.json."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import coverage

FOLDERS = ("services", "shared", "transport")


def main() -> int:
    cov = coverage.Coverage()
    cov.load()
    cov.json_report(outfile="coverage.json")
    files = json.loads(Path("coverage.json").read_text())["files"]
    totals = {folder: [0, 0] for folder in FOLDERS}
    for path, entry in files.items():
        folder = Path(path).parts[0]
        if folder in totals:
            totals[folder][0] += entry["summary"]["covered_lines"]
            totals[folder][1] += entry["summary"]["num_statements"]
    covered, statements = (sum(t[i] for t in totals.values()) for i in (0, 1))
    for name, (c, s) in [*totals.items(), ("total", (covered, statements))]:
        print(f"{name:10} {c:6d} / {s:6d} lines  {100 * c / max(s, 1):5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
