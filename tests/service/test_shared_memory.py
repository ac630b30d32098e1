"""System shared memory with real POSIX shared memory objects: registration, keys, bounds,
limits, objects that shrink (never a SIGBUS), outputs of unregistered regions, and fuzzing
that nothing outside a registered region is ever read or written. ``FUZZ_EXAMPLES`` sets the
number of cases per fuzz test (default 300)."""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.errors import InvalidInput, NotFound
from service.shared_memory import CudaSharedMemory, SystemSharedMemory

FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "300"))
SIZE = 3 * 4096 + 123  # several pages, not a whole number of them


@pytest.fixture
def posix() -> Iterator[shared_memory.SharedMemory]:
    """A real POSIX shared memory object of SIZE bytes holding 0, 1, 2, ... (mod 251)."""
    obj = shared_memory.SharedMemory(create=True, size=SIZE)
    obj.buf[:SIZE] = (np.arange(SIZE) % 251).astype(np.uint8).tobytes()
    yield obj
    obj.close()
    obj.unlink()


def key_of(obj: shared_memory.SharedMemory) -> str:
    return "/" + obj.name.lstrip("/")


def pattern(offset: int, n: int) -> bytes:
    return ((np.arange(offset, offset + n)) % 251).astype(np.uint8).tobytes()


def test_register_view_status_unregister(posix: shared_memory.SharedMemory) -> None:
    shm = SystemSharedMemory()
    key = key_of(posix)
    shm.register("in", key, 5000, 64)  # an offset that is not on a page boundary
    shm.register("whole", key.lstrip("/"), 0, SIZE)  # the leading slash is optional
    assert shm.status() == [
        {"name": "in", "key": key, "offset": 5000, "byte_size": 64},
        {"name": "whole", "key": key.lstrip("/"), "offset": 0, "byte_size": SIZE},
    ]
    assert shm.status("in") == [{"name": "in", "key": key, "offset": 5000, "byte_size": 64}]
    data = shm.read("in", 16, 32, "input 'x'")
    assert bytes(data) == pattern(5016, 32)  # the object's own bytes, copied
    posix.buf[5016] = 0xAA
    assert bytes(data) == pattern(5016, 32)  # a copy: the client may change its object
    out = shm.output("in", 16, 4, "output 'y'")
    assert (out.region, out.nbytes) == ("in", 4)
    out.write(memoryview(b"\xff\xfe\xfd\xfc"))  # writes reach the client's object
    assert bytes(posix.buf[5016:5020]) == b"\xff\xfe\xfd\xfc"
    assert shm.read("in", None, 64, "input 'x'").nbytes == 64  # no offset: 0
    shm.unregister("in")
    shm.unregister("in")  # an unknown name is no error (as in Triton)
    assert [r["name"] for r in shm.status()] == ["whole"]
    with pytest.raises(NotFound, match="Unable to find system shared memory region: 'in'"):
        shm.status("in")
    with pytest.raises(InvalidInput, match="input 'x': shared memory region 'in' is not regis"):
        shm.read("in", 0, 1, "input 'x'")
    shm.unregister()
    assert shm.status() == []
    assert len(shm) == 0


@pytest.mark.parametrize(
    "key",
    [
        "/etc/passwd",
        "../passwd",
        "/../../etc/passwd",
        "a/b",
        "//name",
        "",
        "/",
        ".",
        "/..",
        "name with space",
        "nul\x00name",
        "x" * 256,
        5,
        None,
        ["/name"],
    ],
)
def test_keys_are_posix_names_only(key: object, posix: shared_memory.SharedMemory) -> None:
    shm = SystemSharedMemory()
    with pytest.raises(InvalidInput, match=r"region 'r': key .* is not a POSIX shared memory"):
        shm.register("r", key, 0, 8)
    assert len(shm) == 0


def test_objects_that_cannot_be_regions(tmp_path: Path, posix: shared_memory.SharedMemory) -> None:
    (tmp_path / "file").write_bytes(b"\0" * 100)
    (tmp_path / "link").symlink_to(tmp_path / "file")
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "fifo")
    shm = SystemSharedMemory(directory=tmp_path)
    shm.register("ok", "/file", 90, 10)
    for key, text in (
        ("/link", "(a symlink)"),  # never followed out of the directory
        ("/folder", "unable to open"),
        ("/fifo", "is not a shared memory object"),
        ("/missing", "unable to open shared memory object '/missing'"),
    ):
        with pytest.raises(InvalidInput) as info:
            shm.register("r", key, 0, 1)
        assert info.value.message.startswith("failed to register shared memory region 'r': ")
        assert text in info.value.message, key
    with pytest.raises(InvalidInput, match=r"offset 90 \+ byte_size 11 runs past the end"):
        shm.register("r", "/file", 90, 11)
    real = SystemSharedMemory()
    with pytest.raises(InvalidInput, match="runs past the end"):
        real.register("r", key_of(posix), SIZE, 1)
    shm.close()


@pytest.mark.parametrize(
    ("offset", "byte_size", "text"),
    [
        (-1, 8, "offset must be an integer from 0"),
        (0, 0, "byte_size must be an integer from 1"),
        (0, None, "byte_size must be an integer"),
        (0, "8", "byte_size must be an integer"),
        (True, 8, "offset must be an integer"),
        (0, 2**70, "byte_size must be an integer"),
    ],
)
def test_bad_offsets_and_sizes(
    posix: shared_memory.SharedMemory, offset: object, byte_size: object, text: str
) -> None:
    shm = SystemSharedMemory()
    with pytest.raises(InvalidInput, match=re.escape(text)):
        shm.register("r", key_of(posix), offset, byte_size)


def test_names_limits_and_duplicates(posix: shared_memory.SharedMemory) -> None:
    shm = SystemSharedMemory(max_regions=2)
    shm.register("a", key_of(posix), 0, 8)
    with pytest.raises(InvalidInput, match="shared memory region 'a' already in manager"):
        shm.register("a", key_of(posix), 0, 8)
    shm.register("b", key_of(posix), 0, 8)
    with pytest.raises(InvalidInput, match=r"region 'c': 2 regions are registered.*max_shm"):
        shm.register("c", key_of(posix), 0, 8)
    for bad in ("", "bad\nname", 7):
        with pytest.raises(InvalidInput, match="shared memory region name"):
            shm.register(bad, key_of(posix), 0, 8)
    shm.close()


@pytest.mark.parametrize("use", ["read", "output"])
def test_tensor_bounds(posix: shared_memory.SharedMemory, use: str) -> None:
    shm = SystemSharedMemory()
    shm.register("r", key_of(posix), 100, 50)
    place = getattr(shm, use)
    assert place("r", 50, 0, "t").nbytes == 0  # an empty tensor at the very end
    for offset, size in ((0, 51), (49, 2), (50, 1), (10**20, 1), (0, 10**20)):
        with pytest.raises(InvalidInput, match="shared memory region 'r'"):
            place("r", offset, size, "t")
    for offset, size, text in ((-1, 1, "shared_memory_offset"), (0, None, "is required")):
        with pytest.raises(InvalidInput, match=text):
            place("r", offset, size, "t")


def test_a_shrunken_object_is_a_refusal_not_a_sigbus(posix: shared_memory.SharedMemory) -> None:
    shm = SystemSharedMemory()
    shm.register("r", key_of(posix), 4096, 4096)
    out = shm.output("r", 0, 8, "output 'y'")
    path = f"/dev/shm/{posix.name.lstrip('/')}"
    os.truncate(path, 4100)  # through a mapping, a page past the end would be SIGBUS
    assert bytes(shm.read("r", 0, 4, "input 'x'")) == pattern(4096, 4)  # what is left
    with pytest.raises(InvalidInput, match="shrank since registration") as info:
        shm.read("r", 0, 8, "input 'x'")
    assert info.value.message.startswith("input 'x': shared memory region 'r': its object")
    with pytest.raises(InvalidInput, match="shrank since registration"):
        out.write(memoryview(b"\1" * 8))
    assert os.stat(path).st_size == 4100  # a refused write never grows it back
    os.truncate(path, SIZE)  # grown again: usable again
    assert shm.read("r", 0, 8, "input 'x'").nbytes == 8
    shm.close()


def test_outputs_of_a_region_unregistered_in_flight_are_still_written(
    posix: shared_memory.SharedMemory,
) -> None:
    shm = SystemSharedMemory()
    shm.register("r", key_of(posix), 0, 64)
    fds = len(os.listdir("/proc/self/fd"))
    out = shm.output("r", 8, 4, "output 'y'")  # decoded, then the region goes away
    shm.unregister("r")
    out.write(memoryview(b"\7\7\7\7"))  # its own descriptor, closed once written
    assert bytes(posix.buf[8:12]) == b"\7\7\7\7"
    assert len(os.listdir("/proc/self/fd")) == fds - 1  # the region's own was closed too
    with pytest.raises(InvalidInput, match="not registered"):
        shm.read("r", 0, 8, "t")
    shm.register("r", key_of(posix), 0, 64)  # the name is free again
    unwritten = shm.output("r", 0, 4, "output 'y'")  # a request that failed: dropped
    del unwritten
    assert len(os.listdir("/proc/self/fd")) == fds
    shm.close()


def test_cuda_shared_memory_routes_say_it_is_not_supported(
    posix: shared_memory.SharedMemory,
) -> None:
    system = SystemSharedMemory()
    system.register("sys", key_of(posix), 0, 8)
    cuda = CudaSharedMemory(system)
    assert cuda.status() == []
    cuda.unregister()
    cuda.unregister("anything")
    with pytest.raises(InvalidInput, match="CUDA shared memory is not supported"):
        cuda.register("r")
    with pytest.raises(NotFound, match="Unable to find cuda shared memory region: 'r'"):
        cuda.status("r")
    with pytest.raises(NotFound, match="registered as system shared memory, not CUDA"):
        cuda.status("sys")
    system.close()


# --- fuzz ------------------------------------------------------------------------------------


def attempt(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or the InvalidInput it raised (any other exception fails the test)."""
    try:
        return fn(*args)
    except InvalidInput as exc:
        return exc


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    region=st.tuples(st.integers(-5, SIZE + 5), st.integers(-5, SIZE + 5)),
    tensor=st.tuples(
        st.one_of(st.none(), st.integers(-5, SIZE + 5), st.integers(2**62, 2**64)),
        st.one_of(st.none(), st.integers(-5, SIZE + 5), st.integers(2**62, 2**64)),
    ),
)
def test_fuzz_nothing_outside_a_region_is_read_or_written(
    posix: shared_memory.SharedMemory,
    region: tuple[int, int],
    tensor: tuple[int | None, int | None],
) -> None:
    base = pattern(0, SIZE)
    posix.buf[:SIZE] = base
    shm = SystemSharedMemory()
    refused = attempt(shm.register, "r", key_of(posix), *region)
    if refused is not None:
        assert "region 'r'" in refused.message
        offset, size = region
        assert offset < 0 or size < 1 or offset + size > SIZE
        return
    r_offset, r_size = region
    got = attempt(shm.read, "r", *tensor, "input 'x'")
    out = attempt(shm.output, "r", *tensor, "output 'y'")
    if isinstance(got, InvalidInput):
        assert "shared memory region 'r'" in got.message
        assert isinstance(out, InvalidInput)
        assert out.message.replace("output 'y'", "input 'x'") == got.message
        shm.close()
        return
    assert isinstance(got, memoryview)
    t_offset = tensor[0] or 0
    start = r_offset + t_offset
    assert t_offset >= 0
    assert t_offset + got.nbytes <= r_size
    assert bytes(got) == base[start : start + got.nbytes]  # reads what lies there
    assert out.nbytes == got.nbytes
    out.write(memoryview(b"\xff" * out.nbytes))  # writes all it may...
    after = bytes(posix.buf[:SIZE])
    # ... and nothing else changed, in or outside the region.
    assert after[:start] == base[:start]
    assert after[start + (tensor[1] or 0) :] == base[start + (tensor[1] or 0) :]
    shm.close()


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(key=st.text(alphabet=st.sampled_from("/.-_aZ09 \\\x00~%:"), max_size=12) | st.text())
def test_fuzz_keys_only_ever_name_an_object_in_the_directory(tmp_path: Path, key: str) -> None:
    folder = tmp_path / uuid.uuid4().hex / "shm"
    folder.mkdir(parents=True)
    (folder / "obj").write_bytes(b"\1" * 64)
    (folder.parent / "secret").write_bytes(b"\2" * 64)
    shm = SystemSharedMemory(directory=folder)
    refused = attempt(shm.register, "r", key, 0, 8)
    if refused is not None:
        assert refused.message.startswith("failed to register shared memory region 'r'")
        return
    assert key.lstrip("/") == "obj"  # nothing else, in or out of the folder, opens
    assert len(key) - len(key.lstrip("/")) <= 1
    assert bytes(shm.read("r", 0, 8, "t")) == b"\1" * 8
    shm.close()
