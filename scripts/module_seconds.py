"""Write ``tests/module_seconds.json`` from a pytest run's ``--durations=0`` report (read on stdin).

``make test`` hands the test modules to its test processes longest first (``tests/conftest.py``), so a
module of one or two long tests (Spark, the demos) does not start last and end the run alone. Refresh the
figures when modules grow: ``make test PYTEST_ADDOPTS=--durations=0 | .venv/bin/python
scripts/module_seconds.py``.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^(\d+(?:\.\d+)?)s (?:call|setup|teardown)\s+(tests/[^:]+\.py)::")
OUT = Path(__file__).resolve().parent.parent / "tests" / "module_seconds.json"


def main() -> int:
    seconds: dict[str, float] = defaultdict(float)
    for line in sys.stdin:
        match = LINE.match(line)
        if match:
            seconds[match.group(2)] += float(match.group(1))
    if not seconds:
        print("no --durations=0 lines on stdin", file=sys.stderr)
        return 2
    ordered = dict(sorted(((module, round(total)) for module, total in seconds.items()), key=lambda kv: -kv[1]))
    OUT.write_text(json.dumps(ordered, indent=0) + "\n")
    print(f"{len(ordered)} modules, {sum(ordered.values())} s, written to {OUT.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
