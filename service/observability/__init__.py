"""Metrics, statistics, traces, logs and request ids."""
