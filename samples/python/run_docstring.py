"""Runs the command a sample's docstring gives, exactly as written, the way a
reader pastes it at the root of a checkout built in build/: in a scratch
directory holding python/ and samples/ of this checkout and build/ (links to
the build tree BUILD), with no PYTHONPATH or SFSYNC_LIBRARY from the caller.
Exits with the command's status.

    run_docstring.py --build BUILD [--python PY] SAMPLE.py

--python PY stands for the command's /usr/bin/python3 (the torch 2.x run
of the sample: the reader's own interpreter); the command must name it.
"""

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def docstring_command(path):
    """The first indented line of the module docstring (with the lines it
    continues with a trailing backslash): the command."""
    with open(path) as f:
        doc = ast.get_docstring(ast.parse(f.read()), clean=False) or ""
    lines, command = doc.splitlines(), []
    for i, line in enumerate(lines):
        if line.startswith("    ") and line.strip():
            for part in lines[i:]:
                command.append(part.strip().rstrip("\\").strip())
                if not part.rstrip().endswith("\\"):
                    return " ".join(command)
    sys.exit("run_docstring.py: %s: no indented command line in the docstring" % path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", required=True, help="the CMake build tree (stands for build/)")
    p.add_argument("--python", help="the interpreter the command's /usr/bin/python3 stands for")
    p.add_argument("sample")
    args = p.parse_args()
    command = docstring_command(args.sample)
    if args.python and args.python != "/usr/bin/python3":
        words = command.split(" ")
        if "/usr/bin/python3" not in words:
            sys.exit("run_docstring.py: %s: the command names no /usr/bin/python3 for --python: %s"
                     % (args.sample, command))
        command = " ".join(args.python if w == "/usr/bin/python3" else w for w in words)
    scratch = tempfile.mkdtemp(prefix="sfsync-docstring-")
    try:
        for name in ("python", "samples"):
            os.symlink(os.path.join(ROOT, name), os.path.join(scratch, name))
        os.symlink(os.path.abspath(args.build), os.path.join(scratch, "build"))
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "SFSYNC_LIBRARY", "LD_LIBRARY_PATH")}
        print("+ (cd <checkout>; %s)" % command, flush=True)
        return subprocess.call(["/bin/sh", "-c", command], cwd=scratch, env=env)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
