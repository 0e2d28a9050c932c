"""Sphinx configuration of the API reference: the objects a backend or blob-store author touches, from docstrings.

Built by ``./dev docs`` (warnings are errors); nothing here is fetched from the network."""

from __future__ import annotations

project = "statebackend"
author = "the statebackend developers"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
# statebackend.spark needs pyspark only where the API reference does not go
autodoc_mock_imports = ["pyspark"]
autodoc_default_options = {"members": True, "show-inheritance": True, "member-order": "bysource"}
autodoc_typehints = "description"
autodoc_class_signature = "separated"
# the docstrings say which of these are optional hooks: attrs' generated dunders are not part of the contract
autodoc_inherit_docstrings = True
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path: list[str] = []
# docstrings use ``double backticks`` for literals and :class: roles for our own names
default_role = "literal"
suppress_warnings = ["ref.python"]  # a short name found in two modules (an alias re-exported): the first wins
