"""The committed protobuf modules: current with the ``.proto`` files, wire-compatible with
tritonclient's, kept apart from its descriptor pool, and every RPC of the service served."""

from __future__ import annotations

from pathlib import Path

import grpc
import tritonclient.grpc as tgrpc

from service.grpc.proto import generate
from service.grpc.proto import grpc_service_pb2 as pb
from service.grpc.rpc import Rpcs
from service.grpc.server import server_options
from service.grpc.servicer import HEALTH_SERVICE, SERVICE, GrpcEndpoints
from service.settings import Settings


def test_generated_modules_are_current(tmp_path: Path) -> None:
    written = generate.generate(tmp_path)
    assert {p.name for p in written} == {
        f"{stem}_pb2.{ext}"
        for stem in ("grpc_service", "model_config", "health")
        for ext in ("py", "pyi")
    }
    for path in written:
        committed = generate.HERE / path.name
        assert committed.read_text() == path.read_text(), (
            f"{path.name} is stale: run python -m service.grpc.proto.generate"
        )
    assert generate.main(["--check"]) == 0


def test_the_protos_are_upstreams_with_their_licence() -> None:
    here = generate.HERE
    assert "Redistribution and use in source and binary forms" in (here / "LICENSE").read_text()
    for name in generate.PROTOS:
        text = (here / name).read_text()
        assert text.startswith("// Copyright"), name
        assert "NVIDIA CORPORATION" in text.split("\n", 1)[0]


def test_private_pool_and_tritonclient_coexist() -> None:
    # Both define inference.ModelInferRequest; neither registration may clash with the other.
    ours = pb.ModelInferRequest(model_name="m", id="x", raw_input_contents=[b"\x01\x02"])
    ours.inputs.add(name="a", datatype="UINT8", shape=[1, 2])
    theirs = tgrpc.service_pb2.ModelInferRequest.FromString(ours.SerializeToString())
    assert (theirs.model_name, theirs.id, list(theirs.inputs[0].shape)) == ("m", "x", [1, 2])
    assert pb.ModelInferRequest.DESCRIPTOR.file.pool is not (
        tgrpc.service_pb2.ModelInferRequest.DESCRIPTOR.file.pool
    )
    assert pb.ModelInferRequest.FromString(theirs.SerializeToString()) == ours


def test_every_rpc_has_a_handler() -> None:
    endpoints = GrpcEndpoints(None, None, Rpcs(access_log=False))  # type: ignore[arg-type]
    handlers = endpoints.handlers()
    served = {h.service_name(): h for h in handlers}  # type: ignore[attr-defined]
    assert set(served) == {SERVICE, HEALTH_SERVICE}
    methods = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods
    for method in methods:
        path = f"/{SERVICE}/{method.name}"
        details = type("D", (), {"method": path, "invocation_metadata": ()})()
        handler = served[SERVICE].service(details)  # type: ignore[attr-defined]
        assert handler is not None, method.name
        streaming = method.client_streaming, method.server_streaming
        assert (handler.request_streaming, handler.response_streaming) == streaming


def test_every_server_option_is_one_grpcio_knows() -> None:
    # grpc-core ignores channel arguments it does not know: a misspelt keepalive option would
    # silently leave the default in place (its names differ from the settings' in places).
    library = b"".join(p.read_bytes() for p in Path(grpc.__file__).parent.glob("_cython/*.so"))
    options = server_options(Settings(grpc_keepalive_permit_without_calls=True))
    for key, _ in options:
        assert key.encode() in library, key
    assert dict(options)["grpc.http2.min_ping_interval_without_data_ms"] == 300_000
