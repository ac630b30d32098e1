"""Slow, obviously correct implementations that the tests compare the fast paths with.

Nothing here is meant to be fast; everything here is meant to be easy to check by eye.
"""

from __future__ import annotations

# --- bits: numpy.packbits / numpy.unpackbits semantics, in plain torch ---------------------

# --- resample: the banded response operator, densely ---------------------------------------
