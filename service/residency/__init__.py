"""The device memory budget: what each version holds, loads on demand, least-recently-used
eviction."""
