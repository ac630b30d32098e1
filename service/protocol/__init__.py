"""Open Inference Protocol (KServe V2) REST framing with Triton's binary tensor extension.

Nothing in this package knows about FastAPI: it turns bytes and headers into
:class:`InferRequest` objects and :class:`InferResponse` objects back into bytes.
"""

from service.protocol.compression import (
    CompressionMode,
    choose_encoding,
    compress,
    decompress,
    worth_compressing,
)
from service.protocol.request import (
    HEADER_LENGTH,
    InputChecker,
    RawInputSpec,
    decode_infer_request,
    parse_header_length,
)
from service.protocol.response import EncodedResponse, dumps, encode_infer_response
from service.protocol.types import (
    BF16,
    BYTES,
    DATATYPES,
    REGISTRY,
    WIRE_DTYPES,
    Datatype,
    InferRequest,
    InferResponse,
    RequestInput,
    RequestOutput,
    ResponseOutput,
)

__all__ = [
    "BF16",
    "BYTES",
    "DATATYPES",
    "HEADER_LENGTH",
    "REGISTRY",
    "WIRE_DTYPES",
    "CompressionMode",
    "Datatype",
    "EncodedResponse",
    "InferRequest",
    "InferResponse",
    "InputChecker",
    "RawInputSpec",
    "RequestInput",
    "RequestOutput",
    "ResponseOutput",
    "choose_encoding",
    "compress",
    "decode_infer_request",
    "decompress",
    "dumps",
    "encode_infer_response",
    "parse_header_length",
    "worth_compressing",
]
