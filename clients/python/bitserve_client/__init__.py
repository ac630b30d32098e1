"""bitserve_client: a Python client for bitserve and any Open Inference Protocol (V2) server.

It packs binary features into bits (learning which inputs are packed from the model's
metadata), speaks V2 with Triton's binary tensor extension both ways, retries connection
failures and 503s with backoff, and streams bulk data with bounded concurrency::

    import numpy as np
    from bitserve_client import Client

    with Client("http://127.0.0.1:8000") as client:
        bits = np.random.rand(4, 20, 50000) < 0.01        # bool [batch, 20, 50000]
        out = client.infer("demo", {"spikes": bits})      # packed to uint8 [4, 20, 6250]
        out["resampled"].shape                            # (4, 20, 500), float32

Depends on numpy and httpx only; torch tensors are accepted when torch is installed.
"""

from ._async_client import AsyncClient
from ._client import Client
from ._exceptions import (
    BitserveError,
    ConnectError,
    DeadlineExceeded,
    DecodeError,
    InvalidInputError,
    ModelNotFound,
    ServerError,
    TimeoutException,
    TransportError,
    Unavailable,
)
from ._retry import Retry
from ._spec import ModelSpec, PackInfo, TensorSpec
from ._types import InferResult
from ._version import __version__

__all__ = [
    "AsyncClient",
    "BitserveError",
    "Client",
    "ConnectError",
    "DeadlineExceeded",
    "DecodeError",
    "InferResult",
    "InvalidInputError",
    "ModelNotFound",
    "ModelSpec",
    "PackInfo",
    "Retry",
    "ServerError",
    "TensorSpec",
    "TimeoutException",
    "TransportError",
    "Unavailable",
    "__version__",
]
