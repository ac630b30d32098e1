"""End to end on a real Ray cluster of two simulated nodes (``ray.cluster_utils.Cluster``).

- ``bitserve score`` (a real process joining the cluster) scores a folder of Parquet files,
  and its results are the same as a real ``bitserve serve`` process's answers for the same
  rows; run again after an output file is lost, it scores only those rows;
- ``service.ray.score`` on ``ray.data.read_parquet`` (binary and fixed-size list columns);
- the Serve deployment answers V2 requests: ``tritonclient`` with the binary extension,
  ``bitserve_client``, errors as ``{"error": ...}``;
- a node that dies mid-job loses no rows: the job ends with every row written exactly once.

The cluster is small (2 logical CPUs and one ``scorer`` slot a node, 100 MiB object stores,
no dashboard); one cluster serves the module and is shut down after it.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness.fingerprints import (
    MODEL,
    PACKED,
    fingerprint_table,
    packed_fingerprints,
    reference_scores,
    slow_reference,
    write_fingerprint_repository,
    write_slow_fingerprint_model,
)
from harness.server import bitserve_command, free_port, start_server

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

# Every node on 127.0.0.1 (tests/ray/conftest.py keeps Ray on the loopback).
NODE = {"num_cpus": 2, "resources": {"scorer": 1}, "object_store_memory": 100 << 20}
ROWS = {"a": 700, "b": 300}  # two input files


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A head and a worker node; this process is the driver."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    c.add_node(**NODE)
    c.wait_for_nodes()
    assert c.address.startswith("127.0.0.1:")
    ray.init(address=c.address, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = write_fingerprint_repository(tmp_path_factory.mktemp("models"), max_batch_size=64)
    return write_slow_fingerprint_model(root, rounds=20)


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two Parquet files of molecules (id, fp as 256-byte binary, weight), several row
    groups each."""
    folder = tmp_path_factory.mktemp("library")
    start = 0
    for seed, (name, rows) in enumerate(ROWS.items()):
        table = fingerprint_table(rows, seed=seed, start=start)
        pq.write_table(table, folder / f"{name}.parquet", row_group_size=200)
        start += rows
    return folder


def _read_output(folder: Path) -> pa.Table:
    files = sorted(folder.rglob("*.parquet"))
    return pa.concat_tables([pq.read_table(f) for f in files])


def _scores(table: pa.Table, column: str = "score") -> np.ndarray:
    return np.stack(table.column(column).to_numpy(zero_copy_only=False)).astype(np.float32)


def _score_cli(cluster: Any, repository: Path, src: Path, out: Path, *args: str) -> str:
    cmd = [*bitserve_command(), "score", "--address", cluster.address, "--model-repository",
           str(repository), "--model", MODEL, *args, str(src), str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_score_cli_matches_the_server_and_resumes(
    cluster: Any, repository: Path, library: Path, tmp_path: Path
) -> None:
    out = tmp_path / "scores"
    said = _score_cli(cluster, repository, library, out, "--rows-per-task", "250")
    assert "1000 row(s) scored, 0 already there, 2 file(s)" in said
    assert sorted(p.name for p in out.iterdir()) == ["a", "b"]
    table = _read_output(out)
    assert table.column_names == ["id", "weight", "score"]
    ids = table.column("id").to_pylist()
    assert sorted(ids) == sorted(f"mol-{i}" for i in range(1000))  # complete, unique
    order = [int(i.removeprefix("mol-")) for i in ids]
    np.testing.assert_array_equal(table.column("weight").to_numpy(), np.array(order) / 7)

    # The same rows through a real server: the same pipeline, the same answers.
    packed = np.concatenate([packed_fingerprints(n, seed) for seed, n in enumerate(ROWS.values())])
    from bitserve_client import Client

    with start_server(repository) as server, Client(server.url) as client:
        served = np.concatenate(
            [client.infer(MODEL, {"fp": packed[i : i + 64]})["score"] for i in range(0, 1000, 64)]
        )
    np.testing.assert_allclose(_scores(table), served[order], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(served, reference_scores(packed), rtol=1e-4, atol=1e-4)

    # Resume: only the rows of a lost output file are scored again.
    lost = sorted((out / "a").iterdir())[1]
    first, stop = (int(x) for x in lost.stem.split("-"))
    lost.unlink()
    said = _score_cli(cluster, repository, library, out, "--threads", "1")
    assert f"{stop - first} row(s) scored, {1000 - (stop - first)} already there" in said
    again = _read_output(out)
    assert sorted(again.column("id").to_pylist()) == sorted(ids)


def test_score_a_dataset_read_with_read_parquet(
    cluster: Any, repository: Path, tmp_path: Path
) -> None:
    from service.ray import score

    packed = packed_fingerprints(300, seed=7)
    fixed = pa.FixedSizeListArray.from_arrays(pa.array(packed.reshape(-1)), PACKED)
    table = pa.table({"key": np.arange(300), "fp": fixed})
    pq.write_table(table, tmp_path / "fsl.parquet", row_group_size=100)
    ds = score(ray.data.read_parquet(str(tmp_path / "fsl.parquet")), repository, MODEL)
    rows = ds.take_all()
    assert sorted(r["key"] for r in rows) == list(range(300))
    assert set(rows[0]) == {"key", "score"}
    got = np.array([r["score"] for r in sorted(rows, key=lambda r: r["key"])])
    np.testing.assert_allclose(got, reference_scores(packed), rtol=1e-4, atol=1e-4)


def test_serve_deployment_answers_v2(cluster: Any, repository: Path) -> None:
    import tritonclient.http as tc
    from bitserve_client import Client
    from ray import serve

    from service.ray import deployment

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    try:
        app = deployment(repository, num_replicas=1).bind()
        serve.run(app, name="bitserve", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/v2/health/ready").status_code == 200
        packed = packed_fingerprints(10, seed=12)
        ref = reference_scores(packed)

        client = tc.InferenceServerClient(f"127.0.0.1:{port}")
        inp = tc.InferInput("fp", [10, PACKED], "UINT8")
        inp.set_data_from_numpy(packed, binary_data=True)
        wanted = tc.InferRequestedOutput("score", binary_data=True)
        result = client.infer(MODEL, [inp], outputs=[wanted])
        assert result.get_response()["outputs"][0]["parameters"]["binary_data_size"] == 40
        np.testing.assert_allclose(result.as_numpy("score"), ref, rtol=1e-4, atol=1e-4)
        assert client.get_model_metadata(MODEL)["inputs"][0]["datatype"] == "UINT8"

        with Client(url) as bc:
            out = bc.infer(MODEL, {"fp": np.unpackbits(packed, axis=-1).astype(bool)})
            np.testing.assert_allclose(out["score"], ref, rtol=1e-4, atol=1e-4)

        r = httpx.post(url + "/v2/models/nope/infer", content=b"{}", headers={"X-Request-ID": "r1"})
        assert r.status_code == 404
        assert r.json() == {"error": "Request for unknown model: 'nope' is not found"}
        assert r.headers.get_list("x-request-id") == ["r1"]
        bad = httpx.post(url + f"/v2/models/{MODEL}/infer", content=b'{"inputs": 3}')
        assert bad.status_code == 400
        assert "error" in bad.json()
    finally:
        serve.shutdown()


def test_a_node_lost_mid_job_loses_no_rows(cluster: Any, repository: Path, tmp_path: Path) -> None:
    """One scoring actor a node (the ``scorer`` slot); the worker node is killed once the
    first output file is written, and a fresh node takes its place (as an autoscaler would)."""
    from service.ray import score_files

    rows = 4000
    src = tmp_path / "big.parquet"
    pq.write_table(fingerprint_table(rows, seed=21), src, row_group_size=500)
    out = tmp_path / "scores"
    result: dict[str, Any] = {}

    def job() -> None:
        try:
            result["report"] = score_files(
                str(src), str(out), repository, "slow_fingerprint", rows_per_task=250,
                actors=2, resources={"scorer": 1},
            )  # fmt: skip
        except BaseException as e:  # reported by the test below
            result["error"] = e

    worker = next(iter(cluster.worker_nodes))
    thread = threading.Thread(target=job)
    thread.start()
    deadline = time.monotonic() + 300
    while not list(out.rglob("0*.parquet")) and time.monotonic() < deadline:
        assert thread.is_alive(), result
        time.sleep(0.2)
    assert thread.is_alive(), "the job ended before the node could be lost"
    cluster.remove_node(worker, allow_graceful=False)
    cluster.add_node(**NODE)
    thread.join(600)
    assert not thread.is_alive()
    assert "error" not in result, result.get("error")
    assert result["report"].scored == rows
    table = _read_output(out)
    ids = table.column("id").to_pylist()
    assert len(ids) == rows
    assert sorted(ids) == sorted(f"mol-{i}" for i in range(rows))
    order = [int(i.removeprefix("mol-")) for i in ids]
    ref = slow_reference(packed_fingerprints(rows, seed=21))
    np.testing.assert_allclose(_scores(table), ref[order], rtol=1e-5)
