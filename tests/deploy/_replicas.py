"""Real ``bitserve serve`` processes on loopback, and a V2 binary client without retries.

The client is deliberately bare (httpx, no retries): a load-balancer test must see exactly
what nginx answers, not what a retrying SDK makes of it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt

from harness.server import STARTUP_S, bitserve_command, free_port, worker_pids_in

from ._manifests import ROOT

__all__ = ["Replica", "decode_output", "free_port", "infer_body"]

_NP = {"UINT8": np.uint8, "BOOL": np.bool_, "FP32": np.float32, "FP64": np.float64}


@dataclass
class Replica:
    """One ``bitserve serve`` process (the built-in demo model, CPU) on a fixed port; with
    ``BITSERVE_WORKERS`` in ``env``, a supervisor and its workers."""

    port: int
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = STARTUP_S) -> None:
        """Start the process and wait until ``/v2/health/ready`` answers 200."""
        # Not the test process's BITSERVE_* or TRITON_INTERPRET (the server picks its kernels).
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("BITSERVE_")},
            "BITSERVE_HOST": "127.0.0.1",
            "BITSERVE_PORT": str(self.port),
            "BITSERVE_DEVICE": "cpu",
            "BITSERVE_LOG_LEVEL": "warning",
            "BITSERVE_WORKERS": "1",
            "BITSERVE_GRPC_PORT": "0",  # HTTP replicas here; 8001 may be anyone's
            **self.env,
        }
        env.pop("TRITON_INTERPRET", None)
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [*bitserve_command(), "serve"],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"bitserve on port {self.port} exited with {self.proc.returncode}:\n"
                    + self.log.read_text()[-4000:]
                )
            try:
                if httpx.get(f"{self.url}/v2/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"bitserve on port {self.port} not ready in {timeout_s} s")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL: the replica dies at once, with requests in flight (a crash)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def worker_pids(self) -> dict[int, int]:
        """Each worker index's current pid, from the supervisor's log (info level)."""
        return worker_pids_in(self.log.read_text())

    def successes(self, model: str) -> float:
        """The server's ``bitserve_requests_total{model, outcome="success"}`` (all workers)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        pattern = (
            r"^bitserve_requests_total\{(?=[^}]*model=\"" + re.escape(model) + r"\")"
            r"(?=[^}]*outcome=\"success\")[^}]*\} (\S+)$"
        )
        match = re.search(pattern, text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0


def infer_body(
    name: str, array: npt.NDArray[Any], datatype: str, output: str
) -> tuple[bytes, dict[str, str]]:
    """A V2 request with one binary input and one binary output (Triton's extension)."""
    raw = np.ascontiguousarray(array).tobytes()
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": name,
                    "datatype": datatype,
                    "shape": list(array.shape),
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
            "outputs": [{"name": output, "parameters": {"binary_data": True}}],
        }
    ).encode()
    headers = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }
    return header + raw, headers


def decode_output(response: httpx.Response, output: str) -> npt.NDArray[Any]:
    """The named output of a V2 binary (or JSON) response as a NumPy array."""
    body = response.content
    n = int(response.headers.get("Inference-Header-Content-Length", len(body)))
    header = json.loads(body[:n])
    offset = n
    for out in header["outputs"]:
        size = out.get("parameters", {}).get("binary_data_size")
        dtype = _NP[out["datatype"]]
        data: npt.NDArray[Any]
        if size is None:
            data = np.asarray(out["data"], dtype=dtype)
        else:
            data = np.frombuffer(body[offset : offset + size], dtype=dtype)
            offset += size
        if out["name"] == output:
            return data.reshape(out["shape"])
    raise AssertionError(f"no output {output!r} in {header}")
