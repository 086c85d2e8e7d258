"""The one error of a model option whose checkpoint or package is not here (a leaf: `hub` and
`packaged` both raise it, neither imports the other for it)."""

from __future__ import annotations


class ModelSourceError(ValueError):
    """A model that cannot be loaded here (one line: key, value, fix)."""
