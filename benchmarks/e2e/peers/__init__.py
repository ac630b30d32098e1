"""Server programs of the peers; each runs in its own process (and, for MLServer and KServe,
its own venv), so this package imports nothing at import time."""
