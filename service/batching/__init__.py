"""Dynamic batching: the per-version queue, priorities, the batcher."""
