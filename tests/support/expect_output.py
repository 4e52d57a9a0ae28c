#!/usr/bin/env python3
"""A test's verdict from its exit status AND its output (CTest ignores the
exit status once PASS_REGULAR_EXPRESSION is set: a rank that crashes after
its peer printed the expected line would pass). Used by
sf_add_checked_test (tests/support/checked_test.cmake).

usage: expect_output.py [--line RE]... [--expect RE]... [--reject RE]...
                        [--exit N] [--skip-code N] -- command [args...]

Runs the command (stdout and stderr together, echoed as they come) and
passes only if it exits 0 (or N: a test of a failure says which failure),
every --line RE matches some line of the
output on its own, every --expect RE matches the whole output (CTest's
PASS_REGULAR_EXPRESSION: `.` also matches a newline) and no --reject RE
matches it. Exit status --skip-code (77 where the test sets
SKIP_RETURN_CODE) is passed through as a skip. Each failure is named.
"""

import re
import subprocess
import sys


def main(argv):
    lines, expects, rejects, skip_code, want = [], [], [], None, 0
    i = 0
    while i < len(argv) and argv[i] != "--":
        opt = argv[i]
        if opt not in ("--line", "--expect", "--reject", "--skip-code", "--exit") or i + 1 >= len(argv):
            print(f"expect_output: bad argument {opt!r}", file=sys.stderr)
            return 2
        value = argv[i + 1]
        if opt == "--line":
            lines.append(value)
        elif opt == "--expect":
            expects.append(value)
        elif opt == "--reject":
            rejects.append(value)
        elif opt == "--exit":
            want = int(value)
        else:
            skip_code = int(value)
        i += 2
    command = argv[i + 1:]
    if not command:
        print("expect_output: no command after --", file=sys.stderr)
        return 2
    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except OSError as e:
        print(f"expect_output: FAIL: cannot run {command[0]}: {e}")
        return 1
    chunks = []
    for raw in iter(proc.stdout.readline, b""):
        sys.stdout.buffer.write(raw)
        sys.stdout.flush()
        chunks.append(raw)
    rc = proc.wait()
    output = b"".join(chunks).decode("utf-8", "replace")
    if skip_code is not None and rc == skip_code:
        print(f"expect_output: skipped (exit status {rc})")
        return rc
    failures = []
    if rc < 0:
        failures.append(f"killed by signal {-rc}")
    elif rc != want:
        failures.append(f"exit status {rc}, not {want}")
    out_lines = output.splitlines()
    for pattern in lines:
        if not any(re.search(pattern, line) for line in out_lines):
            failures.append(f"no line matches {pattern!r}")
    for pattern in expects:
        if not re.search(pattern, output, re.S):
            failures.append(f"the output does not match {pattern!r}")
    for pattern in rejects:
        m = re.search(pattern, output, re.S)
        if m:
            failures.append(f"the output matches {pattern!r} ({m.group(0)[:200]!r})")
    for f in failures:
        print(f"expect_output: FAIL: {f}")
    if failures:
        return 1
    print(f"expect_output: OK (exit status {rc}, {len(lines)} lines, {len(expects)} patterns, "
          f"{len(rejects)} rejected patterns absent)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
