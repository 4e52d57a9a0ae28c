#!/usr/bin/env python3
"""Checks that a tree built with `--target sf_unit_tests` holds everything its
`unit` tests use: every path inside the build tree that a unit test's command,
arguments or environment names must exist (tests/support/unit_targets.cmake).

  check_unit_targets.py BUILD_DIR     (exit 1 and the missing files, else 0)
"""
import json
import os
import subprocess
import sys


def main():
    build = os.path.realpath(sys.argv[1])
    out = subprocess.run(["ctest", "-L", "unit", "--show-only=json-v1"], cwd=build,
                         check=True, capture_output=True, text=True).stdout
    tests = json.loads(out)["tests"]
    missing = []
    for t in tests:
        words = list(t.get("command", []))
        for p in t.get("properties", []):
            if p["name"] == "ENVIRONMENT":
                for kv in p["value"]:
                    words += kv.partition("=")[2].replace(";", ":").split(":")
        for w in words:
            if os.path.isabs(w) and os.path.realpath(w).startswith(build + os.sep) \
                    and not os.path.exists(w):
                missing.append(f"{t['name']}: {w}")
    if not tests:
        missing.append("no test labelled unit")
    if missing:
        print("check_unit_targets: not built (add its target with sf_unit_targets()):")
        print("\n".join("  " + m for m in missing))
        return 1
    print(f"check_unit_targets: the {len(tests)} unit tests' files are all built")
    return 0


if __name__ == "__main__":
    sys.exit(main())
