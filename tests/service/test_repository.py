"""ModelRepository and ModelHandle in-process: loading, versions, validation, batching."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from harness.repo_utils import bits_input, demo_reference, model_toml, tensor, write_model_folder
from service import dataplane
from service.errors import InvalidInput, ModelNotFound, ModelNotReady, ServiceError
from service.models.handle import ModelHandle
from service.models.repository import ModelRepository
from service.observability.metrics import Metrics
from service.protocol.types import InferRequest, InferResponse, RequestInput, RequestOutput

N, B, A = 2, 21, 4


def cfg_text(max_batch_size: int = 4, delay_us: int = 0) -> str:
    return model_toml(
        max_batch_size=max_batch_size,
        max_queue_delay_us=delay_us,
        device="cpu",
        inputs=[bits_input(N, B)],
        operator={"file": "op.safetensors", "response": "boxcar", "half_width": 1.5},
        outputs=[tensor("out", "FP32")],
    )


def write(folder: Path, text: str, shift: float = 0.0) -> None:
    c = torch.linspace(0, B - 1, A).repeat(N, 1) + shift
    write_model_folder(folder, text, {"x": torch.arange(B, dtype=torch.float32), "c": c})


def boxcar_reference(bits: np.ndarray, shift: float = 0.0) -> np.ndarray:
    x = np.arange(B, dtype=np.float64)
    c = np.linspace(0, B - 1, A) + shift
    T = (np.abs(c[:, None] - x[None, :]) <= 1.5).astype(np.float64)  # (A, B)
    return np.einsum("ab,mnb->mna", T, bits.astype(np.float64))


def bits_of(m: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((m, N, B)) < 0.5


def request(bits: np.ndarray, *, form: str = "UINT8", **kw: Any) -> InferRequest:
    data = np.packbits(bits, axis=-1) if form == "UINT8" else bits
    return InferRequest(id="r1", inputs=[RequestInput("bits", form, data.shape, data)], **kw)


async def infer(handle: ModelHandle, req: InferRequest) -> InferResponse:
    """What a transport does: each input checked by the model's signature (as the decoders
    do), then the data plane."""
    for t in req.inputs:
        handle.signature.check_input(t.name, t.datatype, t.shape)
    return await dataplane.infer(handle, req)


def run(fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(fn())  # type: ignore[arg-type]


async def started(root: Path | None, **kw: Any) -> ModelRepository:
    repo = ModelRepository(root, warmup=False, **kw)
    await repo.start()
    return repo


def test_infer_and_response_shape(tmp_path: Path) -> None:
    write(tmp_path / "m", cfg_text())

    async def main() -> None:
        repo = await started(tmp_path)
        assert repo.ready
        h = repo.get("m")
        bits = bits_of(3)
        resp = await infer(h, request(bits))
        assert (resp.model_name, resp.model_version, resp.id) == ("m", "1", "r1")
        assert resp.parameters == {"batch_size": 3, "batch_requests": 1}
        (out,) = resp.outputs
        assert (out.name, out.datatype, out.shape) == ("out", "FP32", (3, N, A))
        np.testing.assert_allclose(out.data, boxcar_reference(bits), rtol=1e-6)
        same = await infer(h, request(bits, form="BOOL"))
        np.testing.assert_array_equal(same.outputs[0].data, out.data)
        await repo.stop()
        assert not repo.ready

    run(main)


def test_concurrent_requests_are_merged_and_equal_one_by_one(tmp_path: Path) -> None:
    write(tmp_path / "m", cfg_text(max_batch_size=8, delay_us=10_000_000))

    async def main() -> None:
        repo = await started(tmp_path)
        h = repo.get("m")
        parts = [bits_of(k, seed=k) for k in (1, 3, 2, 2)]  # 8 items: closes the batch
        resps = await asyncio.gather(*(infer(h, request(p)) for p in parts))
        assert all(r.parameters == {"batch_size": 8, "batch_requests": 4} for r in resps)
        for p, r in zip(parts, resps, strict=True):
            np.testing.assert_allclose(r.outputs[0].data, boxcar_reference(p), rtol=1e-6)
        await repo.stop()

    run(main)


def test_demo_builtin_and_written_repository_agree(tmp_path: Path) -> None:
    from service.models.demo import write_demo_repository

    write_demo_repository(tmp_path)
    rng = np.random.default_rng(0)
    bits = rng.random((2, 20, 50000)) < 0.1
    data = np.packbits(bits, axis=-1)

    async def main() -> None:
        builtin = await started(None)
        on_disk = await started(tmp_path)
        outs = []
        for repo in (builtin, on_disk):
            req = InferRequest(id=None, inputs=[RequestInput("spikes", "UINT8", data.shape, data)])
            outs.append((await infer(repo.get("demo"), req)).outputs[0].data)
            assert repo.index() == [
                {"name": "demo", "version": "1", "state": "READY", "reason": ""}
            ]
        np.testing.assert_array_equal(outs[0], outs[1])
        assert outs[0].shape == (2, 20, 500)
        np.testing.assert_allclose(outs[0], demo_reference(bits), rtol=1e-4, atol=1e-3)
        meta = builtin.get("demo").metadata()
        assert meta["inputs"] == [
            {
                "name": "spikes",
                "datatype": "UINT8",
                "shape": [-1, 20, 6250],
                "parameters": {
                    "packing": "bits",
                    "bitorder": "big",
                    "logical_shape": [20, 50000],
                    "logical_datatype": "BOOL",
                },
            }
        ]
        assert meta["outputs"] == [
            {"name": "resampled", "datatype": "FP32", "shape": [-1, 20, 500]}
        ]
        assert meta["platform"] == "bitserve"
        assert meta["versions"] == ["1"]
        assert meta["parameters"]["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")
        assert meta["parameters"]["device_memory_bytes"] >= 16 * 20 * 50000 // 8  # packed input
        cfg = builtin.get("demo").config()
        assert cfg["max_batch_size"] == 16
        assert cfg["input"][0]["data_type"] == "TYPE_UINT8"
        assert cfg["input"][0]["dims"] == [20, 6250]
        assert cfg["output"] == [{"name": "resampled", "data_type": "TYPE_FP32", "dims": [20, 500]}]
        assert cfg["dynamic_batching"] == {
            "max_queue_delay_microseconds": 1000,
            "preferred_batch_size": [16],
            "default_queue_policy": {
                "max_queue_size": 128,
                "default_timeout_microseconds": 0,
                "timeout_action": "REJECT",
                "allow_timeout_override": True,
            },
        }
        await builtin.stop()
        await on_disk.stop()

    run(main)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r.inputs.append(r.inputs[0]), "input 'bits' is given more than once"),
        (lambda r: r.inputs.clear(), "missing input 'bits'"),
        (
            lambda r: r.inputs.__setitem__(
                0, RequestInput("x", "UINT8", (1, N, 3), np.zeros((1, N, 3), np.uint8))
            ),
            "unknown input 'x' (expected inputs: ['bits'])",
        ),
        (
            lambda r: r.inputs.__setitem__(
                0, RequestInput("bits", "FP32", (1, N, B), np.zeros((1, N, B), np.float32))
            ),
            "input 'bits' has datatype FP32; expected UINT8 [-1, 2, 3] or BOOL [-1, 2, 21]",
        ),
        (
            lambda r: r.inputs.__setitem__(
                0, RequestInput("bits", "UINT8", (1, N, 4), np.zeros((1, N, 4), np.uint8))
            ),
            "input 'bits' has shape [1, 2, 4]; expected [batch, 2, 3] for UINT8",
        ),
        (
            lambda r: r.inputs.__setitem__(
                0, RequestInput("bits", "BOOL", (1, N, 24), np.zeros((1, N, 24), bool))
            ),
            "input 'bits' has shape [1, 2, 24]; expected [batch, 2, 21] for BOOL",
        ),
        (
            lambda r: r.inputs.__setitem__(
                0, RequestInput("bits", "UINT8", (5, N, 3), np.zeros((5, N, 3), np.uint8))
            ),
            "batch size 5, more than the model's max_batch_size 4",
        ),
        (
            lambda r: r.inputs.__setitem__(
                0, RequestInput("bits", "UINT8", (0, N, 3), np.zeros((0, N, 3), np.uint8))
            ),
            "has shape [0, 2, 3]",
        ),
        (
            lambda r: setattr(r, "outputs", [RequestOutput("nope")]),
            "unknown output 'nope' (outputs: ['out'])",
        ),
        (
            lambda r: setattr(r, "outputs", [RequestOutput("out"), RequestOutput("out")]),
            "output 'out' is requested more than once",
        ),
    ],
)
def test_validation_errors_never_queue(tmp_path: Path, mutate: Any, message: str) -> None:
    write(tmp_path / "m", cfg_text())

    async def main() -> None:
        repo = await started(tmp_path)
        h = repo.get("m")
        req = request(bits_of(1))
        mutate(req)
        before = h.batcher.depth
        with pytest.raises(InvalidInput) as err:
            await infer(h, req)
        assert message in err.value.message
        assert err.value.message.startswith("model 'm': ")
        assert h.batcher.depth == before == 0
        await repo.stop()

    run(main)


def test_unbatched_model_has_no_batch_dimension(tmp_path: Path) -> None:
    write(tmp_path / "m", cfg_text(max_batch_size=0))

    async def main() -> None:
        repo = await started(tmp_path)
        h = repo.get("m")
        bits = bits_of(1)[0]
        data = np.packbits(bits, axis=-1)
        resp = await infer(
            h, InferRequest(id=None, inputs=[RequestInput("bits", "UINT8", data.shape, data)])
        )
        assert resp.outputs[0].shape == (N, A)
        np.testing.assert_allclose(resp.outputs[0].data, boxcar_reference(bits[None])[0], rtol=1e-6)
        with pytest.raises(InvalidInput, match="max_batch_size 0: no batch dimension"):
            await infer(h, request(bits[None]))
        assert h.metadata()["inputs"][0]["shape"] == [N, 3]
        assert "dynamic_batching" not in h.config()
        await repo.stop()

    run(main)


def test_versions(tmp_path: Path) -> None:
    write(tmp_path / "m" / "1", cfg_text())
    write(tmp_path / "m" / "2", cfg_text(), shift=2.0)

    async def main() -> None:
        repo = await started(tmp_path)
        bits = bits_of(1)
        latest = repo.get("m")
        assert latest.version == "2"
        assert latest.metadata()["versions"] == ["1", "2"]
        r2 = await infer(latest, request(bits))
        r1 = await infer(repo.get("m", "1"), request(bits))
        assert r1.model_version == "1"
        np.testing.assert_allclose(r1.outputs[0].data, boxcar_reference(bits), rtol=1e-6)
        np.testing.assert_allclose(r2.outputs[0].data, boxcar_reference(bits, 2.0), rtol=1e-6)
        for bad in ("3", "01", "-1", "1/../2", ""):
            if bad == "":
                assert repo.get("m", bad).version == "2"
                continue
            with pytest.raises(ModelNotFound, match=r"Request for unknown model: .m. version"):
                repo.get("m", bad)
        await repo.stop()

    run(main)


@pytest.mark.parametrize(
    "name", ["..", "../m", "m/../m", "a/b", "a\\b", "%2e%2e", ".m", "m\x00", "x" * 300]
)
def test_names_that_could_escape_are_not_found(tmp_path: Path, name: str) -> None:
    write(tmp_path / "repo" / "m", cfg_text())
    write(tmp_path / "secret", cfg_text())

    async def main() -> None:
        repo = await started(tmp_path / "repo")
        with pytest.raises(ModelNotFound) as err:
            repo.get(name)
        assert "\x00" not in err.value.message
        assert len(err.value.message) < 200
        with pytest.raises(ModelNotFound):
            await repo.load(name)
        with pytest.raises(ModelNotFound):
            await repo.unload(name)
        await repo.stop()

    run(main)


def test_load_unload_index_and_readiness(tmp_path: Path) -> None:
    write(tmp_path / "m", cfg_text())
    write(tmp_path / "broken", cfg_text().replace("half_width = 1.5", "half_width = -1"))
    metrics = Metrics()

    async def main() -> None:
        repo = await started(tmp_path, metrics=metrics)
        assert not repo.ready  # a model failed to load
        index = {e["name"]: e for e in repo.index()}
        assert index["m"]["state"] == "READY"
        assert index["broken"]["state"] == "UNAVAILABLE"
        assert (
            "broken/config.toml: operator.half_width: Input should be greater than 0"
            in index["broken"]["reason"]
        )
        with pytest.raises(ModelNotReady, match="half_width"):
            repo.get("broken")
        with pytest.raises(InvalidInput, match=r"broken/config\.toml: operator\.half_width"):
            await repo.load("broken")
        with pytest.raises(ModelNotFound, match="no folder"):
            await repo.load("absent")

        # fix it on disk and load it: the repository becomes ready
        write(tmp_path / "broken", cfg_text())
        await repo.load("broken")
        assert repo.ready
        memory = metrics.registry.get_sample_value
        assert memory("bitserve_device_memory_bytes", {"model": "m", "device": "cpu"}) > 0

        # A reload keeps the model's queue-depth series (the new batcher owns it); an unload
        # drops it.
        depth = metrics.registry.get_sample_value
        await repo.load("m")
        assert depth("bitserve_queue_depth", {"model": "m"}) == 0
        h = repo.get("m")
        await repo.unload("m")
        assert depth("bitserve_queue_depth", {"model": "m"}) is None
        with pytest.raises(ModelNotReady, match="version 1 is UNAVAILABLE: unloaded"):
            repo.get("m")
        with pytest.raises(ModelNotReady):
            await infer(h, request(bits_of(1)))
        assert {
            "name": "m",
            "version": "1",
            "state": "UNAVAILABLE",
            "reason": "unloaded",
        } in repo.index()
        assert memory("bitserve_device_memory_bytes", {"model": "m", "device": "cpu"}) == 0
        assert repo.ready  # an explicitly unloaded model does not count

        # a new folder appears in the index before it is loaded, then loads
        write(tmp_path / "later", cfg_text())
        assert {
            "name": "later",
            "version": "",
            "state": "UNAVAILABLE",
            "reason": "not loaded",
        } in repo.index()
        await repo.load("later")
        await repo.load("m")
        assert (await infer(repo.get("m"), request(bits_of(1)))).outputs[0].shape == (1, N, A)
        await repo.stop()

    run(main)


def test_reload_keeps_serving_and_a_failed_reload_keeps_the_old_version(tmp_path: Path) -> None:
    write(tmp_path / "m", cfg_text())

    async def main() -> None:
        repo = await started(tmp_path)
        bits = bits_of(2)
        old = repo.get("m")
        write(tmp_path / "m", cfg_text(), shift=2.0)
        await repo.load("m")
        assert repo.get("m") is not old
        with pytest.raises(ModelNotReady, match="unloading"):  # the retired version refuses
            await infer(old, request(bits))
        r = await infer(repo.get("m"), request(bits))
        np.testing.assert_allclose(r.outputs[0].data, boxcar_reference(bits, 2.0), rtol=1e-6)
        (tmp_path / "m" / "config.toml").write_text("max_batch_size = 'x'\n")
        with pytest.raises(InvalidInput, match="failed to load"):
            await repo.load("m")
        r = await infer(repo.get("m"), request(bits))  # the previous one still serves
        np.testing.assert_allclose(r.outputs[0].data, boxcar_reference(bits, 2.0), rtol=1e-6)
        assert repo.index() == [{"name": "m", "version": "1", "state": "READY", "reason": ""}]
        await repo.unload("m")
        with pytest.raises(InvalidInput):
            await repo.load("m")
        (entry,) = repo.index()
        assert entry["state"] == "UNAVAILABLE"
        assert "m/config.toml: max_batch_size: Input should be a valid integer" in entry["reason"]
        await repo.stop()

    run(main)


def test_exception_in_compute_fails_only_that_batch(tmp_path: Path) -> None:
    write(tmp_path / "m", cfg_text(max_batch_size=1))

    async def main() -> None:
        repo = await started(tmp_path)
        h = repo.get("m")
        real = h.pipeline.run
        calls = {"n": 0}

        def flaky(inputs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("device fell over")
            return real(inputs)

        h.batcher._run_batch = flaky
        results = await asyncio.gather(
            *(infer(h, request(bits_of(1))) for _ in range(3)), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        assert len(errors) == 1
        assert isinstance(errors[0], ServiceError)
        assert errors[0].status_code == 500
        assert "inference failed (RuntimeError); request id" in errors[0].message
        assert "device fell over" not in errors[0].message
        assert (await infer(h, request(bits_of(1)))).outputs[0].shape == (1, N, A)
        await repo.stop()

    run(main)


def test_stop_drains_in_flight_requests(tmp_path: Path) -> None:
    write(tmp_path / "m", cfg_text(max_batch_size=2, delay_us=10_000_000))

    async def main() -> None:
        repo = await started(tmp_path)
        h = repo.get("m")
        pending = asyncio.ensure_future(infer(h, request(bits_of(1))))
        await asyncio.sleep(0.01)
        assert not pending.done()  # waiting for a second request that will not come
        await repo.stop()  # stopping closes the partial batch and computes it
        assert (await pending).outputs[0].shape == (1, N, A)
        with pytest.raises(ModelNotReady):
            await infer(h, request(bits_of(1)))

    run(main)
