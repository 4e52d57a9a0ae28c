#!/usr/bin/env python3
"""Pools the tests of several build trees into one ctest run, so that one
`ctest -j N` keeps N slots busy across all of them (scripts/test.sh runs the
ASan and the TSan trees' unit suites this way, instead of one tree after the
other, each with a tail where one slot idles).

  pool_ctest_trees.py OUT TREE=TAG [TREE=TAG ...]
  (cd OUT && ctest -j 2 -L unit)

OUT/CTestTestfile.cmake lists one folder per tree, OUT/TAG, which mirrors the
tree's CTestTestfile.cmake files with every test renamed TAG:NAME, and every
fixture and test dependency TAG:NAME too. The trees share test names (the
same sources), and ctest sets a property on every test of a name, so without
the renames one tree's environment (its stand-in libraries' LD_LIBRARY_PATH)
would land on the other's tests. Commands, working folders and every other
property are the tree's own (absolute paths): the tests run in their trees.
"""
import os
import re
import sys

NAME = re.compile(r"^(add_test|set_tests_properties)\(\[(=*)\[(.*?)\]\2\]", re.M)
LISTS = re.compile(r'\b(FIXTURES_SETUP|FIXTURES_REQUIRED|FIXTURES_CLEANUP|DEPENDS) "([^"]*)"')


def renamed(text, tag):
    text = NAME.sub(lambda m: "%s([%s[%s:%s]%s]" % (m.group(1), m.group(2), tag, m.group(3),
                                                   m.group(2)), text)
    return LISTS.sub(lambda m: '%s "%s"' % (
        m.group(1), ";".join("%s:%s" % (tag, v) for v in m.group(2).split(";") if v)), text)


def main(argv):
    if len(argv) < 3 or any("=" not in a for a in argv[2:]):
        sys.exit(__doc__)
    out = os.path.abspath(argv[1])
    tags = []
    for arg in argv[2:]:
        tree, tag = arg.rsplit("=", 1)
        tree = os.path.abspath(tree)
        if not re.fullmatch(r"[A-Za-z0-9_-]+", tag) or tag in tags:
            sys.exit("pool_ctest_trees.py: tag %r: letters, digits, - and _, once each" % tag)
        if not os.path.isfile(os.path.join(tree, "CTestTestfile.cmake")):
            sys.exit("pool_ctest_trees.py: %s has no CTestTestfile.cmake (not a configured "
                     "build tree)" % tree)
        tags.append(tag)
        for folder, _, files in os.walk(tree):
            if "CTestTestfile.cmake" not in files:
                continue
            rel = os.path.relpath(folder, tree)
            dest = os.path.normpath(os.path.join(out, tag, rel))
            os.makedirs(dest, exist_ok=True)
            with open(os.path.join(folder, "CTestTestfile.cmake")) as f:
                text = f.read()
            with open(os.path.join(dest, "CTestTestfile.cmake"), "w") as f:
                f.write(renamed(text, tag))
    with open(os.path.join(out, "CTestTestfile.cmake"), "w") as f:
        f.write("# pool_ctest_trees.py: %s\n" % " ".join(argv[2:]))
        f.write("".join('subdirs("%s")\n' % t for t in tags))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
