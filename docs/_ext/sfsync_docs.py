"""Sphinx extension of the sfsync site (docs/conf.py): GitHub's heading
anchors, Doxygen's XML of include/sfsync.h made before the build, and links
to repository files outside docs/ checked and pointed at the source."""
import os
import re
import subprocess

from docutils import nodes
from sphinx import addnodes
from sphinx.transforms import SphinxTransform
from sphinx.util import logging

here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # docs/
root = os.path.dirname(here)
log = logging.getLogger(__name__)


def github_slug(title):
    """The anchor GitHub gives a heading: lower case, punctuation but - and _
    dropped, each space a -."""
    slug = title.strip().lower()
    slug = re.sub(r"[^\w\- ]", "", slug)
    return slug.replace(" ", "-")


def _run_doxygen(app):
    out = app.config.sfsync_doxygen_dir
    os.makedirs(out, exist_ok=True)
    config = "\n".join([
        "PROJECT_NAME = sfsync",
        "INPUT = " + os.path.join(root, "include", "sfsync.h"),
        "OUTPUT_DIRECTORY = " + out,
        "GENERATE_XML = YES", "GENERATE_HTML = NO", "GENERATE_LATEX = NO",
        "OPTIMIZE_OUTPUT_FOR_C = YES", "EXTRACT_ALL = YES", "JAVADOC_AUTOBRIEF = YES",
        "ENABLE_PREPROCESSING = YES", "MACRO_EXPANSION = YES", "EXPAND_ONLY_PREDEF = YES",
        "PREDEFINED = SF_API=", "EXTENSION_MAPPING = h=C",
        "INCLUDE_GRAPH = NO", "INCLUDED_BY_GRAPH = NO", "HAVE_DOT = NO",
        "SHOW_INCLUDE_FILES = NO", "TYPEDEF_HIDES_STRUCT = YES",
        # The header documents its parameters in prose, not with @param.
        "QUIET = YES", "WARN_IF_DOC_ERROR = NO", "WARN_IF_INCOMPLETE_DOC = NO", "WARN_NO_PARAMDOC = NO",
    ])
    done = subprocess.run(["doxygen", "-"], input=config.encode(), capture_output=True)
    if done.returncode != 0:
        raise RuntimeError("doxygen failed: " + done.stderr.decode(errors="replace"))
    for line in done.stderr.decode(errors="replace").splitlines():
        log.warning("doxygen: %s", line)


def _headings(path):
    """GitHub's anchors of a Markdown file's headings (outside code fences)."""
    out, fenced = set(), False
    for line in open(path, encoding="utf-8"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(github_slug(line.lstrip("#").replace("`", "")))
    return out


class SourceLinks(SphinxTransform):
    """A link to a repository file outside docs/ (../include/sfsync.h,
    ../samples/c) must name one that exists (else a warning, which -W makes
    an error); it then goes to sfsync_source_url + the path, or is shown as
    the link text. Runs while reading, before MyST's resolver would call a
    folder a missing reference and Sphinx would copy a file as a download."""

    default_priority = 500

    def apply(self, **kwargs):
        src_dir = os.path.dirname(str(self.env.doc2path(self.env.docname)))
        for node in list(self.document.findall(
                lambda n: isinstance(n, (addnodes.pending_xref, addnodes.download_reference)))):
            if node.get("reftype") != "myst" or node.get("refdomain") not in (None, "", "doc"):
                continue
            target = node["reftarget"].split("#", 1)[0]
            anchor = node.get("reftargetid") or ""
            if node.get("refdomain") == "doc":
                # MyST names a Markdown file by its docname: outside docs/
                # that is an absolute path without the suffix.
                if not os.path.isabs(target):
                    continue
                target += ".md"
            full = os.path.normpath(os.path.join(src_dir, target))
            if not full.startswith(root + os.sep) or full.startswith(here + os.sep):
                continue
            rel = os.path.relpath(full, root)
            if not os.path.exists(full):
                log.warning("link to %s: no such file or folder in the repository", rel, location=node)
            elif anchor and full.endswith(".md") and anchor not in _headings(full):
                log.warning("link to %s#%s: no heading with that anchor", rel, anchor, location=node)
            url = self.config.sfsync_source_url
            if url:
                new = nodes.reference("", "", *node.children, refuri=url.rstrip("/") + "/" + rel)
            else:
                new = nodes.inline("", "", *node.children, classes=["source-path"])
            node.replace_self(new)


_BARE_UNDERSCORE = re.compile(r"(?<![\w`*|])([A-Za-z]\w*_)(?![\w`])")


def _plain_docstring(app, what, name, obj, options, lines):
    """The package's docstrings are written for help() and read as
    reStructuredText here: a bare word ending in "_" (clip_grad_norm_,
    zero_grad_) would be a reference to a missing target; keep it a word.
    Inline literals (``...``) are left as they are, but for a blank at their
    end, which reStructuredText does not allow (``sfsync-run: ``)."""
    for i, line in enumerate(lines):
        parts = line.split("``")
        for k in range(1, len(parts) - 1, 2):  # inside ``...``
            parts[k] = parts[k].rstrip()
        for k in range(0, len(parts), 2):  # outside ``...``
            parts[k] = _BARE_UNDERSCORE.sub(lambda m: m.group(1)[:-1] + "\\_", parts[k])
        lines[i] = "``".join(parts)


def setup(app):
    app.add_config_value("sfsync_doxygen_dir", "", "env")
    app.add_config_value("sfsync_source_url", "", "env")
    app.connect("builder-inited", _run_doxygen)
    app.add_transform(SourceLinks)
    app.connect("autodoc-process-docstring", _plain_docstring)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
