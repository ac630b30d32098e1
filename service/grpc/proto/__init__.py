"""Triton's gRPC interface (``inference.GRPCInferenceService``, ``grpc.health.v1.Health``):
the upstream ``.proto`` files and the modules protoc generated from them (see ``generate``)."""
