"""The response cache's fast paths against their plain references, on fresh random inputs:
``cache_key`` (a hashed head per request form, kept on the header cache's forms) against
``reference_key`` (the whole key written out each time), and the store (one bytes object per
answer, an LRU by bytes with a set of keys per version) against a plain list; and a request
decoded from a kept header, through the data plane, hit and missed as any other."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from service.batching.queue import BatchInfo
from service.dataplane import DataPlane, infer
from service.models import response_cache
from service.models.config import ModelConfig
from service.models.response_cache import (
    DOORKEEPER_MIN,
    ENTRY_OVERHEAD,
    ResponseCache,
    cache_key,
    reference_key,
)
from service.models.signature import Signature
from service.observability.metrics import Metrics
from service.observability.statistics import triton_metrics
from service.protocol import InferRequest, InferResponse, decode_infer_request
from service.protocol.header_cache import HeaderCache
from tests.service.test_repository import bits_of, boxcar_reference, cfg_text, run, write
from tests.service.test_response_cache import CACHED, cached_repo

WIRE = {"UINT8": np.uint8, "INT16": np.int16, "INT32": np.int32, "FP16": np.float16,
        "FP32": np.float32, "FP64": np.float64, "BOOL": np.bool_}  # fmt: skip


def random_config(rng: np.random.Generator) -> ModelConfig:
    """A model of 1 to 3 inputs (some bit-packed, either bit order) and 1 to 3 outputs."""
    inputs: list[dict[str, Any]] = []
    for i in range(int(rng.integers(1, 4))):
        if rng.random() < 0.4:
            inputs.append({"name": f"in{i}", "datatype": "BOOL", "packing": "bits",
                           "shape": [int(rng.integers(1, 4)), int(rng.integers(1, 20))],
                           "bitorder": str(rng.choice(["big", "little"]))})  # fmt: skip
        else:
            shape = [int(d) for d in rng.integers(1, 4, int(rng.integers(1, 3)))]
            inputs.append({"name": f"in{i}", "datatype": str(rng.choice(list(WIRE))),
                           "shape": shape})  # fmt: skip
    outputs = [{"name": f"out{i}", "datatype": "FP32"} for i in range(int(rng.integers(1, 4)))]
    return ModelConfig.model_validate(
        {"max_batch_size": 8, "inputs": inputs, "model": {"file": "m.pt"}, "outputs": outputs}
    )


def version(cfg: ModelConfig, name: str, v: str) -> SimpleNamespace:
    """What a key reads of a model version (a signature of its own, as a handle has)."""
    shapes = [[1] for _ in cfg.outputs]
    return SimpleNamespace(name=name, version=v, cfg=cfg, signature=Signature(name, cfg, shapes))


def random_form(rng: np.random.Generator, cfg: ModelConfig) -> dict[str, Any]:
    """How a client asks: its batch, each input's wire form and parameters, the outputs it
    names (or none), and request parameters; some change the answer (``k``, ``threshold``),
    some do not (``priority``, ``timeout``, the binary forms)."""

    def params(*choices: tuple[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in choices if rng.random() < 0.3}

    inputs = []
    for spec in cfg.inputs:
        packed = spec.packing == "bits" and rng.random() < 0.7
        extra = params(("k", int(rng.integers(1, 4))), ("threshold", 0.5))
        if packed and rng.random() < 0.5:
            extra["bitorder"] = str(rng.choice(["big", "little"]))
        inputs.append((packed, extra))
    names = [o.name for o in cfg.outputs]
    outputs = None
    if rng.random() < 0.6:
        chosen = rng.permutation(names)[: int(rng.integers(1, len(names) + 1))]
        outputs = [{"name": str(n), "parameters": {"binary_data": True,
                    **params(("k", int(rng.integers(1, 4))))}} for n in chosen]  # fmt: skip
    top = params(("priority", 1), ("timeout", 50_000), ("k", int(rng.integers(1, 4))),
                 ("threshold", float(rng.random())), ("binary_data_output", True))  # fmt: skip
    return {"batch": int(rng.integers(1, 4)), "inputs": inputs, "outputs": outputs,
            "parameters": top}  # fmt: skip


def body_of(rng: np.random.Generator, cfg: ModelConfig, form: dict[str, Any]) -> tuple[bytes, int]:
    """A binary V2 request of ``form`` with fresh random data, and its header's length."""
    heads, arrays = [], []
    for spec, (packed, extra) in zip(cfg.inputs, form["inputs"], strict=True):
        if packed:
            datatype, shape = "UINT8", spec.packed_shape
            arr = rng.integers(0, 256, [form["batch"], *shape]).astype(np.uint8)
        else:
            datatype, shape = spec.datatype, spec.shape
            dtype = WIRE[datatype]
            full = [form["batch"], *shape]
            arr = (rng.integers(0, 2, full).astype(dtype) if dtype is np.bool_
                   else (rng.standard_normal(full) * 50).astype(dtype))  # fmt: skip
        arrays.append(arr)
        heads.append({"name": spec.name, "datatype": datatype, "shape": list(arr.shape),
                      "parameters": {"binary_data_size": arr.nbytes, **extra}})  # fmt: skip
    header: dict[str, Any] = {"inputs": heads, "parameters": form["parameters"]}
    if form["outputs"] is not None:
        header["outputs"] = form["outputs"]
    head = json.dumps(header).encode()
    return head + b"".join(a.tobytes() for a in arrays), len(head)


@pytest.mark.parametrize("seed", range(4))
def test_cache_key_is_the_reference_key_on_fresh_random_requests(seed: int) -> None:
    rng = np.random.default_rng(seed)
    formed = 0
    for _ in range(15):
        cfg = random_config(rng)
        # Two versions of one config (a reload): a form's head must follow the version.
        versions = [version(cfg, "m", "1"), version(cfg, "m", "2")]
        headers = HeaderCache()
        forms = [random_form(rng, cfg) for _ in range(3)]
        for i in range(12):
            body, n = body_of(rng, cfg, forms[i % 3])
            kept = headers.decode(body, n, versions[0].signature, None)
            plain = decode_infer_request(body, n, versions[0].signature, None)
            assert plain.form is None
            formed += kept.form is not None
            keys = set()
            for h in versions if rng.random() < 0.5 else versions[::-1]:
                for req in (kept, plain, kept):
                    bound = h.signature.bind(req)
                    key = cache_key(h, req, bound)
                    assert key == reference_key(h, req, bound)
                    keys.add(key)
            assert len(keys) == 2  # one per version; the same with a form or without
    assert formed > 0  # the forms' path ran


def test_a_form_is_shared_by_a_kept_headers_requests_only() -> None:
    rng = np.random.default_rng(9)
    cfg = random_config(rng)
    sig = version(cfg, "m", "1").signature
    headers = HeaderCache()
    one, other = random_form(rng, cfg), random_form(rng, cfg)
    first = [headers.decode(*body_of(rng, cfg, one), sig, None) for _ in range(3)]
    second = [headers.decode(*body_of(rng, cfg, other), sig, None) for _ in range(2)]
    assert first[0].form is None  # decoded in full: its header kept from now on
    assert first[1].form is not None
    assert first[1].form is first[2].form
    assert second[1].form is not None
    assert second[1].form is not first[1].form


class PlainLRU:
    """The store's reference: a list, least recently used first, of ``[key, version,
    copies of the outputs, batch, bytes]``; an equal key already stored stays (now the most
    recently used)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: list[list[Any]] = []
        self.last = 0  # the last stored entry's bytes
        self.missed: list[list[bytes]] = [[], []]  # the doorkeeper: newest generation first

    def admit(self, key: bytes) -> bool:
        if sum(e[4] for e in self.entries) + self.last <= self.size:
            return True
        if key in self.missed[0] or key in self.missed[1]:
            return True
        self.missed[0].append(key)
        if len(self.missed[0]) >= max(response_cache.DOORKEEPER_MIN, len(self.entries)):
            self.missed = [[], self.missed[0]]
        return False

    def get(self, key: bytes) -> tuple[list[np.ndarray], BatchInfo] | None:
        for i, e in enumerate(self.entries):
            if e[0] == key:
                self.entries.append(self.entries.pop(i))
                return e[2], e[3]
        return None

    def put(self, key: bytes, v: tuple[str, str], arrays: list[np.ndarray], info: Any) -> None:
        nbytes = ENTRY_OVERHEAD + sum(a.nbytes for a in arrays)
        if len(arrays) > 1:  # several outputs: each starts at a multiple of 16
            nbytes = ENTRY_OVERHEAD
            for a in arrays:
                nbytes += -(nbytes - ENTRY_OVERHEAD) % 16 + a.nbytes
        if nbytes > self.size:
            return
        self.last = nbytes
        if self.get(key) is not None:
            return
        self.entries.append([key, v, [a.copy() for a in arrays], info, nbytes])
        while sum(e[4] for e in self.entries) > self.size:
            self.entries.pop(0)

    def drop(self, v: tuple[str, str]) -> None:
        self.entries = [e for e in self.entries if e[1] != v]


def random_answer(rng: np.random.Generator) -> list[np.ndarray]:
    """1 to 3 outputs of random dtypes and shapes, some views with strides, some empty."""
    out = []
    for _ in range(int(rng.integers(1, 4))):
        dtype = np.dtype(str(rng.choice(["uint8", "int64", "float16", "float32", "float64"])))
        shape = [
            int(d) for d in rng.integers(0 if rng.random() < 0.1 else 1, 5, rng.integers(0, 3))
        ]
        whole = (rng.standard_normal([2 * (shape[0] if shape else 1), *shape[1:]]) * 9).astype(
            dtype
        )
        a = whole[::2] if shape else whole[0]  # a strided view of a batch, or a scalar
        out.append(a.reshape(shape))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_the_store_is_the_plain_lru_on_random_operations(seed: int) -> None:
    rng = np.random.default_rng(seed)
    size = int(rng.integers(2, 8)) * (ENTRY_OVERHEAD + 64)
    fast, plain = ResponseCache(size), PlainLRU(size)
    keys = [bytes([i]) * 16 for i in range(24)]
    versions = [("a", "1"), ("a", "2"), ("b", "1")]
    answers: dict[bytes, list[np.ndarray]] = {}
    for _ in range(1500):
        op, key = rng.random(), keys[int(rng.integers(len(keys)))]
        v = versions[key[0] % 3]  # a key belongs to one version, as a real key does
        if op < 0.5:  # a request's way: a miss is stored if the cache admits it
            miss = fast.get(key) is None
            assert miss == (plain.get(key) is None)
            if miss:
                admitted = fast.admit(key)
                assert admitted == plain.admit(key)
                if admitted:
                    answer = answers.setdefault(key, random_answer(rng))
                    info = BatchInfo(int(rng.integers(1, 9)), 1)
                    fast.put(key, v, answer, info)
                    plain.put(key, v, answer, info)
        elif op < 0.6:  # stored whatever admit would say (put's own rule)
            answer = answers.setdefault(key, random_answer(rng))
            info = BatchInfo(int(rng.integers(1, 9)), 1)
            fast.put(key, v, answer, info)
            plain.put(key, v, answer, info)
        elif op < 0.97:
            got, want = fast.get(key), plain.get(key)
            assert (got is None) == (want is None)
            if got is not None and want is not None:
                assert got[1] is want[1]
                assert len(got[0]) == len(want[0])
                for x, y in zip(got[0], want[0], strict=True):
                    assert (x.dtype, x.shape) == (y.dtype, y.shape)
                    assert x.tobytes() == y.tobytes()
                    assert not x.flags.writeable
                    assert x.flags.aligned
        else:
            fast.drop(*v)
            plain.drop(v)
        assert list(fast._entries) == [e[0] for e in plain.entries]  # the same LRU order
        assert fast.used_bytes == sum(e[4] for e in plain.entries) <= size
        by_version = {v: {e[0] for e in plain.entries if e[1] == v} for v in versions}
        assert {v: set(k) for v, k in fast._by_version.items()} == {
            v: k for v, k in by_version.items() if k
        }


@pytest.mark.parametrize("seed", range(2))
def test_admission_is_the_plain_doorkeeper_over_many_keys(seed: int, monkeypatch: Any) -> None:
    """Enough distinct keys that the doorkeeper's generations turn over (its smallest size
    made 8 here, so that they turn over often), requests only: the same decisions and the
    same entries as the plain reference's."""
    monkeypatch.setattr(response_cache, "DOORKEEPER_MIN", 8)
    rng = np.random.default_rng(seed)
    size = 5 * (ENTRY_OVERHEAD + 16)
    fast, plain = ResponseCache(size), PlainLRU(size)
    answer, info = [np.zeros(4, np.float32)], BatchInfo(1, 1)
    admitted = refused = 0
    for _ in range(3000):
        key = int(rng.zipf(1.3)) % 200  # a few keys often, many seldom
        k = key.to_bytes(16, "little")
        miss = fast.get(k) is None
        assert miss == (plain.get(k) is None)
        if miss:
            ok = fast.admit(k)
            assert ok == plain.admit(k)
            admitted, refused = admitted + ok, refused + (not ok)
            if ok:
                fast.put(k, ("m", "1"), answer, info)
                plain.put(k, ("m", "1"), answer, info)
        assert list(fast._entries) == [e[0] for e in plain.entries]
    assert fast.refused == refused > 100  # both ways taken, often
    assert admitted > 100


def test_a_full_cache_stores_what_missed_before_and_keeps_its_hot_answers() -> None:
    entry = ENTRY_OVERHEAD + 16
    cache = ResponseCache(3 * entry)
    answer, info, v = [np.zeros(4, np.float32)], BatchInfo(1, 1), ("m", "1")

    def request(i: int) -> str:
        k = i.to_bytes(16, "little")
        if cache.get(k) is not None:
            return "hit"
        if cache.admit(k):
            cache.put(k, v, answer, info)
            return "stored"
        return "refused"

    # While there is room, every miss is stored (as Triton's cache does).
    assert [request(i) for i in (1, 2, 3)] == ["stored"] * 3
    assert [request(i) for i in (1, 2, 3)] == ["hit"] * 3
    # Full: a scan of requests seen once stores nothing and evicts nothing.
    assert {request(i) for i in range(100, 100 + 3 * DOORKEEPER_MIN // 2)} == {"refused"}
    assert [request(i) for i in (1, 2, 3)] == ["hit"] * 3
    # A request that missed before is stored on its next miss (the oldest out), then hits.
    assert request(100 + 3 * DOORKEEPER_MIN // 2 - 1) == "stored"
    assert request(100 + 3 * DOORKEEPER_MIN // 2 - 1) == "hit"
    assert [request(i) for i in (2, 3)] == ["hit"] * 2
    assert request(1) == "refused"  # evicted, and not missed before
    assert cache.refused == 3 * DOORKEEPER_MIN // 2 + 1
    assert request(100) == "stored"  # its miss is in the doorkeeper's older generation
    # The doorkeeper forgets: it holds two generations of DOORKEEPER_MIN keys.
    assert {request(i) for i in range(10_000, 10_000 + 2 * DOORKEEPER_MIN)} == {"refused"}
    assert request(200) == "refused"  # missed in the first scan: forgotten since
    assert request(200) == "stored"
    # An answer as large as the last one fits again once a version's are dropped.
    cache.drop("m", "1")
    assert request(300) == "stored"


def test_a_stored_answer_is_a_copy() -> None:
    batch = np.arange(16, dtype=np.float32).reshape(8, 2)
    cache = ResponseCache(1 << 20)
    cache.put(b"k" * 16, ("m", "1"), [batch[2:4]], BatchInfo(8, 4))
    batch[:] = -1  # the pipeline's buffer, written again by its next batch
    stored = cache.get(b"k" * 16)
    assert stored is not None
    np.testing.assert_array_equal(stored[0][0], [[4, 5], [6, 7]])
    assert stored[1] == BatchInfo(8, 4)


def test_requests_of_a_kept_header_hit_and_miss_through_the_data_plane(tmp_path: Path) -> None:
    write(tmp_path / "a", cfg_text() + CACHED)

    def body(bits: np.ndarray) -> tuple[bytes, int]:
        packed = np.packbits(bits, axis=-1)
        tensor = {"name": "bits", "datatype": "UINT8", "shape": list(packed.shape),
                  "parameters": {"binary_data_size": packed.nbytes}}  # fmt: skip
        head = json.dumps({"inputs": [tensor]}).encode()
        return head + packed.tobytes(), len(head)

    async def ask(dp: DataPlane, bits: np.ndarray) -> InferResponse:
        raw, n = body(bits)
        ticket = dp.admit("a", None, request_id="r")
        req = ticket.handle.headers.decode(raw, n, ticket.handle.signature, None)
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        ticket.proceed(req, lambda h: h.headers.decode(raw, n, h.signature, None), done.set_result)
        response = await done
        ticket.finish(request=req)
        assert isinstance(response, InferResponse)
        np.testing.assert_allclose(response.outputs[0].data, boxcar_reference(bits), rtol=1e-6)
        return response

    async def main() -> None:
        repo = cached_repo(tmp_path)
        await repo.start()
        dp = DataPlane(repo, Metrics())
        stats = repo.get("a").stats
        for seed in range(3):  # each computed once, then answered from the cache
            await ask(dp, bits_of(1, seed))
            await ask(dp, bits_of(1, seed))
        assert stats.execution_count == 3
        assert repo.get("a").headers.hits >= 4  # their forms' path ran
        await repo.load("a")  # reloaded: its answers dropped, a new signature
        await ask(dp, bits_of(1, 0))
        await ask(dp, bits_of(1, 0))
        assert repo.get("a").stats.execution_count == 4
        triton = dp.statistics("a")["model_stats"][0]["inference_stats"]
        assert (triton["cache_hit"]["count"], triton["cache_miss"]["count"]) == (4, 4)
        await repo.stop()

    run(main)


def test_a_full_cache_stores_an_answer_on_its_second_miss_through_the_data_plane(
    tmp_path: Path,
) -> None:
    write(tmp_path / "a", cfg_text() + CACHED)

    async def main() -> None:
        repo = cached_repo(tmp_path)
        await repo.start()
        dp = DataPlane(repo, Metrics())
        stats, cache = repo.get("a").stats, repo.cache
        assert cache is not None

        async def ask(seed: int) -> None:
            bits = bits_of(1, seed)
            packed = np.packbits(bits, axis=-1)
            body = {
                "inputs": [
                    {
                        "name": "bits",
                        "datatype": "UINT8",
                        "shape": list(packed.shape),
                        "data": packed.ravel().tolist(),
                    }
                ]
            }
            handle = repo.get("a")
            req = decode_infer_request(json.dumps(body).encode(), None, handle.signature)
            response = await infer(handle, req)
            np.testing.assert_allclose(response.outputs[0].data, boxcar_reference(bits), rtol=1e-6)

        await ask(0)  # stored: there was room
        cache.size_bytes = cache.used_bytes  # now full with it
        for seed in (1, 1, 1, 0, 0):
            await ask(seed)
        # 1: refused (first miss of a full cache), stored (it missed before), hit;
        # 0: evicted by 1, so a miss, refused, then stored.
        assert stats.execution_count == 5
        triton = dp.statistics("a")["model_stats"][0]["inference_stats"]
        assert (triton["cache_hit"]["count"], triton["cache_miss"]["count"]) == (1, 5)
        assert cache.refused == 2
        text = triton_metrics(repo.statistics.snapshots()).decode()
        assert 'bitserve_cache_num_not_stored_per_model{model="a",version="1"} 2' in text
        await repo.stop()

    run(main)


def test_plain_request_objects_carry_no_form() -> None:
    assert InferRequest(id=None, inputs=[]).form is None
