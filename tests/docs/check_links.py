#!/usr/bin/env python3
"""The links of Markdown files outside the site (README.md, CHANGELOG.md):
every relative link names a file or folder of the repository, and every
#anchor a heading of the page it points into (GitHub's anchors, as the site's
myst_heading_slug_func makes them). The site's own pages are checked by
Sphinx itself (docs_site).   check_links.py FILE.md..."""
import os
import re
import sys

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def slug(title):
    s = title.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path):
    out, fenced = set(), False
    for line in open(path, encoding="utf-8"):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = re.sub(r"`", "", line.lstrip("#").strip())
            out.add(slug(title))
    return out


def main(files):
    bad = []
    for path in files:
        base = os.path.dirname(os.path.abspath(path))
        fenced = False
        for n, line in enumerate(open(path, encoding="utf-8"), 1):
            if FENCE.match(line):
                fenced = not fenced
            if fenced:
                continue
            for m in LINK.finditer(line):
                url = m.group(1) or m.group(2)
                if re.match(r"^[a-z][a-z0-9+.-]*:", url):
                    continue
                target, _, anchor = url.partition("#")
                full = os.path.normpath(os.path.join(base, target)) if target else os.path.abspath(path)
                if not os.path.exists(full):
                    bad.append("%s:%d: %s: no such file" % (path, n, url))
                elif anchor and full.endswith(".md") and anchor not in anchors(full):
                    bad.append("%s:%d: %s: no heading with that anchor" % (path, n, url))
    for b in bad:
        print("FAIL " + b)
    print("check_links: %d file(s), %d broken link(s)" % (len(files), len(bad)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
