"""Which of gdtool's kernel paths passed their cuda tests: read the JSON lines the test run wrote under
GDTOOL_KERNEL_PATHS=FILE (tests/conftest.py), one per test with its outcome and the paths it ran on CUDA.

    GDTOOL_KERNEL_PATHS=paths.jsonl python -m pytest -m cuda tests/...
    python profiles/kernel_paths.py paths.jsonl

A path passed when at least one test ran it and every test that ran it passed; those are the names that
may go into `gdtool.kernels.triton.CUDA_TESTED`. Prints the passed paths as a Python set, then each
failed path with its failing tests, then each failed test (kernel path or none) with why it failed, as the test
session recorded it: a run stopped by its time limit prints no pytest summary, and this is where the reasons are.
Exits 1 when any test failed.
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict


def read(lines) -> tuple[list[str], dict[str, list[str]]]:
    """(passed paths, {failed path: [failing tests]}) from the JSON lines of one or more test runs."""
    ran, failing = defaultdict(list), defaultdict(list)
    for line in lines:
        if not line.strip():
            continue
        rec = json.loads(line)
        for path in rec["paths"]:
            ran[path].append(rec["outcome"])
            if rec["outcome"] == "failed":
                failing[path].append(rec["test"])
    passed = sorted(p for p, outcomes in ran.items() if "passed" in outcomes and p not in failing)
    return passed, dict(failing)


def failed_tests(lines) -> dict[str, str]:
    """{failed test: why} (the failure's last lines as tests/conftest.py kept them; '' from older files)."""
    records = (json.loads(line) for line in lines if line.strip())
    return {rec["test"]: rec.get("why", "") for rec in records if rec["outcome"] == "failed"}


def main(argv=None) -> int:
    files = (argv if argv is not None else sys.argv[1:]) or ["-"]
    lines = []
    for name in files:
        try:
            lines += (sys.stdin if name == "-" else open(name)).read().splitlines()
        except FileNotFoundError:
            print(f"{name}: no such file: the cuda tests write it where GDTOOL_KERNEL_PATHS names it, on a machine "
                  "with CUDA (without one they skip and write nothing)", file=sys.stderr)
            return 2
    passed, failing = read(lines)
    print("passed: {" + "".join(f"\n    {p!r}," for p in passed) + "\n}")
    for path, tests in sorted(failing.items()):
        print(f"FAILED {path!r}: {', '.join(tests)}")
    failed = failed_tests(lines)
    for test, why in failed.items():
        print(f"\nFAILED {test}" + "".join(f"\n    {line}" for line in (why or "(no reason recorded)").splitlines()))
    return 1 if failing or failed else 0


if __name__ == "__main__":
    sys.exit(main())
