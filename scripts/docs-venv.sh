#!/usr/bin/env bash
# Makes (or reuses) the virtual environment that builds the documentation
# site (docs/: Sphinx with MyST-Parser for the Markdown pages and Breathe for
# the C reference, which Doxygen, a Debian package of
# scripts/install-deps.sh, reads from include/sfsync.h). Prints the venv's
# python on its last line; tests/docs (ctest -R docs_site) looks for it
# where this script puts it.
#
#   SF_DOCS_VENV   where it lives (default ~/.cache/sfsync/venv-docs,
#                  outside the checkout: clones share it)
#
# Versions are pinned (== each, the whole closure), so that a warning that
# fails the build (sphinx -W) comes from a change here, never from a new
# release. The venv is built from Debian's /usr/bin/python3 (3.11,
# python3-venv) with its system site packages, so that autodoc imports the
# package with Debian's torch 1.13 (python3-torch; sfsync.torch needs a real
# torch at import), while the pinned generator in the venv comes first. It is
# reused while its stamp (this file's package list) matches and its python
# imports the generator. About 120 MB; made from
# scratch (download included) in ~30 s. Two runs at once take turns on a lock.
set -euo pipefail
venv=${SF_DOCS_VENV:-$HOME/.cache/sfsync/venv-docs}
packages=(
  Sphinx==8.2.3 myst-parser==4.0.1 breathe==4.36.0
  # what those need (pip freeze of the three above), pinned too
  alabaster==1.0.0 babel==2.19.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3
  docutils==0.21.2 idna==3.20 imagesize==2.0.1 Jinja2==3.1.6 markdown-it-py==3.0.0
  MarkupSafe==3.0.4 mdit-py-plugins==0.7.0 mdurl==0.1.2 packaging==26.4 Pygments==2.21.0
  PyYAML==6.0.4 requests==2.34.2 roman-numerals==4.1.0 roman-numerals-py==4.1.0
  snowballstemmer==3.1.1 sphinxcontrib-applehelp==2.0.0 sphinxcontrib-devhelp==2.0.0
  sphinxcontrib-htmlhelp==2.1.0 sphinxcontrib-jsmath==2.0.0 sphinxcontrib-qthelp==2.0.0
  sphinxcontrib-serializinghtml==2.0.0 urllib3==2.8.0
)
source "$(dirname "$0")/cached-venv.sh"

make_docs() {  # VENV OLD_VERSIONS
  rm -rf "$1"
  /usr/bin/python3 -m venv --system-site-packages "$1" >&2
  "$1/bin/python" -m pip install -q --disable-pip-version-check --no-deps "${packages[@]}" >&2
}
cached_venv docs-venv "$venv" "system-site-packages ${packages[*]}" \
  'import sphinx, myst_parser, breathe; print("sphinx", sphinx.__version__, "myst-parser", myst_parser.__version__, "breathe", breathe.__version__)' \
  make_docs
