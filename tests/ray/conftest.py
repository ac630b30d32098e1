"""Ray for the tests: every node and driver on 127.0.0.1, no usage reports.

Set before Ray is imported (``ray._private.ray_constants`` reads them once): Ray otherwise puts
its nodes on the host's outgoing interface address and rewrites ``127.0.0.1`` into it, and
sends usage statistics out. Worker processes inherit the environment of the process that
started the cluster, ``bitserve score`` subprocesses the test's.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # nodes on the loopback only
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
