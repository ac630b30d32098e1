"""The control plane against a real ``bitserve serve`` at its default worker count (``auto``:
one worker per core, two on a 2-core CI machine).

- Hostile names on every control route (load, unload, shared memory, logging), over HTTP and
  gRPC: never a 5xx, never gRPC INTERNAL, and every worker still serves afterwards. (Changes
  used to reach the other workers as HTTP requests with the raw path: ``%00`` was a 500.)
- A client that truncates its shared memory object again and again while requests read it
  and write into it: every worker lives (a read through a mapping past the new end was SIGBUS,
  which killed the worker, and its restart registered the region again), and each such
  request is a 400 naming the shrunken object.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path
from urllib.parse import unquote

import grpc
import httpx
import numpy as np
import pytest
from google.protobuf.message import Message

from harness.server import BitserveServer, start_server, worker_pids_in
from service.cluster.supervisor import available_cores, plan_workers
from service.grpc.proto import grpc_service_pb2 as pb
from service.models.demo import N_COARSE, N_FINE, N_FUNCTIONS

pytestmark = pytest.mark.e2e

# As a client puts them in a path (percent-encoded): control characters, CR LF (header
# injection), DEL, a byte that is not UTF-8, non-ASCII text, an emoji, dot segments, an
# encoded slash, and a name far past every limit.
NAMES = [
    *("%00", "%01", "%0a", "%0d%0aX-Injected:%201", "%7f", "%ff", "caf%C3%A9", "%F0%9F%98%80"),
    *("%2e%2e", "a%2fb", "demo%00", " ", "d" * 10_000),
]
SERVICE = "/inference.GRPCInferenceService/"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BitserveServer]:
    # The default worker count; on a host where it is one worker (two cores or fewer), two:
    # what is tested is the workers' control plane.
    auto = plan_workers("auto", cores=available_cores(), gpus=0).workers
    workers = "auto" if auto >= 2 else "2"
    env = {"BITSERVE_WORKERS": workers, "BITSERVE_LOG_LEVEL": "info"}
    log_dir = tmp_path_factory.mktemp("control")
    with start_server(args=["--allow-client-shm"], env=env, log_dir=log_dir) as server:
        yield server


def workers_of(server: BitserveServer) -> dict[int, int]:
    pids = worker_pids_in(server.log())
    assert pids, "a supervisor log with its workers"
    return pids


def http_requests(name: str) -> list[tuple[str, str, object]]:
    """Every control route with ``name`` where a name goes, with bodies that reach the
    control plane."""
    shm = "/v2/systemsharedmemory"
    return [
        ("POST", f"/v2/repository/models/{name}/load", None),
        ("POST", f"/v2/repository/models/{name}/load", {"parameters": {"config": "{}"}}),
        ("POST", f"/v2/repository/models/{name}/unload", None),
        ("POST", f"{shm}/region/{name}/register", {"key": "/bitserve-none", "byte_size": 8}),
        ("POST", f"{shm}/region/r/register", {"key": unquote(name), "byte_size": 8}),
        ("POST", f"{shm}/region/{name}/unregister", None),
        ("GET", f"{shm}/region/{name}/status", None),
        ("GET", f"/v2/cudasharedmemory/region/{name}/status", None),
        ("POST", f"/v2/cudasharedmemory/region/{name}/register", {"raw_handle": {}}),
        ("POST", "/v2/logging", {unquote(name): True}),
        ("POST", "/v2/logging", {"log_format": unquote(name)}),
    ]


def grpc_requests(name: str) -> list[tuple[str, Message]]:
    """Every control RPC with ``name`` (as text: protobuf strings are UTF-8)."""
    text = unquote(name, errors="replace")
    setting = pb.LogSettingsRequest()
    setting.settings[text].bool_param = True
    fmt = pb.LogSettingsRequest()
    fmt.settings["log_format"].string_param = text
    load = pb.RepositoryModelLoadRequest(model_name=text)
    load.parameters["config"].string_param = "{}"
    return [
        ("RepositoryModelLoad", load),
        ("RepositoryModelUnload", pb.RepositoryModelUnloadRequest(model_name=text)),
        (
            "SystemSharedMemoryRegister",
            pb.SystemSharedMemoryRegisterRequest(name=text, key="/bitserve-none", byte_size=8),
        ),
        (
            "SystemSharedMemoryRegister",
            pb.SystemSharedMemoryRegisterRequest(name="r", key=text, byte_size=8),
        ),
        ("SystemSharedMemoryUnregister", pb.SystemSharedMemoryUnregisterRequest(name=text)),
        ("SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest(name=text)),
        ("CudaSharedMemoryStatus", pb.CudaSharedMemoryStatusRequest(name=text)),
        ("LogSettings", setting),
        ("LogSettings", fmt),
        ("ModelReady", pb.ModelReadyRequest(name=text)),
    ]


def test_hostile_names_on_control_routes_are_never_5xx(server: BitserveServer) -> None:
    before = workers_of(server)
    assert len(before) >= 2
    answered: dict[int, int] = {}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for name in NAMES:
            for method, path, body in http_requests(name):
                # A new connection each time: the kernel spreads them over the workers.
                r = httpx.request(method, server.url + path, json=body, timeout=60)
                shown = (method, path[:80], r.status_code, r.text[:300])
                assert r.status_code < 500, shown
                if r.status_code != 200:
                    assert set(r.json()) == {"error"}, shown
                assert len(r.content) < 4096, shown  # no name is echoed whole
                worker = int(r.headers["x-bitserve-worker"])
                answered[worker] = answered.get(worker, 0) + 1
        # Nothing changed: the demo is still loaded on every worker, no region, log as it was.
        index = client.post("/v2/repository/index").json()
        assert [(m["name"], m["state"]) for m in index] == [("demo", "READY")]
        assert client.get("/v2/systemsharedmemory/status").json() == []
        assert client.get("/v2/logging").json()["log_format"] == "default"
    with grpc.insecure_channel(server.grpc_target) as channel:
        for name in [*NAMES, "d" * 65_600]:
            for method, message in grpc_requests(name):
                try:
                    channel.unary_unary(SERVICE + method)(message.SerializeToString(), timeout=60)
                except grpc.RpcError as e:
                    code = e.code()  # type: ignore[attr-defined]
                    details = str(e.details())  # type: ignore[attr-defined]
                    assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (
                        method,
                        name[:40],
                        details[:300],
                    )
                    assert len(details) < 4096
    assert workers_of(server) == before  # no worker died (none was restarted)
    assert httpx.get(server.url + "/v2/health/ready").status_code == 200
    assert "Traceback" not in server.log()
    print("answers per worker:", answered)


def infer_body(in_bytes: int, out_bytes: int) -> bytes:
    header = {
        "inputs": [
            {
                "name": "spikes",
                "datatype": "UINT8",
                "shape": [1, N_FUNCTIONS, (N_FINE + 7) // 8],
                "parameters": {"shared_memory_region": "in", "shared_memory_byte_size": in_bytes},
            }
        ],
        "outputs": [
            {
                "name": "resampled",
                "parameters": {
                    "shared_memory_region": "out",
                    "shared_memory_byte_size": out_bytes,
                },
            }
        ],
    }
    return json.dumps(header).encode()


def test_a_truncation_loop_during_inference_leaves_every_worker_alive(
    server: BitserveServer,
) -> None:
    in_bytes = N_FUNCTIONS * ((N_FINE + 7) // 8)
    out_bytes = N_FUNCTIONS * N_COARSE * 4
    size = in_bytes + out_bytes
    obj = shared_memory.SharedMemory(create=True, size=size)
    path = Path("/dev/shm") / obj.name.lstrip("/")
    key = "/" + obj.name.lstrip("/")
    before = workers_of(server)
    try:
        obj.buf[:in_bytes] = np.random.default_rng(0).integers(0, 256, in_bytes, np.uint8).data
        for region, offset, nbytes in (("in", 0, in_bytes), ("out", in_bytes, out_bytes)):
            r = httpx.post(
                f"{server.url}/v2/systemsharedmemory/region/{region}/register",
                json={"key": key, "offset": offset, "byte_size": nbytes},
            )
            assert r.status_code == 200, r.text
        stop = threading.Event()

        def truncate() -> None:
            while not stop.is_set():
                os.truncate(path, 4096)  # both regions now run past the object's end
                time.sleep(0.002)
                os.truncate(path, size)
                time.sleep(0.002)

        truncator = threading.Thread(target=truncate)
        truncator.start()
        statuses: dict[int, int] = {}
        shrank: dict[int, int] = {}  # per worker: requests refused for the shrunken object
        body = infer_body(in_bytes, out_bytes)
        headers = {"Inference-Header-Content-Length": str(len(body))}
        deadline = time.monotonic() + 120
        try:
            # Until every worker has met the shrunken object a few times (a new connection
            # each time: the kernel spreads them over the workers).
            while len(shrank) < len(before) or min(shrank.values()) < 10:
                assert time.monotonic() < deadline, (statuses, shrank)
                r = httpx.post(
                    f"{server.url}/v2/models/demo/infer", content=body, headers=headers, timeout=60
                )
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                assert r.status_code in (200, 400), r.text[:300]
                if r.status_code == 400:
                    assert "shrank since registration" in r.json()["error"], r.text[:300]
                    worker = int(r.headers["x-bitserve-worker"])
                    shrank[worker] = shrank.get(worker, 0) + 1
        finally:
            stop.set()
            truncator.join()
        os.truncate(path, size)
        r = httpx.post(f"{server.url}/v2/models/demo/infer", content=body, headers=headers)
        assert r.status_code == 200, r.text  # whole again: served again
        assert np.isfinite(np.frombuffer(obj.buf[in_bytes:size], np.float32)).all()
        assert workers_of(server) == before, server.log()[-3000:]  # none died, none restarted
        assert "killed by signal" not in server.log()
        print("statuses:", statuses, "refused per worker:", shrank)
    finally:
        httpx.post(f"{server.url}/v2/systemsharedmemory/unregister")
        obj.close()
        obj.unlink()
