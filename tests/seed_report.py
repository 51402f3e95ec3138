"""Pairs ``make test-seeds``'s outcomes with the seeds each test drew: a table and JSON.

Usage: ``python tests/seed_report.py SEED_LOG JUNIT_XML OUT_JSON``. ``SEED_LOG`` has a line
``node id<TAB>seed`` per ``helpers.fresh_seed`` call (``ZPP_SEED_LOG``); ``JUNIT_XML`` is
pytest's ``--junitxml`` of the same run. A test counts its rounds (``[...roundK]`` ids of
``--seed-rounds``), how many passed, the distinct seeds its rounds drew and, for a failed
round, the seed to replay it with (``ZPP_TEST_SEED``). Exits 1 if any round failed.
"""

from __future__ import annotations

import collections
import json
import re
import sys
import xml.etree.ElementTree as ET

_ROUND = re.compile(r"\[round(\d+)\]$|\[round(\d+)-|-round(\d+)(?=[-\]])")


def _test_of(node_id: str) -> tuple[str, int]:
    """``path::name[round3-param]`` -> (``path::name[param]``, 3); ``name[round3]`` ->
    ``name``."""
    m = _ROUND.search(node_id)
    if not m:
        return node_id, 0
    k = int(next(g for g in m.groups() if g is not None))
    keep = "" if m.group(1) else ("[" if m.group(2) else "")
    return node_id[:m.start()] + keep + node_id[m.end():], k


def main(seed_log: str, junit: str, out: str) -> int:
    seeds = collections.defaultdict(list)
    with open(seed_log) as f:
        for line in f:
            node, seed = line.rstrip("\n").split("\t")
            seeds[node].append(int(seed))
    rows: dict[str, dict] = {}
    crashed = 0
    outcome: dict[str, bool] = {}  # node id -> passed (a node may have several cases:
    for case in ET.parse(junit).getroot().iter("testcase"):  # call, teardown, a crash)
        if case.get("name") is None:  # a worker that died: pytest-xdist names no test
            crashed += 1
            continue
        if case.find("skipped") is not None:
            continue
        # junit's classname is the module's dotted path (tests here are module functions).
        node = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name")
        ok = case.find("failure") is None and case.find("error") is None
        outcome[node] = outcome.get(node, True) and ok
    for node, ok in outcome.items():
        drawn = seeds.get(node, [])
        if not drawn:  # its seeds came from a module-scoped fixture: not this round's
            continue
        test, _ = _test_of(node)
        row = rows.setdefault(test, {"rounds": 0, "passed": 0, "seeds": set(),
                                     "failed_seeds": []})
        row["rounds"] += 1
        row["seeds"].update(drawn)
        if ok:
            row["passed"] += 1
        else:
            row["failed_seeds"].append(drawn)
    table = {t: {**r, "seeds": len(r["seeds"])} for t, r in sorted(rows.items())}
    with open(out, "w") as f:
        json.dump(table, f, indent=1)
    width = max((len(t) for t in table), default=10)
    print(f"{'test':<{width}}  rounds  passed  seeds")
    for t, r in table.items():
        print(f"{t:<{width}}  {r['rounds']:>6}  {r['passed']:>6}  {r['seeds']:>5}"
              + (f"  FAILED at seeds {r['failed_seeds']}" if r["failed_seeds"] else ""))
    bad = sum(r["rounds"] - r["passed"] for r in table.values())
    print(f"{len(table)} tests, {sum(r['rounds'] for r in table.values())} rounds, "
          f"{bad} failed" + (f"; {crashed} worker crashes (the run's output names the "
                             "tests)" if crashed else ""))
    return 1 if bad or crashed else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
