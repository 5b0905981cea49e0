"""Test modules longest first, so that pytest-xdist's workers end together.

`scripts/test` runs each tier on xdist workers with `--dist loadfile --no-loadscope-reorder`: a
module runs whole on one worker, and the modules are handed out in the order pytest collected them.
A long module handed out last keeps one worker busy while the others idle, so `tests/conftest.py`
sorts the collected tests by the time their module takes (the sum of its selected tests' times in
`durations.json`, measured), longest first; within a module the order stays as written.

`durations.json` holds each test taking at least `KEEP_S` (its setup, call and teardown, as the
junit report gives them), by node id; any other test counts `OTHER_S`. Refresh it after a change
that moves time around, from both tiers' junit reports:

    MLXCHAT_TEST_JUNIT=/tmp/times bash scripts/test   # each tier's report: /tmp/times/TIER.xml
    python tests/durations.py /tmp/times/fast.xml /tmp/times/real-model.xml

A stale or missing entry only makes the order a little worse; it never changes what runs.
"""

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

TABLE = Path(__file__).with_name("durations.json")
REPO = Path(__file__).resolve().parents[1]
KEEP_S = 0.3
OTHER_S = 0.05


def _nodeid(classname: str, name: str) -> str:
    """The pytest node id of a junit testcase (`tests.test_x.TestY` + `test_z[p]`)."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (REPO / path).exists():
            return "::".join([path, *parts[cut:], name])
    return f"{classname}::{name}"


def measure(reports: list[str]) -> dict[str, float]:
    """Each test's seconds in the junit `reports` (the tests that took at least KEEP_S)."""
    times = {}
    for report in reports:
        for case in ET.parse(report).iter("testcase"):
            seconds = float(case.get("time") or 0)
            if seconds >= KEEP_S:
                times[_nodeid(case.get("classname", ""), case.get("name", ""))] = round(seconds, 1)
    return dict(sorted(times.items()))


def longest_modules_first(items: list) -> None:
    """Reorder pytest `items` in place: modules by their summed time, longest first (stable)."""
    try:
        times = json.loads(TABLE.read_text())
    except (OSError, ValueError):
        return
    module = defaultdict(float)
    for item in items:
        module[item.nodeid.split("::")[0]] += times.get(item.nodeid, OTHER_S)
    items.sort(key=lambda item: -module[item.nodeid.split("::")[0]])


if __name__ == "__main__":
    TABLE.write_text(json.dumps(measure(sys.argv[1:]), indent=0) + "\n")
    print(f"wrote {TABLE}")
