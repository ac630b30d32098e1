"""The error of ``bitserve score`` and the scorer, in a module of its own: the pieces that
never load a model (the inputs' listing and checks, the output side, a ``.bed`` scored in
this process) raise it without importing the scorer and torch."""

from __future__ import annotations


class ScoringError(ValueError):
    """A batch (or a model) that cannot be scored; the message names the column and row."""
