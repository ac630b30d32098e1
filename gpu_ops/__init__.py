"""Device-agnostic torch ops for bit-packed features.

Each op family lives in its own module; the public names are re-exported here.
"""

__all__: list[str] = []
