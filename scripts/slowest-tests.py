#!/usr/bin/env python3
"""Reads the test runner's JUnit file (target/nextest/default/junit.xml).

  slowest-tests.py [--count N] JUNIT          the N (15) slowest tests, with their times
  slowest-tests.py --summary JUNIT [DOCLOG]   one line: "forkvm: P passed, F failed,
                                              S skipped", doc tests (cargo's log) added
"""
import argparse
import re
import sys
import xml.etree.ElementTree as ET


def cases(path):
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        sys.exit(f"slowest-tests: cannot read {path}: {e}")
    for suite in root.iter("testsuite"):
        for case in suite.iter("testcase"):
            yield suite.get("name", ""), case


def outcome(case):
    if case.find("failure") is not None or case.find("error") is not None:
        return "failed"
    if case.find("skipped") is not None:
        return "skipped"
    return "passed"


def summary(junit, doclog):
    n = {"passed": 0, "failed": 0, "skipped": 0}
    for _, case in cases(junit):
        n[outcome(case)] += 1
    if doclog:
        with open(doclog, errors="replace") as f:
            for line in f:
                m = re.match(r"test result: \w+\. (\d+) passed; (\d+) failed; (\d+) ignored", line)
                if m:
                    n["passed"] += int(m[1])
                    n["failed"] += int(m[2])
                    n["skipped"] += int(m[3])
    print(f"forkvm: {n['passed']} passed, {n['failed']} failed, {n['skipped']} skipped")


def slowest(junit, count):
    rows = sorted(
        ((float(c.get("time", 0)), suite, c.get("name", ""), outcome(c)) for suite, c in cases(junit)),
        reverse=True,
    )
    total = sum(r[0] for r in rows)
    print(f"slowest {min(count, len(rows))} of {len(rows)} tests ({total:.0f} s of test time in all):")
    for secs, suite, name, result in rows[:count]:
        mark = "" if result == "passed" else f"  [{result}]"
        print(f"  {secs:8.1f} s  {suite} {name}{mark}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--summary", action="store_true")
    p.add_argument("--count", type=int, default=15)
    p.add_argument("junit")
    p.add_argument("doclog", nargs="?")
    a = p.parse_args()
    if a.summary:
        summary(a.junit, a.doclog)
    else:
        slowest(a.junit, a.count)


if __name__ == "__main__":
    main()
