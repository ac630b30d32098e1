"""Index models served by a real ``bitserve serve``: REST through our client (bits, packed
bytes, float embeddings; sync and async; the CLI), an unmodified ``tritonclient`` over HTTP
and gRPC with ``parameters.k`` / ``threshold``, RDKit's fingerprint bytes, and bad requests
answered 400 naming what was wrong. Every answer is checked against the NumPy reference."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from bitserve_client import AsyncClient, Client, ServerError
from tritonclient.utils import InferenceServerException

from harness.server import BitserveServer, start_server
from tests.service.index_cases import as_ids, reference_search, write_index

pytestmark = pytest.mark.e2e

Array = np.ndarray[Any, Any]
RNG = np.random.default_rng(32)
FP_BITS = RNG.random((500, 2048)) < 0.05  # sparse, as Morgan fingerprints are
FP = np.packbits(FP_BITS, axis=1, bitorder="little")
FP_IDS = RNG.permutation(10**6)[:500].astype(np.int64) + 10**9
EMB = np.packbits(RNG.standard_normal((400, 256)) > 0, axis=1)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BitserveServer]:
    root = tmp_path_factory.mktemp("index-repo")
    write_index(root / "fp", FP, nbits=2048, ids=FP_IDS, bitorder="little", k=10, max_k=100,
                max_batch_size=16)  # fmt: skip
    write_index(root / "emb", EMB, metric="hamming", npy=True, k=5, max_batch_size=16)
    with start_server(root) as s:
        yield s


def fp_reference(queries: Array, k: int, threshold: float | None = None) -> tuple[Array, Array]:
    rows, scores = reference_search(queries, FP, k, "tanimoto", threshold)
    return as_ids(rows, FP_IDS), scores


def test_client_search_takes_bits_bytes_and_embeddings(server: BitserveServer) -> None:
    bits = RNG.random((4, 2048)) < 0.05
    packed = np.packbits(bits, axis=1, bitorder="little")
    with Client(server.url) as client:
        ids, scores = client.search("fp", bits)
        assert (ids.dtype, scores.dtype, ids.shape) == (np.int64, np.float32, (4, 10))
        want_ids, want_scores = fp_reference(packed, 10)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(scores, want_scores, atol=1e-6)
        again = client.search("fp", packed)  # the model's own bit order (little)
        np.testing.assert_array_equal(again[0], ids)
        one = client.search("fp", bits[0].astype(np.uint8), k=3)  # 0/1, one query
        np.testing.assert_array_equal(one[0], ids[0, :3])
        emb = RNG.standard_normal((3, 256)).astype(np.float32)
        ids, scores = client.search("emb", emb, k=7)
        rows, dist = reference_search(np.packbits(emb > 0, axis=1), EMB, 7, "hamming")
        np.testing.assert_array_equal(ids, rows)  # row numbers: no ids in an .npy
        np.testing.assert_array_equal(scores, dist)


def test_threshold_and_k_per_request(server: BitserveServer) -> None:
    queries = FP[:3].copy()
    with Client(server.url) as client:
        ids, scores = client.search("fp", queries, k=40, threshold=0.08)
    want_ids, want_scores = fp_reference(queries, 40, 0.08)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(scores, want_scores, atol=1e-6)
    assert (ids[:, 0] == FP_IDS[:3]).all()
    assert (scores[:, 0] == 1.0).all()
    assert (ids == -1).any()  # fewer hits than 40
    assert (scores[ids == -1] == 0).all()


def test_rdkit_fingerprints_over_rest(server: BitserveServer, tmp_path: Path) -> None:
    from rdkit import Chem, DataStructs
    from rdkit.Chem import rdFingerprintGenerator

    smiles = ["CCO", "c1ccccc1O", "CC(=O)Oc1ccccc1C(=O)O", "CCN(CC)CC", "c1ccncc1",
              "CC(C)Cc1ccc(cc1)C(C)C(=O)O", "OC(=O)CCC(=O)O", "c1ccc2ccccc2c1"]  # fmt: skip
    (tmp_path / "mols.smi").write_text("".join(f"{s} {100 + i}\n" for i, s in enumerate(smiles)))
    repo = tmp_path / "repo"
    build = [sys.executable, "-m", "service.cli", "index", "build", str(tmp_path / "mols.smi"),
             str(repo / "mols"), "--metric", "tanimoto", "--k", "8"]  # fmt: skip
    subprocess.run(build, check=True, capture_output=True, timeout=120)
    gen = rdFingerprintGenerator.GetMorganGenerator(radius=2, fpSize=2048)
    fps = [gen.GetFingerprint(Chem.MolFromSmiles(s)) for s in smiles]
    raw = np.stack([np.frombuffer(DataStructs.BitVectToBinaryText(f), np.uint8) for f in fps])
    with start_server(repo) as s, Client(s.url) as client:
        ids, scores = client.search("mols", raw[:2], bitorder="little")
        big = np.packbits(np.unpackbits(raw[:2], axis=1, bitorder="little"), axis=1)
        again = client.search("mols", big, bitorder="big")
    for q in range(2):
        sims = np.array(DataStructs.BulkTanimotoSimilarity(fps[q], fps))
        np.testing.assert_allclose(scores[q], sims[ids[q] - 100], atol=1e-6)
        np.testing.assert_allclose(scores[q], np.sort(sims)[::-1], atol=1e-6)
        assert ids[q, 0] == 100 + q
    np.testing.assert_array_equal(again[0], ids)


def test_concurrent_searches_are_batched(server: BitserveServer) -> None:
    queries = np.packbits(RNG.random((32, 2048)) < 0.05, axis=1, bitorder="little")

    async def run() -> list[tuple[Array, Array]]:
        async with AsyncClient(server.url) as client:
            calls = [client.search("fp", queries[i : i + 1], k=5 + i % 3) for i in range(32)]
            return list(await asyncio.gather(*calls))

    answers = asyncio.run(run())
    for i, (ids, scores) in enumerate(answers):
        want_ids, want_scores = fp_reference(queries[i : i + 1], 5 + i % 3)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(scores, want_scores, atol=1e-6)


def test_tritonclient_http_and_grpc(server: BitserveServer) -> None:
    queries = FP[5:8]
    want_ids, want_scores = fp_reference(queries, 6, 0.05)
    h = httpclient.InferenceServerClient(server.host_port)
    inp = httpclient.InferInput("query", list(queries.shape), "UINT8")
    inp.set_data_from_numpy(queries, binary_data=True)
    outs = [httpclient.InferRequestedOutput(n, binary_data=True) for n in ("ids", "scores")]
    res = h.infer("fp", [inp], outputs=outs, parameters={"k": 6, "threshold": 0.05})
    np.testing.assert_array_equal(res.as_numpy("ids"), want_ids)
    np.testing.assert_allclose(res.as_numpy("scores"), want_scores, atol=1e-6)
    meta = h.get_model_metadata("fp")
    assert [o["shape"] for o in meta["outputs"]] == [[-1, -1], [-1, -1]]
    assert meta["parameters"]["index"]["num_rows"] == 500
    config = h.get_model_config("fp")
    index = json.loads(config["parameters"]["index"]["string_value"])
    assert (index["metric"], index["k"], index["max_k"], index["ids"]) == (
        "tanimoto",
        10,
        100,
        "file",
    )
    h.close()
    g = grpcclient.InferenceServerClient(server.grpc_target)
    ginp = grpcclient.InferInput("query", list(queries.shape), "UINT8")
    ginp.set_data_from_numpy(queries)
    gres = g.infer("fp", [ginp], parameters={"k": 6, "threshold": 0.05})
    np.testing.assert_array_equal(gres.as_numpy("ids"), want_ids)
    np.testing.assert_allclose(gres.as_numpy("scores"), want_scores, atol=1e-6)
    with pytest.raises(InferenceServerException, match=r"parameters\.k must be an integer"):
        g.infer("fp", [ginp], parameters={"k": 0})
    g.close()


U8 = {"datatype": "UINT8", "shape": [1, 256]}


@pytest.mark.parametrize(
    ("tensor", "parameters", "needle"),
    [
        (U8, {"k": 0}, "parameters.k must be an integer from 1 to max_k = 100, got 0"),
        (U8, {"k": 101}, "got 101"),
        (U8, {"threshold": 1.5}, "parameters.threshold must be a number from 0 to 1, got 1.5"),
        ({"datatype": "UINT8", "shape": [1, 255]}, {},
         "input 'query' has shape [1, 255]; expected [batch, 256] for UINT8"),
        ({"datatype": "FP32", "shape": [1, 256]}, {},
         "input 'query' has datatype FP32; expected UINT8"),
    ],
)  # fmt: skip
def test_bad_requests_are_400_naming_the_problem(
    server: BitserveServer, tensor: dict[str, Any], parameters: dict[str, Any], needle: str
) -> None:
    n = int(np.prod(tensor["shape"]))
    body = {"inputs": [{"name": "query", **tensor, "data": [0] * n}], "parameters": parameters}
    r = httpx.post(f"{server.url}/v2/models/fp/infer", json=body, timeout=30)
    assert r.status_code == 400
    assert needle in r.json()["error"]
    with Client(server.url) as client, pytest.raises(ServerError, match="metric is hamming"):
        client.search("emb", EMB[:1], threshold=0.5)


def test_client_cli_search(
    server: BitserveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bitserve_client._cli import main

    np.save(tmp_path / "q.npy", FP[:2])
    out = tmp_path / "hits.npz"
    args = ["--url", server.url, "search", "fp", str(tmp_path / "q.npy"), "--k", "4"]
    assert main([*args, "--output", str(out)]) == 0
    with np.load(out) as saved:
        want_ids, _ = fp_reference(FP[:2], 4)
        np.testing.assert_array_equal(saved["ids"], want_ids)
    capsys.readouterr()
    assert main(args) == 0
    assert capsys.readouterr().out.startswith(f"query 0: {FP_IDS[0]}:1 ")
