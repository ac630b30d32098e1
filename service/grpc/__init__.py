"""The Open Inference Protocol over gRPC: Triton's ``inference.GRPCInferenceService`` and
``grpc.health.v1.Health`` (``server``), thin adapters over the data plane (``servicer``), the
call envelope (``rpc``) and the protobuf framing (``codec``, ``proto``)."""
