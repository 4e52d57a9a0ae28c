#!/usr/bin/env python3
"""Pools the tests of several build trees into one ctest run, so that one
`ctest -j N` keeps N slots busy across all of them (scripts/test.sh runs the
normal tree's whole suite and the ASan and TSan trees' unit suites this way,
instead of one after the other, each with a tail where one slot idles).

  pool_ctest_trees.py OUT [--first TREE] [--label L] [--after-build SECONDS]
                      TREE=TAG [TREE=TAG ...]
  (cd OUT && ctest -j 2)

OUT/CTestTestfile.cmake lists one folder per TREE=TAG, OUT/TAG, which mirrors
the tree's CTestTestfile.cmake files with every test renamed TAG:NAME, and
every fixture and test dependency TAG:NAME too. The trees share test names
(the same sources), and ctest sets a property on every test of a name, so
without the renames one tree's environment (its stand-in libraries'
LD_LIBRARY_PATH) would land on the other's tests. Commands, working folders
and every other property are the tree's own (absolute paths): the tests run
in their trees.

--first TREE     TREE's own tests, names unchanged, listed first (a subdirs()
                 line to TREE itself).
--label L        of the TAG trees, only the tests labelled L.
--after-build S  each TAG tree's test waits for that tree's build first
                 (tests/support/after_build.sh: TREE.lock, which scripts/test.sh's
                 background build holds until the tree is built), at most S
                 seconds, added to its TIMEOUT; its COST drops by 10000, so
                 that ctest starts it after every one-slot --first test (in
                 their order of COST among themselves); and it DEPENDS on every
                 --first test that takes more than one slot (PROCESSORS), but
                 those with a negative COST (started last on purpose). Without
                 that, ctest -j2 starts a one-slot test whenever a slot frees,
                 and the two-slot tests waited for the last pooled test, while
                 the pooled tests had started before their builds were done.
--label-after L  the --first tests labelled L DEPEND on those same tests too
                 (scripts/test.sh: the fuzz tests, which wait for the ASan
                 tree's build themselves).
"""
import os
import re
import sys

NAME = re.compile(r"^(add_test|set_tests_properties)\(\[(=*)\[(.*?)\]\2\]", re.M)
LISTS = re.compile(r'\b(FIXTURES_SETUP|FIXTURES_REQUIRED|FIXTURES_CLEANUP|DEPENDS) "([^"]*)"')
TEST = re.compile(r"^(add_test|set_tests_properties)\(\[(=*)\[(.*?)\]\2\](.*)\)$", re.S)
HERE = os.path.dirname(os.path.abspath(__file__))
LATER = 10000  # --after-build: COST drop


def renamed(text, tag):
    text = NAME.sub(lambda m: "%s([%s[%s:%s]%s]" % (m.group(1), m.group(2), tag, m.group(3),
                                                   m.group(2)), text)
    return LISTS.sub(lambda m: '%s "%s"' % (
        m.group(1), ";".join("%s:%s" % (tag, v) for v in m.group(2).split(";") if v)), text)


def commands(text):
    """text cut into its commands (the comments and blank lines before one
    kept with it; a quoted argument may hold newlines), and what follows the last."""
    out, i, n, begin = [], 0, len(text), 0
    while i < n:
        c = text[i]
        if c == "#":
            i = text.find("\n", i)
            i = n if i < 0 else i + 1
        elif c == "(":
            depth, i = 1, i + 1
            while depth:
                c = text[i]
                if c == '"':
                    i += 1
                    while text[i] != '"':
                        i += 2 if text[i] == "\\" else 1
                elif c == "[" and re.match(r"\[=*\[", text[i:i + 64]):
                    eq = re.match(r"\[(=*)\[", text[i:i + 64]).group(1)
                    i = text.index("]%s]" % eq, i + 2) + len(eq) + 1
                elif c == "(":
                    depth += 1
                elif c == ")":
                    depth -= 1
                i += 1
            out.append(text[begin:i])
            begin = i
        else:
            i += 1
    return out, text[begin:]


def tests_of(text):
    """[(command, kind, test name)] for text's commands (kind and name None
    for other commands), and what follows the last."""
    cmds, tail = commands(text)
    parsed = []
    for c in cmds:
        m = TEST.match(re.sub(r"^\s*(#[^\n]*\n\s*)*", "", c).rstrip())
        parsed.append((c, m.group(1) if m else None, m.group(3) if m else None))
    return parsed, tail


def labelled(text, label):
    """text without the tests (add_test, set_tests_properties) not labelled label."""
    parsed, tail = tests_of(text)
    keep = set()
    for c, kind, name in parsed:
        labels = re.search(r'\bLABELS "([^"]*)"', c) if kind == "set_tests_properties" else None
        if labels and label in labels.group(1).split(";"):
            keep.add(name)
    return "".join(c for c, kind, name in parsed if kind is None or name in keep) + tail


def properties_of(tree):
    """{test name: its set_tests_properties command} over tree's CTestTestfiles."""
    props = {}
    for folder, _, files in os.walk(tree):
        if "CTestTestfile.cmake" not in files:
            continue
        with open(os.path.join(folder, "CTestTestfile.cmake")) as f:
            parsed, _ = tests_of(f.read())
        props.update((name, c) for c, kind, name in parsed if kind == "set_tests_properties")
    return props


def multi_slot(props):
    """Of props (properties_of), the tests that take more than one slot
    (PROCESSORS > 1) and have no negative COST."""
    names = []
    for name, c in props.items():
        procs = re.search(r'\bPROCESSORS "([0-9]+)"', c)
        cost = re.search(r'\bCOST "(-?[0-9.]+)"', c)
        if procs and int(procs.group(1)) > 1 and not (cost and float(cost.group(1)) < 0):
            names.append(name)
    return sorted(names)


def labelled_after(props, label, before):
    """set_tests_properties commands that make props' tests labelled label
    DEPEND on before too (their own DEPENDS kept)."""
    out = []
    for name, c in sorted(props.items()):
        labels = re.search(r'\bLABELS "([^"]*)"', c)
        if labels and label in labels.group(1).split(";"):
            dep = re.search(r'\bDEPENDS "([^"]*)"', c)
            deps = (dep.group(1).split(";") if dep else []) + before
            out.append('set_tests_properties([=[%s]=] PROPERTIES DEPENDS "%s")\n'
                       % (name, ";".join(deps)))
    return "".join(out)


def after_build(text, lock, seconds, depends=()):
    """Each test of text waits for lock first (tests/support/after_build.sh),
    at most seconds, added to its TIMEOUT; its COST drops by LATER; and it
    DEPENDS on the tests named in depends."""
    extra_dep = ";".join(depends)
    wrap = '"%s" "%s" "%d" ' % (os.path.join(HERE, "after_build.sh"), lock, seconds)
    parsed, tail = tests_of(text)
    out, names, props = [], set(), set()
    for c, kind, name in parsed:
        if kind == "add_test":
            names.add(name)
            m = re.search(r"^add_test\(\[(=*)\[.*?\]\1\]\s*", c, re.M | re.S)
            c = c[:m.end()] + wrap + c[m.end():]
        elif kind == "set_tests_properties":
            props.add(name)
            timeout = re.search(r'\bTIMEOUT "([0-9.]+)"', c)
            if timeout:
                c = c.replace(timeout.group(0),
                              'TIMEOUT "%g"' % (float(timeout.group(1)) + seconds), 1)
            else:
                c = c.replace(" PROPERTIES ", ' PROPERTIES TIMEOUT "%d" ' % (1500 + seconds), 1)
            cost = re.search(r'\bCOST "(-?[0-9.]+)"', c)
            if cost:
                c = c.replace(cost.group(0), 'COST "%g"' % (float(cost.group(1)) - LATER), 1)
            else:
                c = c.replace(" PROPERTIES ", ' PROPERTIES COST "%d" ' % -LATER, 1)
            if extra_dep:
                dep = re.search(r'\bDEPENDS "([^"]*)"', c)
                if dep:
                    c = c.replace(dep.group(0), 'DEPENDS "%s;%s"' % (dep.group(1), extra_dep), 1)
                else:
                    c = c.replace(" PROPERTIES ", ' PROPERTIES DEPENDS "%s" ' % extra_dep, 1)
        out.append(c)
    # A test with no properties of its own still starts late and has its timeout.
    out += ['\nset_tests_properties([=[%s]=] PROPERTIES TIMEOUT "%d" COST "%d"%s)'
            % (n, 1500 + seconds, -LATER, ' DEPENDS "%s"' % extra_dep if extra_dep else "")
            for n in sorted(names - props)]
    return "".join(out) + tail + "\n"


def main(argv):
    args, first, label, wait, label_after = argv[1:], None, None, None, None
    out = None
    trees = []
    while args:
        a = args.pop(0)
        if a in ("--first", "--label", "--after-build", "--label-after") and args:
            v = args.pop(0)
            if a == "--first":
                first = os.path.abspath(v)
            elif a == "--label":
                label = v
            elif a == "--label-after":
                label_after = v
            else:
                wait = int(v)
        elif out is None and "=" not in a and not a.startswith("--"):
            out = os.path.abspath(a)
        elif "=" in a:
            trees.append(a)
        else:
            sys.exit(__doc__)
    if out is None or not trees:
        sys.exit(__doc__)
    tags = []
    first_props = properties_of(first) if first else {}
    before = multi_slot(first_props) if wait is not None else []
    for arg in trees:
        tree, tag = arg.rsplit("=", 1)
        tree = os.path.abspath(tree)
        if not re.fullmatch(r"[A-Za-z0-9_-]+", tag) or tag in tags:
            sys.exit("pool_ctest_trees.py: tag %r: letters, digits, - and _, once each" % tag)
        for t in [tree] + ([first] if first else []):
            if not os.path.isfile(os.path.join(t, "CTestTestfile.cmake")):
                sys.exit("pool_ctest_trees.py: %s has no CTestTestfile.cmake (not a configured "
                         "build tree)" % t)
        tags.append(tag)
        for folder, _, files in os.walk(tree):
            if "CTestTestfile.cmake" not in files:
                continue
            rel = os.path.relpath(folder, tree)
            dest = os.path.normpath(os.path.join(out, tag, rel))
            os.makedirs(dest, exist_ok=True)
            with open(os.path.join(folder, "CTestTestfile.cmake")) as f:
                text = f.read()
            if label:
                text = labelled(text, label)
            text = renamed(text, tag)
            if wait is not None:
                text = after_build(text, tree + ".lock", wait, before)
            with open(os.path.join(dest, "CTestTestfile.cmake"), "w") as f:
                f.write(text)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "CTestTestfile.cmake"), "w") as f:
        f.write("# pool_ctest_trees.py: %s\n" % " ".join(argv[1:]))
        if first:
            f.write('subdirs("%s")\n' % first)
        f.write("".join('subdirs("%s")\n' % t for t in tags))
        if label_after and before:
            f.write(labelled_after(first_props, label_after, before))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
