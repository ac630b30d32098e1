"""Triton kernels. Importing this package requires ``triton``; callers check first."""
