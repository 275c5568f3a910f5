"""Sphinx configuration. Build (warnings are errors, as in CI):

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))  # document this checkout, installed or not

import mplaunch  # noqa: E402

project = "mplaunch"
author = "the mplaunch authors"
copyright = "the mplaunch authors"
version = release = mplaunch.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # launch()'s docstring is Google style (Args:, Raises:)
    "sphinx.ext.viewcode",
]

# Docs build offline: no intersphinx, and Python's own names stay plain text.
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Docstrings here write `name` for code, as Markdown would; show it as code, not italics.
default_role = "literal"
root_doc = "index"
exclude_patterns = ["_build"]
templates_path = []
html_static_path = []
html_theme = "alabaster"
html_theme_options = {
    "description": "Launch a function in N processes for PyTorch distributed work, "
                   "watch them, tear everything down.",
    "fixed_sidebar": True,
}
html_title = f"mplaunch {release}"
pygments_style = "sphinx"


def _hide_private_parameters(app, what, name, obj, options, signature, return_annotation):
    """Leave parameters whose names start with an underscore (internal plumbing, such as
    the watcher command's ``_script`` of launch) out of the rendered signatures."""
    if not signature:
        return None
    import inspect
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = [p.replace(annotation=inspect.Parameter.empty)  # types go in the description
              for p in sig.parameters.values() if not p.name.startswith("_")]
    if len(params) == len(sig.parameters):
        return None
    shown = sig.replace(parameters=params, return_annotation=inspect.Signature.empty)
    return str(shown), return_annotation


def setup(app):
    app.connect("autodoc-process-signature", _hide_private_parameters)
