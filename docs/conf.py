"""Sphinx configuration: the guide pages (Markdown, through MyST) and an API reference generated
from the package's docstrings, with the compiled modules' signatures taken from their stubs.

    python -m sphinx -W -b html docs docs/_build/html      # what tests/test_docs.py runs
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS / "_ext"))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # a source checkout built in place documents itself

project = "lifecycle"
author = "the lifecycle authors"
copyright = "the lifecycle authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "stub_signatures",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]

myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# Each object is documented once, in the module that defines it (``lifecycle`` re-exports many).
autodoc_default_options = {"members": True, "show-inheritance": True, "ignore-module-all": True}
autodoc_typehints = "signature"
autodoc_member_order = "bysource"
autodoc_preserve_defaults = True

html_theme = "alabaster"
html_title = "lifecycle"
