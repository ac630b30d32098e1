"""The descriptor pool of the generated modules here (kept apart from protobuf's default pool,
where ``tritonclient.grpc`` registers its own copy of the same ``inference`` messages)."""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
