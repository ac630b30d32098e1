"""bitserve: the Open Inference Protocol (KServe V2) server."""

__version__ = "0.1.0"
