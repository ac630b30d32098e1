"""Python client for bitserve and any Open Inference Protocol (KServe V2) server."""

__all__: list[str] = []
__version__ = "0.1.0"
