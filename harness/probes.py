"""Helpers the load, fault, fuzz and security tests share: raw sockets, metrics, repositories.

Kept beside the load generator (not in ``tests/``) so the benchmark and the tests drive the
server with the same code.
"""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import httpx

from harness import wire
from harness.workload import Pool, check


def write_repository(
    root: Path,
    *,
    name: str = "demo",
    max_batch_size: int | None = None,
    max_queue_delay_us: int | None = None,
    max_queue_size: int | None = None,
    queue_timeout_us: int | None = None,
    model_file: Path | None = None,
) -> Path:
    """Write the demo model (this workload) as ``root/<name>`` with some settings changed.

    Args:
        root: the repository folder.
        name: the model's name.
        max_batch_size, max_queue_delay_us, max_queue_size: replace the demo's values.
        queue_timeout_us: added to the config (the demo has none).
        model_file: a ``torch.export`` program (``.pt2``) applied to the operator's output.

    Returns:
        ``root``.
    """
    from service.models.demo import write_demo_repository

    model = write_demo_repository(root)
    if name != model.name:
        model = model.rename(root / name)
    config = model / "1" / "config.toml"
    text = config.read_text()
    for key, value in (
        ("max_batch_size", max_batch_size),
        ("max_queue_delay_us", max_queue_delay_us),
        ("max_queue_size", max_queue_size),
    ):
        if value is not None:
            text, n = re.subn(rf"(?m)^{key} = \d+", f"{key} = {value}", text)
            assert n == 1, f"{key} not found in the demo config"
    if queue_timeout_us is not None:
        text, n = re.subn(
            r"(?m)^(max_queue_size = \d+.*)$", rf"\1\nqueue_timeout_us = {queue_timeout_us}", text
        )
        assert n == 1, "max_queue_size not found in the demo config"
    if model_file is not None:
        (model / "1" / "model.pt2").write_bytes(model_file.read_bytes())
        text = text.replace("[[outputs]]", '[model]\nfile = "model.pt2"\n\n[[outputs]]', 1)
    config.write_text(text)
    return root


def metric(text: str, name: str, default: float | None = None, **labels: str) -> float:
    """The sum of samples of ``name`` whose labels include ``labels`` in Prometheus text.

    Without a matching sample: ``default``, or KeyError when that is None.
    """
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m is None or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
            found = True
    if not found:
        if default is not None:
            return default
        raise KeyError(f"no sample {name}{labels or ''} in /metrics")
    return total


def wait_idle(base_url: str, timeout_s: float = 15.0) -> str:
    """Wait until the server has nothing queued or in flight; return the final /metrics text.

    Raises:
        AssertionError: still busy after ``timeout_s`` (a stuck queue entry).
    """
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        text = httpx.get(base_url + "/metrics", timeout=5).text
        if (
            # A model that never queued anything has no queue-depth sample yet.
            metric(text, "bitserve_queue_depth", 0.0) == 0
            and metric(text, "bitserve_in_flight_requests") == 0
        ):
            return text
        time.sleep(0.1)
    raise AssertionError(f"server still busy after {timeout_s} s:\n{_busy_lines(text)}")


def _busy_lines(text: str) -> str:
    keep = ("bitserve_queue_depth", "bitserve_in_flight_requests")
    return "\n".join(line for line in text.splitlines() if line.startswith(keep))


def raw_request(
    port: int,
    data: bytes | list[bytes],
    *,
    pause_s: float = 0.0,
    read: bool = True,
    timeout_s: float = 30.0,
) -> bytes:
    """Send ``data`` (one chunk or several, ``pause_s`` apart) on a fresh socket; read to EOF.

    The request should carry ``Connection: close`` so that the server ends the answer by
    closing; with ``read=False`` the socket is closed right after sending.
    """
    chunks = [data] if isinstance(data, bytes) else data
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        for i, chunk in enumerate(chunks):
            if i and pause_s:
                time.sleep(pause_s)
            s.sendall(chunk)
        return read_until_closed(s) if read else b""


def read_until_closed(s: socket.socket) -> bytes:
    """Everything the server sends on ``s`` until it closes (or resets) the connection."""
    parts = []
    while True:
        try:
            part = s.recv(65536)
        except ConnectionResetError:
            break
        if not part:
            break
        parts.append(part)
    return b"".join(parts)


def http_status(answer: bytes) -> int:
    """The status code of a raw HTTP/1.1 answer (0 when there is none)."""
    m = re.match(rb"HTTP/1\.[01] (\d{3})", answer)
    return int(m.group(1)) if m else 0


def request_bytes(
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    method: str = "POST",
    *,
    close: bool = True,
) -> bytes:
    """A raw HTTP/1.1 request (``Content-Length`` set when POSTing; ``Connection: close``
    unless ``close`` is false: a keep-alive request)."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    if close:
        lines.append("Connection: close")
    if method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def infer_ok(
    base_url: str, model: str, pool: Pool, *, headers: dict[str, str] | None = None
) -> None:
    """One packed request per pool item; each must be 200 with the reference answer."""
    for k, item in enumerate(pool.items):
        body = wire.encode("packed", item)
        r = httpx.post(
            f"{base_url}/v2/models/{model}/infer",
            content=body.content,
            headers={**body.headers, **(headers or {})},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        answer = wire.decode("packed", r.headers, r.content)
        problem = check(answer[0].astype("float64"), pool.expected[k])
        assert problem is None, problem
