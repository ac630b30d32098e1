"""Open Inference Protocol (KServe V2) REST framing with Triton's binary tensor extension.

Nothing in this package knows about FastAPI: it turns bytes and headers into
:class:`InferRequest` objects and :class:`InferResponse` objects back into bytes.
"""
