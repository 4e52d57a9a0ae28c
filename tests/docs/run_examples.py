#!/usr/bin/env python3
"""docs_examples: the code blocks of README.md and docs/*.md, run as written.

Every ```sh, ```bash, ```python and ```c block carries a marker, an HTML
comment on the line before it (invisible on GitHub and on the site):

  <!-- docs-test: run -->                 run it: sh/bash with bash -e,
                                          python with /usr/bin/python3
                                          (Debian's torch 1.13), c compiled,
                                          linked against libsfsync and run
  <!-- docs-test: run ranks=2 -->         the same under sfsync-run -n 2
  <!-- docs-test: compile PRELUDE -->     a C fragment: compiled (and linked)
                                          as the body of a function after
                                          PRELUDE (a file under tests/docs/)
  <!-- docs-test: skip REASON -->         not run here, and why (a GPU, a
                                          cluster, minutes of build)

An unmarked block of those languages, a skip without a reason, and a marked
block that fails (exit status, compiler error) fail the test. Blocks run in
a scratch folder that looks like the checkout (each top-level entry linked)
with build/ being the CMake tree the test was configured in, so that
`build/plugin/tools/sfsync-run` and `python/` mean what the pages say.
Python blocks get the source tree's development override
(PYTHONPATH=python SFSYNC_LIBRARY=build/plugin/libsfsync.so.1).

  run_examples.py --source DIR --build DIR [--only FILE[:LINE]] [--list]
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

CHECKED = {"sh", "bash", "python", "c"}
MARK = re.compile(r"^<!--\s*docs-test:\s*(run|compile|skip)\b\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,})\s*([\w+-]*)")


def blocks(path):
    """(line, language, marker, argument, code) of each fenced block."""
    lines = open(path, encoding="utf-8").read().split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        start = i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        prev = start - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        mark = MARK.match(lines[prev].strip()) if prev >= 0 else None
        yield (start + 1, lang, mark.group(1) if mark else None, mark.group(2) if mark else "",
               "\n".join(body) + "\n")


def scratch_tree(source, build):
    """A folder whose entries are the checkout's, build/ the test's tree."""
    tmp = tempfile.mkdtemp(prefix="sfsync-docs-")
    for name in os.listdir(source):
        if name == "build" or name.startswith("build-") or name == ".git":
            continue
        os.symlink(os.path.join(source, name), os.path.join(tmp, name))
    os.symlink(build, os.path.join(tmp, "build"))
    return tmp


def run(cmd, cwd, env, timeout=60):
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       timeout=timeout)
    return p.returncode, p.stdout.decode(errors="replace"), time.monotonic() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True)
    ap.add_argument("--build", required=True)
    ap.add_argument("--cc", default="cc")
    ap.add_argument("--only", help="FILE or FILE:LINE (relative to --source)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="print each block's output")
    args = ap.parse_args()
    source, build = os.path.abspath(args.source), os.path.abspath(args.build)
    files = ["README.md"] + sorted(
        os.path.join("docs", f) for f in os.listdir(os.path.join(source, "docs")) if f.endswith(".md"))
    tree = scratch_tree(source, build)
    env = dict(os.environ, PYTHONPATH="python", SFSYNC_LIBRARY="build/plugin/libsfsync.so.1",
               PYTHONDONTWRITEBYTECODE="1")
    env.pop("SF_RANK", None)
    failures, counts = [], {"run": 0, "compile": 0, "skip": 0}
    try:
        for rel in files:
            for line, lang, mark, arg, code in blocks(os.path.join(source, rel)):
                where = "%s:%d" % (rel, line)
                if args.only and args.only not in (rel, where):
                    continue
                if lang not in CHECKED:
                    continue
                if args.list:
                    print("%-28s %-7s %-8s %s" % (where, lang, mark, arg))
                    continue
                if mark is None:
                    failures.append("%s: a ```%s block with no <!-- docs-test: ... --> marker" % (where, lang))
                    continue
                counts[mark] += 1
                if mark == "skip":
                    if not arg:
                        failures.append("%s: docs-test: skip needs a reason" % where)
                    continue
                rc, out, took = run_block(tree, build, args.cc, env, where, lang, mark, arg, code)
                status = "ok" if rc == 0 else "FAILED (exit %d)" % rc
                print("%s %s %s %.1f s: %s" % (where, lang, mark, took, status), flush=True)
                if args.verbose:
                    print(out, flush=True)
                if rc != 0:
                    failures.append("%s: the ```%s block failed (exit %d):\n%s" % (where, lang, rc, out[-3000:]))
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    if args.list:
        return 0
    print("docs_examples: %d run, %d compiled, %d marked not run here" %
          (counts["run"], counts["compile"], counts["skip"]))
    for f in failures:
        print("FAIL " + f)
    return 1 if failures else 0


def run_block(tree, build, cc, env, where, lang, mark, arg, code):
    ranks = 1
    m = re.match(r"ranks=(\d+)", arg) if mark == "run" else None
    if m:
        ranks = int(m.group(1))
    work = tempfile.mkdtemp(prefix="block-", dir=tree)
    try:
        launcher = ["build/plugin/tools/sfsync-run", "-n", str(ranks), "--"] if ranks > 1 else []
        if lang in ("sh", "bash"):
            path = os.path.join(work, "block.sh")
            open(path, "w").write(code)
            return run(launcher + ["bash", "-e", path], tree, env)
        if lang == "python":
            path = os.path.join(work, "block.py")
            open(path, "w").write(code)
            return run(launcher + ["/usr/bin/python3", path], tree, env)
        # c
        path = os.path.join(work, "block.c")
        if mark == "compile":
            prelude = os.path.join(os.path.dirname(os.path.abspath(__file__)), arg)
            code = '#include "%s"\nvoid sf_docs_fragment(void) {\n%s}\n' % (prelude, code)
        open(path, "w").write(code)
        exe = os.path.join(work, "block")
        cmd = [cc, "-std=c99", "-Wall", "-Werror=implicit-function-declaration",
               "-Werror=incompatible-pointer-types", "-Werror=int-conversion",
               "-I" + os.path.join(tree, "include"), path,
               "-L" + os.path.join(build, "plugin"), "-lsfsync", "-lm",
               "-Wl,-rpath," + os.path.join(build, "plugin"), "-o", exe]
        if mark == "compile":
            cmd[cmd.index(path)] = path
            cmd += ["-Wno-unused-variable", "-Wno-unused-but-set-variable", "-Wno-unused-function"]
        rc, out, took = run(cmd, tree, env)
        if rc != 0 or mark == "compile":
            return rc, out, took
        rc, out2, took2 = run(launcher + [exe], tree, env)
        return rc, out + out2, took + took2
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
