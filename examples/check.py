"""Outcome command of examples/three_agents.py: exit 0 (good) when the reporter's final report
states the right number of apples (42), 1 (bad) otherwise, 2 when there is no result file.

    car record --outcome 'python examples/check.py' -- python examples/three_agents.py
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile

# one file per run: car sets CAR_RUN_ID for the program and its outcome command alike, so
# concurrent fork branches (-c N) never share one
OUT = os.environ.get("THREE_AGENTS_OUT") or os.path.join(
    tempfile.gettempdir(), f"three_agents-{os.environ.get('CAR_RUN_ID', 'run')}.json"
)


def main() -> int:
    try:
        with open(OUT, encoding="utf-8") as f:
            result = json.load(f)
    except (OSError, ValueError) as e:
        print(f"check: no result ({e})", file=sys.stderr)
        return 2
    numbers = re.findall(r"-?\d+", str(result.get("report", "")))
    return 0 if "42" in numbers else 1


if __name__ == "__main__":
    sys.exit(main())
