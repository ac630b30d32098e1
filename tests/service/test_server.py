"""``service.server``: the server assembled outside REST. gRPC runs from the server's own
parts with no FastAPI application (none built, none imported), and a real
``tritonclient.grpc`` infer goes through it; REST, when built, serves the same planes."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from harness.server import free_port
from service.server import BitServer, in_process_app
from service.settings import Settings
from tests.service.app_fakes import FakeRepository

pytestmark = pytest.mark.anyio

X = np.array([[1, 2, 3, 4], [0, 0, 1, 255]], dtype=np.uint8)


def _infer(port: int) -> np.ndarray:  # type: ignore[type-arg]
    """One infer of the fake echo model (y = 2x, float32) with tritonclient's blocking client."""
    with grpcclient.InferenceServerClient(f"127.0.0.1:{port}") as client:
        inp = grpcclient.InferInput("x", list(X.shape), "UINT8")
        inp.set_data_from_numpy(X)
        result = client.infer("echo", [inp])
        out = result.as_numpy("y")
        assert out is not None
        return out


async def test_grpc_runs_without_fastapi() -> None:
    """The gRPC transport starts from BitServer's parts: no REST application is built."""
    import asyncio

    repo = FakeRepository()
    server = BitServer(Settings(access_log=False, grpc_port=free_port()), repo)
    async with server.running():
        assert server.grpc is not None
        assert server.grpc.port is not None
        assert server.http is None
        assert server._app is None
        y = await asyncio.to_thread(_infer, server.grpc.port)
        np.testing.assert_array_equal(y, 2 * X.astype(np.float32))
        assert server.dataplane.model_ready("echo")  # the plane gRPC answered from
    assert repo.stopped


@pytest.mark.e2e
def test_grpc_imports_no_fastapi() -> None:
    """In a fresh interpreter, serving gRPC (and answering an infer) imports neither FastAPI,
    Starlette nor uvicorn: the transports are equals, neither built by the other."""
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        import numpy as np
        from service.server import BitServer
        from service.settings import Settings
        from tests.service.app_fakes import FakeRepository
        from tests.service.test_server import _infer

        async def main() -> None:
            server = BitServer(Settings(access_log=False, grpc_port={free_port()}),
                               FakeRepository())
            async with server.running():
                y = await asyncio.to_thread(_infer, server.grpc.port)
                assert y.tolist() == (2 * np.array({X.tolist()}, dtype=np.float32)).tolist()

        asyncio.run(main())
        print(sorted(m for m in ("fastapi", "starlette", "uvicorn") if m in sys.modules))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


async def test_rest_serves_the_same_planes() -> None:
    """REST's application is handed the server's planes; a load through REST is seen by the
    data plane gRPC uses."""
    server = BitServer(Settings(access_log=False, grpc_port=0), FakeRepository())
    app = server.rest_app()
    assert server.grpc is None  # grpc_port 0: gRPC off
    assert app.state.dataplane is server.dataplane
    assert app.state.control is server.control
    assert server.rest_app() is app  # made once
    async with server.running():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.get("/v2/models/echo/ready")
            assert r.status_code == 200


async def test_in_process_app_starts_and_stops_the_server() -> None:
    """:func:`in_process_app`'s lifespan is the server's start and stop (Ray Serve, tests)."""
    repo = FakeRepository()
    app = in_process_app(Settings(access_log=False), repo)
    assert app.state.server.grpc is None  # in-process: HTTP only
    async with app.router.lifespan_context(app):
        assert not repo.stopped
    assert repo.stopped


_RUN = """
import sys
from service.server import BitServer
from service.settings import Settings
from tests.service.app_fakes import FakeRepository

repo = FakeRepository()
settings = Settings(host="127.0.0.1", port={port}, grpc_port={grpc}, log_level="warning")
code = BitServer(settings, repo).run(None)
print("exit", code, "stopped", repo.stopped, flush=True)
sys.exit(code)
"""


@pytest.mark.e2e
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_run_owns_the_signals(sig: signal.Signals, code: int) -> None:
    """``BitServer.run`` (what ``bitserve serve`` runs): both transports serve; SIGTERM drains
    them and exits 0, SIGINT exits 130 (the shell's convention), the repository stopped
    either way."""
    port, grpc_port = free_port(), free_port()
    script = textwrap.dedent(_RUN).format(port=port, grpc=grpc_port)
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the server did not become ready"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v2/health/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        y = _infer(grpc_port)  # gRPC serves beside HTTP
        np.testing.assert_array_equal(y, 2 * X.astype(np.float32))
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == code, err
    assert out.strip() == f"exit {code} stopped True", err
