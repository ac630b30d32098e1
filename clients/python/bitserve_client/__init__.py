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

Public API (``__all__``; everything else, modules included, is private):

- ``AsyncClient``: the asyncio client, the same calls as ``Client`` awaited, ``aclose()``.
- ``BitserveError``: the base of every error the client raises on purpose.
- ``BulkInferenceError``: ``infer_many`` stopped part way; how many rows are done.
- ``BulkResult``: what ``infer_many`` returns: output name -> all rows, and ``.rows``.
- ``Client``: the synchronous client.
- ``ConnectError``: the connection could not be made.
- ``DeadlineExceeded``: 504, the server-side ``deadline`` passed.
- ``DecodeError``: the answer is not a valid V2 response.
- ``InferResult``: what ``infer`` returns: output name -> array, id, headers.
- ``InvalidInputError``: an input failed a local check; nothing was sent.
- ``ModelNotFound``: 404, no such model or version.
- ``ModelSpec``: a model's inputs and outputs as the client sees them (``model_spec()``).
- ``PackInfo``: how a bit-packed input is packed (bit order, logical shape).
- ``Retry``: the retry policy (count, backoff, ``Retry-After`` cap).
- ``ServerError``: the server answered non-200 (``.status``, ``.message``, ``.request_id``).
- ``TensorSpec``: one input or output of a ``ModelSpec``.
- ``TimeoutException``: the HTTP timeout fired.
- ``TransportError``: no usable HTTP answer came back.
- ``Unauthorized``: 401 / 403, a missing or wrong token.
- ``Unavailable``: 503, queue full or model not ready (retried by default).
- ``__version__``: the distribution's version.
- ``plink``: PLINK ``.bed``/``.bim``/``.fam`` for genotype models (``read_bed``,
  ``score_bed``), NumPy only.
"""

from . import plink
from ._async_client import AsyncClient
from ._client import Client
from ._exceptions import (
    BitserveError,
    BulkInferenceError,
    ConnectError,
    DeadlineExceeded,
    DecodeError,
    InvalidInputError,
    ModelNotFound,
    ServerError,
    TimeoutException,
    TransportError,
    Unauthorized,
    Unavailable,
)
from ._retry import Retry
from ._spec import ModelSpec, PackInfo, TensorSpec
from ._types import BulkResult, InferResult
from ._version import __version__

__all__ = [
    "AsyncClient",
    "BitserveError",
    "BulkInferenceError",
    "BulkResult",
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
    "Unauthorized",
    "Unavailable",
    "__version__",
    "plink",
]
