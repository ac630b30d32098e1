"""The Open Inference Protocol over HTTP (V2 REST with Triton's binary tensor extension): the
application (``app``), the outermost ASGI layer (``gateway``), the raw infer route
(``infer_route``) and its express lane (``express_lane``), FastAPI's other routes
(``endpoints``), request bodies (``bodies``), bearer auth for FastAPI (``auth``) and
uvicorn's HTTP protocol with limits (``http_protocol``, ``http_head``, ``http_cycle``)."""
