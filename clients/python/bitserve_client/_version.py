"""The distribution's version (one place; pyproject.toml repeats it)."""

__version__ = "1.0.0"
