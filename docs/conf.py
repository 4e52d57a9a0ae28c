# Sphinx configuration of the sfsync documentation site (docs/*.md).
#
# Pages are Markdown (MyST-Parser); the C reference comes from
# include/sfsync.h through Doxygen (XML, run here at every build) and Breathe;
# the Python reference from the docstrings of python/sfsync with autodoc
# (Debian's torch imported; the trainer frameworks mocked).
# Versions: scripts/docs-venv.sh pins them. Build and checks: tests/docs
# (ctest -R docs_site), which runs sphinx-build -W --keep-going -n.
#
# Links from a page to a file of the repository outside docs/ (e.g.
# ../include/sfsync.h, ../samples/c) are checked here: the file must exist
# (else a warning, which fails the build) and the link goes to
# sfsync_source_url + the path when that is set, else it is shown as the
# path. Headings get GitHub's anchors, so that README.md's links into
# docs/ and the pages' own links agree on GitHub and on the site.
import os
import re
import sys

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(here)
sys.path.insert(0, os.path.join(root, "python"))
sys.path.insert(0, os.path.join(here, "_ext"))

project = "sfsync"
author = "the sfsync authors"
copyright = "the sfsync authors, Apache-2.0"


def _version():
    text = open(os.path.join(root, "include", "sfsync.h"), encoding="utf-8").read()
    parts = [re.search(r"#define SF_VERSION_%s (\d+)" % k, text).group(1) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(parts)


release = version = _version()

extensions = ["myst_parser", "breathe", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sfsync_docs"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_doxygen"]
html_theme = "alabaster"
html_title = "sfsync " + release
html_static_path = []

# MyST: GitHub's heading anchors (h1-h4), checked on every [x](page.md#anchor).
myst_heading_anchors = 4
myst_heading_slug_func = "sfsync_docs.github_slug"
myst_enable_extensions = []

# Breathe over Doxygen's XML of the public header.
doxygen_xml = os.path.join(os.environ.get("SF_DOCS_BUILD_DIR", os.path.join(here, "_build")), "doxygen")
breathe_projects = {"sfsync": os.path.join(doxygen_xml, "xml")}
breathe_default_project = "sfsync"
breathe_domain_by_extension = {"h": "c"}
breathe_show_define_initializer = True
breathe_show_include = False

# autodoc: the package's docstrings, imported with Debian's torch (the docs venv sees
# the system site packages); the frameworks mocked.
autodoc_mock_imports = ["accelerate", "lightning", "pytorch_lightning", "transformers"]
autodoc_member_order = "bysource"
autodoc_typehints = "none"

nitpicky = True
# What the C domain cannot resolve from the header alone: C's own and
# stdint's types.
nitpick_ignore = [("c:identifier", t) for t in (
    "int32_t", "int64_t", "uint64_t", "uint32_t", "uint16_t", "uint8_t", "size_t", "int8_t")]
# torch's base class, as a docstring's signature names it
nitpick_ignore += [("py:class", "Module")]
nitpick_ignore_regex = [
    # autodoc's references to mocked or standard-library classes
    (r"py:.*", r"(torch|numpy|accelerate|lightning|transformers|ctypes|typing|collections)\..*"),
]

# sfsync_docs (docs/_ext): runs Doxygen, checks links to repository files.
sfsync_doxygen_dir = doxygen_xml
sfsync_source_url = os.environ.get("SF_DOCS_SOURCE_URL", "")
