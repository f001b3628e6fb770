#!/usr/bin/env python3
"""Worst |error| / tolerance per (class, dtype) over `samebits verify --json` outputs.

Usage: tools/contract_margins.py OUT1.json [OUT2.json ...]
Used to set and re-check the tolerances in docs/contract.json (see docs/contract.md).
"""
import collections
import json
import re
import sys

worst = collections.defaultdict(lambda: (0.0, ""))
for path in sys.argv[1:]:
    for case in json.load(open(path))["cases"]:
        for direction in ("forward", "backward"):
            for r in case[direction]["accuracy"]["reports"]:
                m = re.match(r"accuracy \((\w+), (\w+)\)", r["check"])
                key = (m.group(1), m.group(2))
                if r["worst_err_over_tol"] >= worst[key][0]:
                    worst[key] = (r["worst_err_over_tol"], f'{case["case"]} / {r["tensor"]}')
for (cls, dt), (ratio, where) in sorted(worst.items()):
    print(f"| {cls} | {dt} | {ratio:.3f} | {where} |")
