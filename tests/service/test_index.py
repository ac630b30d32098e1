"""The ``[index]`` model kind in process: config, corpus checks, the pipeline against a NumPy
reference and the gpu_ops op, request parameters, bit order, and one corpus per content."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gpu_ops
from service.errors import InvalidInput
from service.index.corpus import STORE
from service.index.pipeline import DRY_RUN_ROWS, IndexPipeline
from service.models.builder import build_version, check_repository
from service.models.config import ConfigError, parse_config
from service.models.layout import model_versions
from service.models.signature import Signature
from service.protocol.types import InferRequest, RequestInput
from tests.common_utils import cpu_and_cuda
from tests.service.index_cases import as_ids, random_bits, reference_search, write_index

Array = np.ndarray[Any, Any]
LIMIT = 1 << 30


def build(folder: Path, device: str = "cpu") -> tuple[IndexPipeline, Signature]:
    src = model_versions(folder.parent, folder.name)["1"]
    cfg, pipe = build_version(folder.name, src, default_device=device, max_operator_bytes=LIMIT)
    assert isinstance(pipe, IndexPipeline)
    assert pipe.device.type == device
    return pipe, Signature(folder.name, cfg, pipe.output_shapes)


def bind(sig: Signature, queries: Array, datatype: str = "UINT8", **parameters: Any) -> Any:
    inp_params = {}
    if "bitorder" in parameters:
        inp_params["bitorder"] = parameters.pop("bitorder")
    inp = RequestInput("query", datatype, queries.shape, queries, inp_params)
    return sig.bind(InferRequest(id=None, inputs=[inp], parameters=parameters))


def search(pipe: IndexPipeline, sig: Signature, queries: Array, **parameters: Any) -> list[Array]:
    return pipe.run([bind(sig, queries, **parameters)])[0]


# --- config -----------------------------------------------------------------------------------

GOOD = {
    "max_batch_size": 8,
    "inputs": [{"name": "query", "datatype": "BOOL", "shape": [64], "packing": "bits"}],
    "index": {"file": "corpus.safetensors", "metric": "tanimoto"},
    "outputs": [{"name": "ids", "datatype": "INT64"}, {"name": "scores", "datatype": "FP32"}],
}


def problems(**changes: Any) -> str:
    try:
        parse_config({**GOOD, **changes}, "m/config.toml")
    except ConfigError as exc:
        return "\n".join(exc.problems)
    return ""


def test_config_accepts_an_index_and_defaults_k() -> None:
    cfg = parse_config(GOOD, "m/config.toml")
    assert cfg.index is not None
    assert (cfg.index.k, cfg.index.max_k) == (10, 1000)
    assert cfg.index_outputs == (0, 1)


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"operator": {"file": "op.safetensors", "response": "gaussian", "sigma": 1.0}},
         "takes no [operator] or [model]"),
        ({"inputs": [{"name": "query", "datatype": "BOOL", "shape": [64]}]}, 'packing = "bits"'),
        ({"inputs": [{"name": "q", "datatype": "BOOL", "shape": [2, 64], "packing": "bits"}]},
         "shape = [L]"),
        ({"outputs": [{"name": "ids", "datatype": "INT32"}, {"name": "s", "datatype": "FP32"}]},
         "ids (INT64) and the scores (FP32)"),
        ({"outputs": [{"name": "ids", "datatype": "INT64", "shape": [3]},
                      {"name": "scores", "datatype": "FP32"}]}, "answers [k] = [10]"),
        ({"index": {"file": "c.safetensors", "metric": "tanimoto", "k": 20, "max_k": 10}},
         "k = 20 is more than max_k = 10"),
        ({"index": {"file": "c.pt", "metric": "tanimoto"}}, ".safetensors, .npy"),
        ({"index": {"file": "c.npy", "metric": "cosine"}}, "index.metric"),
    ],
)  # fmt: skip
def test_config_refuses_a_bad_index(changes: dict[str, Any], needle: str) -> None:
    assert needle in problems(**changes)


# --- check-repo ---------------------------------------------------------------------------------


def test_check_repo_passes_a_good_index(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    corpus = np.packbits(random_bits(rng, 20, 64), axis=1)
    write_index(tmp_path / "repo" / "fp", corpus, ids=np.arange(20, dtype=np.int64) * 3)
    write_index(tmp_path / "repo" / "emb", corpus, metric="hamming", npy=True)
    assert check_repository(tmp_path / "repo", max_operator_bytes=LIMIT) == []


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"ids": np.array([1, 2, 3, 2, 5, 6], np.int64)},
         "ids are not unique: 2 is the id of rows 1 and 3"),
        ({"k": 7}, "index.k: k = 7 is more than the corpus's 6 rows"),
        ({"ids": np.arange(6, dtype=np.int32)}, "tensor 'ids' is I32 [6]; needs I64"),
        ({"ids": np.arange(5, dtype=np.int64)}, "ids has shape [5]; needs [6]"),
        ({"nbits": 72}, "rows of 8 bytes; inputs[0].shape [72] needs 9"),
        ({"nbits": 60}, "row 0 (and 5 more) has bits set past bit 60"),
    ],
)  # fmt: skip
def test_check_repo_names_what_is_wrong(
    tmp_path: Path, kwargs: dict[str, Any], needle: str
) -> None:
    corpus = np.full((6, 8), 0xFF, np.uint8)
    write_index(tmp_path / "repo" / "fp", corpus, k=kwargs.pop("k", 3), **kwargs)
    found = check_repository(tmp_path / "repo", max_operator_bytes=LIMIT)
    assert any(needle in p for p in found), found
    assert all(p.startswith("repo/fp/config.toml: index.") for p in found), found


def test_check_repo_refuses_a_corpus_of_the_wrong_dtype(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    folder = write_index(tmp_path / "repo" / "fp", np.zeros((4, 8), np.uint8), k=2)
    save_file({"corpus": np.zeros((4, 8), np.float32)}, str(folder / "corpus.safetensors"))
    np.save(folder / "bits.npy", np.zeros((4, 64), bool))
    found = check_repository(tmp_path / "repo", max_operator_bytes=LIMIT)
    assert any("tensor 'corpus' is F32 [4, 8]; needs U8" in p for p in found), found
    text = (folder / "config.toml").read_text().replace("corpus.safetensors", "bits.npy")
    (folder / "config.toml").write_text(text)
    found = check_repository(tmp_path / "repo", max_operator_bytes=LIMIT)
    assert any("holds bool [4, 64]; needs uint8 (N, W)" in p for p in found), found


def test_check_repo_refuses_a_file_that_is_not_safetensors(tmp_path: Path) -> None:
    folder = write_index(tmp_path / "repo" / "fp", np.zeros((4, 8), np.uint8), k=2)
    (folder / "corpus.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    found = check_repository(tmp_path / "repo", max_operator_bytes=LIMIT)
    assert len(found) == 1, found
    assert "not a readable safetensors file" in found[0]


# --- the search against the references ----------------------------------------------------------


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("metric", ["tanimoto", "hamming"])
@pytest.mark.parametrize("with_ids", [True, False])
def test_search_equals_the_references(
    tmp_path: Path, metric: str, with_ids: bool, device: str
) -> None:
    rng = np.random.default_rng(1)
    corpus = np.packbits(random_bits(rng, 300, 200), axis=1)
    corpus[7] = corpus[3]  # a tie: the lower row first
    ids = rng.permutation(10_000)[:300].astype(np.int64) if with_ids else None
    folder = write_index(tmp_path / "fp", corpus, metric=metric, ids=ids, nbits=200)
    pipe, sig = build(folder, device)
    queries = np.packbits(random_bits(rng, 6, 200), axis=1)
    queries[0] = corpus[3]
    got_ids, got_scores = search(pipe, sig, queries, k=12)
    rows, scores = reference_search(queries, corpus, 12, metric)
    np.testing.assert_array_equal(got_ids, as_ids(rows, ids))
    np.testing.assert_allclose(got_scores, scores, rtol=0, atol=1e-6)
    # the plain op over the whole corpus agrees too
    q, c = torch.from_numpy(queries), torch.from_numpy(corpus)
    if metric == "tanimoto":
        op_scores, op_rows = gpu_ops.tanimoto_topk(q, c, 12)
    else:
        dist, op_rows = gpu_ops.hamming_topk(q, c, 12)
        op_scores = dist.float()
    np.testing.assert_array_equal(got_ids, as_ids(op_rows.numpy(), ids))
    np.testing.assert_array_equal(got_scores, op_scores.numpy())
    assert got_ids[0, 0] == as_ids(np.array([3]), ids)[0]
    assert got_ids[0, 1] == as_ids(np.array([7]), ids)[0]


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_one_batch_answers_each_request_its_own_k_and_threshold(
    tmp_path: Path, device: str
) -> None:
    rng = np.random.default_rng(2)
    corpus = np.packbits(random_bits(rng, 100, 64), axis=1)
    pipe, sig = build(write_index(tmp_path / "fp", corpus, k=4), device)
    queries = np.packbits(random_bits(rng, 5, 64), axis=1)
    asks = [{}, {"k": 9}, {"k": 3, "threshold": 0.3}, {"threshold": 0.25}, {"k": 20}]
    bound = [bind(sig, queries[i : i + 1], **a) for i, a in enumerate(asks)]
    answers = pipe.run(bound)
    for i, (a, (ids, scores)) in enumerate(zip(asks, answers, strict=True)):
        k = a.get("k", 4)
        rows, want = reference_search(queries[i : i + 1], corpus, k, "tanimoto", a.get("threshold"))
        assert ids.shape == scores.shape == (1, k)
        np.testing.assert_array_equal(ids, rows)
        np.testing.assert_allclose(scores, want, atol=1e-6)


def test_k_past_the_corpus_and_a_high_threshold_leave_empty_slots(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    corpus = np.packbits(random_bits(rng, 6, 32), axis=1)
    for metric, empty in (("tanimoto", 0.0), ("hamming", -1.0)):
        pipe, sig = build(write_index(tmp_path / metric, corpus, metric=metric, k=2))
        ids, scores = search(pipe, sig, corpus[:2], k=9)
        assert (ids[:, 6:] == -1).all()
        assert (scores[:, 6:] == empty).all()
        assert sorted(ids[0, :6].tolist()) == list(range(6))
    pipe, sig = build(tmp_path / "tanimoto")
    ids, scores = search(pipe, sig, corpus[:1], k=4, threshold=1.0)
    assert ids[0].tolist() == [0, -1, -1, -1]
    assert scores[0].tolist() == [1.0, 0, 0, 0]


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_bool_queries_and_either_bit_order_give_the_same_answer(
    tmp_path: Path, device: str
) -> None:
    rng = np.random.default_rng(4)
    bits = random_bits(rng, 50, 100)  # 100 bits: 4 padding bits in the last byte
    corpus = np.packbits(bits, axis=1, bitorder="little")
    folder = write_index(tmp_path / "fp", corpus, nbits=100, bitorder="little")
    pipe, sig = build(folder, device)
    q = random_bits(rng, 3, 100)
    want = search(pipe, sig, np.packbits(q, axis=1, bitorder="little"), k=7)
    as_bool = search(pipe, sig, q, datatype="BOOL", k=7)
    # BOOL and packed requests in one batch: the BOOL one packed on the device
    mixed = pipe.run([bind(sig, q, datatype="BOOL", k=7), bind(sig, noisy_packed(q), k=7)])
    for answer in mixed:
        np.testing.assert_array_equal(answer[0], as_bool[0])
    big = search(pipe, sig, np.packbits(q, axis=1, bitorder="big"), k=7, bitorder="big")
    padded = search(pipe, sig, noisy_packed(q), k=7)
    for other in (as_bool, big, padded):
        np.testing.assert_array_equal(other[0], want[0])
        np.testing.assert_array_equal(other[1], want[1])
    rows, _ = reference_search(np.packbits(q, axis=1), np.packbits(bits, axis=1), 7, "tanimoto")
    np.testing.assert_array_equal(want[0], rows)


def test_rdkit_fingerprint_bytes_are_little_bit_order(tmp_path: Path) -> None:
    from rdkit import Chem, DataStructs
    from rdkit.Chem import rdFingerprintGenerator

    smiles = ["CCO", "c1ccccc1O", "CC(=O)Oc1ccccc1C(=O)O", "CCN(CC)CC", "c1ccncc1", "CCCCCC",
              "OC(=O)CCC(=O)O", "c1ccc2ccccc2c1", "CC(C)Cc1ccc(cc1)C(C)C(=O)O",
              "CCOC(=O)C"]  # fmt: skip
    gen = rdFingerprintGenerator.GetMorganGenerator(radius=2, fpSize=2048)
    fps = [gen.GetFingerprint(Chem.MolFromSmiles(s)) for s in smiles]
    corpus = np.stack([np.frombuffer(DataStructs.BitVectToBinaryText(f), np.uint8) for f in fps])
    pipe, sig = build(write_index(tmp_path / "mols", corpus, nbits=2048, bitorder="little", k=10))
    for i, fp in enumerate(fps[:3]):
        ids, scores = search(pipe, sig, corpus[i : i + 1])
        rdkit_sims = np.array(DataStructs.BulkTanimotoSimilarity(fp, fps))
        np.testing.assert_allclose(scores[0], rdkit_sims[ids[0]], atol=1e-6)
        np.testing.assert_allclose(np.sort(scores[0])[::-1], np.sort(rdkit_sims)[::-1], atol=1e-6)
        assert ids[0, 0] == i


def noisy_packed(bits: Array) -> Array:
    """100 bits packed little-endian, the 4 padding bits past bit 100 set (they count for
    nothing)."""
    packed = np.packbits(bits, axis=1, bitorder="little")
    packed[:, -1] |= 0xF0
    return packed


# --- request parameters -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parameters", "needle"),
    [
        ({"k": 0}, "parameters.k must be an integer from 1 to max_k = 50, got 0"),
        ({"k": 51}, "got 51"),
        ({"k": True}, "got True"),
        ({"k": 2.0}, "got 2.0"),
        ({"threshold": 1.5}, "parameters.threshold must be a number from 0 to 1, got 1.5"),
        ({"threshold": -0.1}, "got -0.1"),
        ({"threshold": "0.5"}, "got '0.5'"),
    ],
)
def test_bad_parameters_are_refused_by_name(
    tmp_path: Path, parameters: dict[str, Any], needle: str
) -> None:
    corpus = np.zeros((8, 8), np.uint8)
    _, sig = build(write_index(tmp_path / "fp", corpus, k=2))
    with pytest.raises(InvalidInput, match="model 'fp'") as info:
        bind(sig, corpus[:1], **parameters)
    assert needle in info.value.message


def test_a_threshold_on_a_hamming_index_is_refused(tmp_path: Path) -> None:
    corpus = np.zeros((8, 8), np.uint8)
    _, sig = build(write_index(tmp_path / "emb", corpus, metric="hamming", k=2))
    with pytest.raises(InvalidInput, match="this index's metric is hamming"):
        bind(sig, corpus[:1], threshold=0.5)


def test_metadata_shows_the_index(tmp_path: Path) -> None:
    corpus = np.zeros((8, 8), np.uint8)
    pipe, sig = build(write_index(tmp_path / "fp", corpus, k=2, ids=np.arange(8) + 100))
    index = pipe.parameters()["index"]
    assert index | {"corpus_sha256": None} == {
        "metric": "tanimoto", "k": 2, "max_k": 50, "num_rows": 8, "width_bits": 64,
        "ids": "file", "corpus_sha256": None,
    }  # fmt: skip
    assert [o["shape"] for o in sig.output_metadata()] == [[-1, -1], [-1, -1]]
    assert [o["dims"] for o in sig.output_config()] == [[-1], [-1]]


# --- residency ----------------------------------------------------------------------------------


def test_models_with_the_same_corpus_share_one_copy(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    corpus = np.packbits(random_bits(rng, 40, 64), axis=1)
    a, _ = build(write_index(tmp_path / "a", corpus))
    b, _ = build(write_index(tmp_path / "b", corpus, metric="hamming", k=3))
    other = corpus.copy()
    other[0] ^= 1
    c, _ = build(write_index(tmp_path / "c", other))
    assert a.resident is b.resident  # a copy of the file: found by its hash
    assert c.resident is not a.resident
    again, _ = build(tmp_path / "a")  # the same file: found by its identity and hash
    assert again.resident is a.resident
    del again
    shared = weakref.ref(a.resident)
    gc.collect()
    before = len(STORE)
    del a
    gc.collect()
    assert shared() is not None  # b still holds it
    del b
    gc.collect()
    assert shared() is None
    assert len(STORE) == before - 1


def test_the_dry_run_searches_a_few_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    original = gpu_ops.PackedCorpus.tanimoto_topk

    def spy(self: Any, queries: torch.Tensor, k: int, threshold: float = 0.0) -> Any:
        seen.append(self.num_rows)
        return original(self, queries, k, threshold=threshold)

    monkeypatch.setattr(gpu_ops.PackedCorpus, "tanimoto_topk", spy)
    rng = np.random.default_rng(6)
    corpus = np.packbits(random_bits(rng, 500, 64), axis=1)
    build(write_index(tmp_path / "fp", corpus))
    assert seen
    assert max(seen) == DRY_RUN_ROWS


def test_an_index_pipeline_has_every_attribute_a_pipeline_has(tmp_path: Path) -> None:
    """IndexPipeline sets the state Pipeline's staging and timing read itself: a new
    attribute of Pipeline's must be given to it too."""
    from service.models.builder import build_pipeline
    from service.models.demo import demo_config, demo_tensors
    from service.models.files import Artifacts

    tensors = {k: torch.from_numpy(v) for k, v in demo_tensors().items()}
    plain = build_pipeline("demo", demo_config(None), Artifacts(tensors), "cpu", warmup=False)
    index, _ = build(write_index(tmp_path / "fp", np.zeros((8, 8), np.uint8), k=2))
    assert set(vars(plain)) - set(vars(index)) == set()
