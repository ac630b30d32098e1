"""A small in-process V2 server for the client's unit tests (served via httpx.MockTransport).

It parses requests with its own code (not the client's framing), so a framing bug on either
side shows up as a wrong answer. Models:

- ``bits``: input ``x`` BOOL logical [3, 13], packed on the wire as UINT8 [batch, 3, 2]
  (bitorder set per instance), output ``count`` INT32 [batch, 3] (bits set per row) and
  ``first`` FP32 [batch, 3] (the first bit of each row as 0.0/1.0). max_batch_size 8.
- ``plain``: input ``a`` FP32 [4] and ``b`` INT64 [4], output ``y`` FP64 [4] = a * b;
  metadata only (no /config, like a KServe server), batch dimension -1.
- ``multi`` (several inputs, issue 12, before the real server has them): inputs ``a``
  BOOL logical [2, 10] packed big-endian (UINT8 [batch, 2, 2]), ``b`` BOOL logical [3]
  packed little-endian (UINT8 [batch, 1]) and ``w`` FP32 [2]; outputs ``count_a`` INT32 [2]
  (bits set per row of ``a``), ``count_b`` INT32 [] and ``score`` FP32 [2] =
  count_a * w + count_b. max_batch_size 4.

Every response carries ``X-Request-ID`` (the request's, or ``fake-<n>``). The repository
routes (index, load, unload) keep a set of unloaded models; with ``token`` set, everything
but the health routes answers 401 without ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np

DT = {"BOOL": np.bool_, "UINT8": np.uint8, "INT32": np.int32, "INT64": np.int64}
DT |= {"FP32": np.float32, "FP64": np.float64}
L = 13
MODELS = ("bits", "plain", "multi")


class FakeV2:
    """The server state; ``handler`` is the MockTransport callback."""

    def __init__(
        self,
        bitorder: str = "big",
        delay: Callable[[], float] | None = None,
        token: str | None = None,
    ) -> None:
        self.bitorder = bitorder
        self.delay = delay
        self.token = token
        self.unloaded: set[str] = set()
        # From this inference request on (1-based), answer 500: the server "died".
        self.fail_infer_from: int | None = None
        self.infer_count = 0
        self.load_bodies: list[Any] = []
        self.requests: list[httpx.Request] = []
        # Scripted answers served before normal handling: a Response or an exception to raise.
        self.script: list[httpx.Response | Exception] = []
        self.metadata_calls = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()

    # -- model descriptions ----------------------------------------------------------------

    def metadata(self, name: str) -> dict[str, Any]:
        if name == "bits":
            params = {
                "packing": "bits",
                "bitorder": self.bitorder,
                "logical_shape": [3, L],
                "logical_datatype": "BOOL",
            }
            return {
                "name": "bits",
                "versions": ["1"],
                "platform": "bitserve",
                "inputs": [
                    {"name": "x", "datatype": "UINT8", "shape": [-1, 3, 2], "parameters": params}
                ],
                "outputs": [
                    {"name": "count", "datatype": "INT32", "shape": [-1, 3]},
                    {"name": "first", "datatype": "FP32", "shape": [-1, 3]},
                ],
            }
        return {
            "name": "plain",
            "versions": ["1"],
            "platform": "other",
            "inputs": [
                {"name": "a", "datatype": "FP32", "shape": [-1, 4]},
                {"name": "b", "datatype": "INT64", "shape": [-1, 4]},
            ],
            "outputs": [{"name": "y", "datatype": "FP64", "shape": [-1, 4]}],
        }

    def multi_metadata(self) -> dict[str, Any]:
        def packed(logical: list[int], bitorder: str) -> dict[str, Any]:
            return {
                "packing": "bits",
                "bitorder": bitorder,
                "logical_shape": logical,
                "logical_datatype": "BOOL",
            }

        return {
            "name": "multi",
            "versions": ["1"],
            "platform": "bitserve",
            "inputs": [
                {
                    "name": "a",
                    "datatype": "UINT8",
                    "shape": [-1, 2, 2],
                    "parameters": packed([2, 10], "big"),
                },
                {
                    "name": "b",
                    "datatype": "UINT8",
                    "shape": [-1, 1],
                    "parameters": packed([3], "little"),
                },
                {"name": "w", "datatype": "FP32", "shape": [-1, 2]},
            ],
            "outputs": [
                {"name": "count_a", "datatype": "INT32", "shape": [-1, 2]},
                {"name": "count_b", "datatype": "INT32", "shape": [-1]},
                {"name": "score", "datatype": "FP32", "shape": [-1, 2]},
            ],
        }

    def config(self) -> dict[str, Any]:
        # Triton-style config: parameters in the {"string_value": ...} form on purpose.
        return {
            "name": "bits",
            "max_batch_size": 8,
            "input": [
                {
                    "name": "x",
                    "data_type": "TYPE_UINT8",
                    "dims": [3, 2],
                    "parameters": {"packing": {"string_value": "bits"}},
                }
            ],
        }

    # -- request handling ------------------------------------------------------------------

    def handler(self, request: httpx.Request, *, timed: bool = True) -> httpx.Response:
        """Answer ``request``; with ``timed``, count it in flight while it sleeps ``delay``
        (``async_handler`` does both on the event loop instead)."""
        with self._lock:
            self.requests.append(request)
            rid = request.headers.get("X-Request-ID") or f"fake-{len(self.requests)}"
            if self.script:
                scripted = self.script.pop(0)
                if isinstance(scripted, Exception):
                    raise scripted
                scripted.headers.setdefault("X-Request-ID", rid)
                return scripted
        with self.flight() if timed else contextlib.nullcontext():
            if timed and self.delay is not None:
                time.sleep(self.delay())
            response = self._route(request)
            response.headers["X-Request-ID"] = rid
            return response

    @contextlib.contextmanager
    def flight(self) -> Iterator[None]:
        """Count a request in flight (``in_flight``, ``max_in_flight``) while inside."""
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            yield
        finally:
            with self._lock:
                self.in_flight -= 1

    def _route(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path in ("/v2/health/live", "/v2/health/ready"):
            return httpx.Response(200, json={})
        if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
            return httpx.Response(401, json={"error": "missing or invalid bearer token"})
        if path == "/v2":
            return httpx.Response(200, json={"name": "fake", "version": "0", "extensions": []})
        if path.startswith("/v2/repository/"):
            return self._repository(request, path.split("/")[3:])
        parts = path.split("/")  # ["", "v2", "models", name, ...]
        name = parts[3] if len(parts) > 3 else ""
        if parts[:3] != ["", "v2", "models"] or name not in MODELS or name in self.unloaded:
            return httpx.Response(404, json={"error": f"unknown model '{name}'"})
        tail = parts[4:]
        if tail == []:
            self.metadata_calls += 1
            meta = self.multi_metadata() if name == "multi" else self.metadata(name)
            return httpx.Response(200, json=meta)
        if tail == ["config"]:
            if name == "plain":
                return httpx.Response(404, json={"error": "no config"})
            if name == "multi":
                return httpx.Response(200, json={"name": "multi", "max_batch_size": 4})
            return httpx.Response(200, json=self.config())
        if tail == ["ready"]:
            return httpx.Response(200)
        if tail == ["infer"]:
            with self._lock:
                self.infer_count += 1
                failed = self.fail_infer_from is not None and (
                    self.infer_count >= self.fail_infer_from
                )
            if failed:
                return httpx.Response(500, json={"error": "the server died"})
            return self._infer(name, request)
        return httpx.Response(404, json={"error": "no route"})

    def _repository(self, request: httpx.Request, parts: list[str]) -> httpx.Response:
        if request.method != "POST":
            return httpx.Response(405, json={"error": "method not allowed"})
        body = json.loads(request.read() or b"{}")
        if parts == ["index"]:
            index = [
                {
                    "name": m,
                    "version": "" if m in self.unloaded else "1",
                    "state": "UNAVAILABLE" if m in self.unloaded else "READY",
                    "reason": "unloaded" if m in self.unloaded else "",
                }
                for m in MODELS
            ]
            ready_only = body.get("ready", False)
            return httpx.Response(
                200, json=[e for e in index if e["state"] == "READY" or not ready_only]
            )
        if len(parts) == 3 and parts[0] == "models" and parts[2] in ("load", "unload"):
            name = parts[1]
            if name not in MODELS:
                return httpx.Response(
                    400, json={"error": f"failed to load '{name}': no such model"}
                )
            if parts[2] == "load":
                self.load_bodies.append(body)
                self.unloaded.discard(name)
            else:
                self.unloaded.add(name)
            return httpx.Response(200, json={})
        return httpx.Response(404, json={"error": "no route"})

    def _infer(self, name: str, request: httpx.Request) -> httpx.Response:
        body = request.read()
        encoding = request.headers.get("Content-Encoding")
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        hlen = request.headers.get("Inference-Header-Content-Length")
        n = len(body) if hlen is None else int(hlen)
        header = json.loads(body[:n])
        offset = n
        inputs: dict[str, np.ndarray[Any, Any]] = {}
        for entry in header["inputs"]:
            dtype = np.dtype(DT[entry["datatype"]])
            shape = tuple(entry["shape"])
            size = (entry.get("parameters") or {}).get("binary_data_size")
            if size is None:
                arr = np.array(entry["data"], dtype=dtype).reshape(shape)
            else:
                arr = np.frombuffer(body[offset : offset + size], dtype=dtype).reshape(shape)
                offset += size
            inputs[entry["name"]] = arr
        if offset != len(body):
            return httpx.Response(400, json={"error": "stray bytes"})
        if name == "bits":
            x = inputs["x"]
            if x.dtype != np.uint8 or x.shape[1:] != (3, 2) or x.shape[0] > 8:
                return httpx.Response(400, json={"error": f"bad x {x.dtype} {list(x.shape)}"})
            bits = np.unpackbits(x, axis=-1, count=L, bitorder=self.bitorder)  # type: ignore[arg-type]
            outs = {
                "count": ("INT32", bits.sum(axis=-1, dtype=np.int32)),
                "first": ("FP32", bits[..., 0].astype(np.float32)),
            }
        elif name == "multi":
            checked = _multi(inputs)
            if isinstance(checked, httpx.Response):
                return checked
            outs = checked
        else:
            y = inputs["a"].astype(np.float64) * inputs["b"]
            outs = {"y": ("FP64", y)}
        wanted = [o["name"] for o in header.get("outputs", [])] or list(outs)
        binary_default = (header.get("parameters") or {}).get("binary_data_output", False)
        binary_for = {
            o["name"]: o.get("parameters", {}).get("binary_data", binary_default)
            for o in header.get("outputs", [])
        }
        resp: dict[str, Any] = {"model_name": name, "model_version": "1", "outputs": []}
        if "id" in header:
            resp["id"] = header["id"]
        blobs: list[bytes] = []
        for out_name in wanted:
            datatype, arr = outs[out_name]
            entry = {"name": out_name, "datatype": datatype, "shape": list(arr.shape)}
            if binary_for.get(out_name, binary_default):
                raw = np.ascontiguousarray(arr).tobytes()
                entry["parameters"] = {"binary_data_size": len(raw)}
                blobs.append(raw)
            else:
                entry["data"] = arr.ravel().tolist()
            resp["outputs"].append(entry)
        head = json.dumps(resp).encode()
        if not blobs:
            return httpx.Response(200, content=head, headers={"Content-Type": "application/json"})
        return httpx.Response(
            200,
            content=head + b"".join(blobs),
            headers={
                "Content-Type": "application/octet-stream",
                "Inference-Header-Content-Length": str(len(head)),
            },
        )


def _multi(
    inputs: dict[str, np.ndarray[Any, Any]],
) -> dict[str, tuple[str, np.ndarray[Any, Any]]] | httpx.Response:
    """Model ``multi`` on the wire tensors, checked the way a server checks them."""
    expected = {"a": (np.uint8, (2, 2)), "b": (np.uint8, (1,)), "w": (np.float32, (2,))}
    if sorted(inputs) != sorted(expected):
        return httpx.Response(400, json={"error": f"inputs {sorted(inputs)} != a, b, w"})
    for k, (dtype, item) in expected.items():
        x = inputs[k]
        if x.dtype != dtype or x.shape[1:] != item or not 0 < x.shape[0] <= 4:
            return httpx.Response(400, json={"error": f"bad {k} {x.dtype} {list(x.shape)}"})
    if len({x.shape[0] for x in inputs.values()}) != 1:
        return httpx.Response(400, json={"error": "batch sizes differ"})
    a = np.unpackbits(inputs["a"], axis=-1, count=10, bitorder="big")
    b = np.unpackbits(inputs["b"], axis=-1, count=3, bitorder="little")
    return _multi_outputs(a, b, inputs["w"])


def _multi_outputs(
    a: np.ndarray[Any, Any], b: np.ndarray[Any, Any], w: np.ndarray[Any, Any]
) -> dict[str, tuple[str, np.ndarray[Any, Any]]]:
    count_a = a.astype(bool).sum(axis=-1).astype(np.int32)
    count_b = b.astype(bool).sum(axis=-1).astype(np.int32)
    score = (count_a * w.astype(np.float32) + count_b[..., None]).astype(np.float32)
    return {"count_a": ("INT32", count_a), "count_b": ("INT32", count_b), "score": ("FP32", score)}


def reference_multi(
    a: np.ndarray[Any, Any], b: np.ndarray[Any, Any], w: np.ndarray[Any, Any]
) -> dict[str, np.ndarray[Any, Any]]:
    """What model ``multi`` computes, from the logical bits (NumPy, no packing)."""
    outs = _multi_outputs(np.asarray(a), np.asarray(b), np.asarray(w))
    return {k: v for k, (_, v) in outs.items()}


def reference_bits(bits: np.ndarray[Any, Any]) -> dict[str, np.ndarray[Any, Any]]:
    """What model ``bits`` computes, from the logical bits (NumPy, no packing)."""
    b = np.asarray(bits).astype(bool)
    return {"count": b.sum(axis=-1).astype(np.int32), "first": b[..., 0].astype(np.float32)}


async def async_handler(fake: FakeV2, request: httpx.Request) -> httpx.Response:
    """The async MockTransport callback (reads the streamed body first); the fake's
    ``delay`` is awaited here, counted in flight, so that the event loop is not blocked."""
    await request.aread()
    if fake.delay is None:
        return fake.handler(request)
    with fake.flight():
        await asyncio.sleep(fake.delay())
        return fake.handler(request, timed=False)
