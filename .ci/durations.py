#!/usr/bin/env python3
"""The suite's time per test file and its slowest tests, from pytest's JUnit XML (``--junitxml``), as markdown.

``python .ci/durations.py REPORT.xml [N]``: one row per file (tests, seconds summed over setup, call and
teardown: core-seconds, whatever the number of workers), then the N (25) slowest tests. ``.ci/run`` prints it
after each pytest run; docs/testing.md keeps the table of the last quiet-machine run.
"""
import collections
import sys
import xml.etree.ElementTree as ET


def main(path: str, slowest: int = 25) -> None:
    per_file, count, tests = collections.Counter(), collections.Counter(), []
    for case in ET.parse(path).getroot().iter("testcase"):
        parts = (case.get("classname") or "?").split(".")  # tests.test_x[.TestClass]
        name = "/".join(parts[:next((i + 1 for i, p in enumerate(parts) if p.startswith("test_")), len(parts))]) + ".py"
        seconds = float(case.get("time") or 0)
        per_file[name] += seconds
        count[name] += 1
        tests.append((seconds, f"{name}::{case.get('name')}"))
    print(f"| file | tests | seconds |\n|---|---:|---:|")
    for name, seconds in per_file.most_common():
        print(f"| {name} | {count[name]} | {seconds:.1f} |")
    print(f"| total | {sum(count.values())} | {sum(per_file.values()):.1f} |\n")
    print(f"| {slowest} slowest tests | seconds |\n|---|---:|")
    for seconds, test in sorted(tests, reverse=True)[:slowest]:
        print(f"| {test} | {seconds:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:3]))
