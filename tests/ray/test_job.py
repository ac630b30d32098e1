"""The pieces of ``bitserve score`` and of the Serve deployment that need no Ray cluster: input
listing and schema checks, the output files' coverage (resume), read planning, the writer's
runs of rows, the actor plan, and the ``serve run`` arguments."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from harness.fingerprints import MODEL, fingerprint_table, write_fingerprint_repository
from service.ray.data import Actors, plan_actors
from service.ray.inputs import (
    FILE_TAG,
    ROW_TAG,
    Segment,
    check_schema,
    list_inputs,
    plan_reads,
    read_segments,
)
from service.ray.outputs import _runs, coverage, output_name, write_run
from service.ray.scorer import ColumnForm, ScoringError, read_config

pytest.importorskip("ray")
LOCAL = pafs.LocalFileSystem()


@pytest.fixture(scope="module")
def forms(tmp_path_factory: pytest.TempPathFactory) -> list[ColumnForm]:
    root = write_fingerprint_repository(tmp_path_factory.mktemp("m"), max_batch_size=8)
    _, cfg = read_config(root, MODEL)
    return [ColumnForm.of(s) for s in cfg.inputs]


def test_list_inputs_a_file_or_a_folder(tmp_path: Path) -> None:
    (tmp_path / "lib" / "part").mkdir(parents=True)
    pq.write_table(fingerprint_table(10), tmp_path / "lib" / "b.parquet", row_group_size=4)
    pq.write_table(fingerprint_table(3), tmp_path / "lib" / "part" / "a.parquet")
    (tmp_path / "lib" / "_SUCCESS").write_text("")
    (tmp_path / "lib" / ".hidden.parquet").write_text("")
    (tmp_path / "lib" / "notes.txt").write_text("")
    files = list_inputs(LOCAL, str(tmp_path / "lib"))
    assert [(f.name, f.groups) for f in files] == [("b", (4, 4, 2)), ("part/a", (3,))]
    one = list_inputs(LOCAL, str(tmp_path / "lib" / "b.parquet"))
    assert [(f.name, f.rows) for f in one] == [("b", 10)]
    with pytest.raises(ScoringError, match="no such file or folder"):
        list_inputs(LOCAL, str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ScoringError, match=r"no \.parquet file in the folder"):
        list_inputs(LOCAL, str(tmp_path / "empty"))


def test_check_schema(tmp_path: Path, forms: list[ColumnForm]) -> None:
    def file_with(**columns: pa.Array) -> Path:
        path = tmp_path / "x.parquet"
        pq.write_table(pa.table(columns), path)
        return path

    ok = [
        pa.array([b"\0" * 256]),
        pa.array([b"\0" * 256], pa.binary(256)),
        pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(256, np.uint8)), 256),
        pa.array([[0] * 256], pa.list_(pa.uint8())),
    ]
    for col in ok:
        (f,) = list_inputs(LOCAL, str(file_with(fp=col, id=pa.array(["a"]))))
        check_schema(f, forms, ["score"], keep_inputs=False)
    bad = {
        "is fixed_size_binary[255]": pa.array([b"\0" * 255], pa.binary(255)),
        "is list<element: int32>": pa.array([[0] * 256], pa.list_(pa.int32())),
        "is string": pa.array(["x"]),
    }
    for message, col in bad.items():
        (f,) = list_inputs(LOCAL, str(file_with(fp=col)))
        with pytest.raises(ScoringError, match=re.escape(f"column 'fp' {message}")):
            check_schema(f, forms, ["score"], keep_inputs=False)
    (f,) = list_inputs(LOCAL, str(file_with(fingerprint=ok[0])))
    with pytest.raises(ScoringError, match=r"no column 'fp'.*columns: \['fingerprint'\]"):
        check_schema(f, forms, ["score"], keep_inputs=False)
    (f,) = list_inputs(LOCAL, str(file_with(fp=ok[0], score=pa.array([1.0]))))
    with pytest.raises(ScoringError, match=r"\['score'\] have the name of a model output"):
        check_schema(f, forms, ["score"], keep_inputs=False)
    (f,) = list_inputs(LOCAL, str(file_with(fp=ok[0])))
    with pytest.raises(ScoringError, match=r"\['fp'\] have the name of a model output"):
        check_schema(f, forms, ["fp"], keep_inputs=True)


def test_coverage_resumes_and_drops_overlaps(tmp_path: Path) -> None:
    folder = tmp_path / "out"
    folder.mkdir()
    for a, b in [(0, 10), (10, 25), (40, 50), (40, 45), (42, 48), (60, 70)]:
        (folder / output_name(a, b)).write_bytes(b"")
    (folder / f".{output_name(25, 40)}.tmp-abc").write_bytes(b"")  # an unfinished write
    (folder / output_name(90, 120)).write_bytes(b"")  # past the file's rows: not ours
    cov = coverage(LOCAL, str(folder), 100)
    assert cov.kept == [(0, 10), (10, 25), (40, 50), (60, 70)]
    assert sorted(Path(p).name for p in cov.dropped) == [output_name(40, 45), output_name(42, 48)]
    assert cov.missing == [(25, 40), (50, 60), (70, 100)]
    assert cov.done == 45
    assert not (folder / f".{output_name(25, 40)}.tmp-abc").exists()
    fresh = coverage(LOCAL, str(tmp_path / "none"), 7)
    assert (fresh.kept, fresh.missing) == ([], [(0, 7)])


def test_plan_reads_cuts_at_row_groups_and_task_size() -> None:
    class F:
        def __init__(self, groups: tuple[int, ...]) -> None:
            self.groups = groups

    files = [F((10, 10, 5)), F((4,))]
    tasks = plan_reads(files, [[(3, 22)], [(0, 4)]], rows_per_task=8)  # type: ignore[arg-type]
    assert tasks == [
        [Segment(0, 0, 3, 10), Segment(0, 1, 10, 11)],
        [Segment(0, 1, 11, 19)],
        [Segment(0, 1, 19, 20), Segment(0, 2, 20, 22)],
        [Segment(1, 0, 0, 4)],
    ]
    every = [r for t in tasks for s in t if s.file == 0 for r in range(s.start, s.stop)]
    assert every == list(range(3, 22))
    assert plan_reads(files, [[], []], 8) == []  # type: ignore[arg-type]


def test_read_segments_tag_rows(tmp_path: Path) -> None:
    path = tmp_path / "lib.parquet"
    table = fingerprint_table(25)
    pq.write_table(table, path, row_group_size=10)
    segments = [Segment(3, 0, 2, 10), Segment(3, 1, 10, 13), Segment(3, 2, 21, 25)]
    blocks = list(read_segments(LOCAL, str(path), (10, 10, 5), segments, block_rows=3))
    got = pa.concat_tables(blocks)
    rows = [*range(2, 13), *range(21, 25)]
    assert got.column(ROW_TAG).to_pylist() == rows
    assert set(got.column(FILE_TAG).to_pylist()) == {3}
    assert got.column("id").to_pylist() == [f"mol-{r}" for r in rows]
    assert got.column("fp").to_pylist() == table.column("fp").take(rows).to_pylist()
    assert max(b.num_rows for b in blocks) == 3


def test_runs_sort_and_split_a_block(tmp_path: Path) -> None:
    files = [1, 0, 0, 1, 0, 0]
    rows = [5, 3, 1, 4, 2, 7]
    block = pa.table({"v": list(range(6)), FILE_TAG: pa.array(files, pa.int32()),
                      ROW_TAG: pa.array(rows, pa.int64())})  # fmt: skip
    runs = [(f, a, b, t.column("v").to_pylist()) for f, a, b, t in _runs(block)]
    assert runs == [(0, 1, 4, [2, 4, 1]), (0, 7, 8, [5]), (1, 4, 6, [3, 0])]
    _, a, b, t = next(_runs(block))
    assert t.column_names == ["v"]
    path = write_run(LOCAL, str(tmp_path / "o" / "lib"), a, b, t)
    assert Path(path).name == "000000000001-000000000004.parquet"
    assert pq.read_table(path).column("v").to_pylist() == [2, 4, 1]
    assert [p.name for p in (tmp_path / "o" / "lib").iterdir()] == [Path(path).name]


def test_plan_actors() -> None:
    assert plan_actors({"CPU": 16.0, "GPU": 4.0}) == Actors(4, 4, 1.0, 1.0, 1)
    assert plan_actors({"CPU": 16.0}) == Actors(1, 15, 0.0, 1.0, 1)
    assert plan_actors({"CPU": 16.0}, num_cpus=4) == Actors(1, 3, 0.0, 4.0, 4)
    assert plan_actors({"CPU": 1.0}) == Actors(1, 1, 0.0, 1.0, 1)
    assert plan_actors({"CPU": 8.0, "GPU": 2.0}, actors=3) == Actors(3, 3, 1.0, 1.0, 1)
    assert plan_actors({"CPU": 8.0, "GPU": 2.0}, num_gpus=0.5) == Actors(4, 4, 0.5, 1.0, 1)
    with pytest.raises(ValueError, match="actors must be at least 1"):
        plan_actors({"CPU": 2.0}, actors=0)
    with pytest.raises(ValueError, match="threads must be at least 1"):
        plan_actors({"CPU": 2.0}, threads=0)


def test_plan_actors_threads() -> None:
    """A CPU actor alone on its node runs a torch thread per CPU of the node; otherwise an
    actor's threads are its CPUs."""
    # A 2-core machine: one actor, and the core kept for the reads and writes is shared.
    assert plan_actors({"CPU": 2.0}).threads == 2
    assert plan_actors({"CPU": 2.0}, actors=1).threads == 2
    # A fixed pool of two on the same cores: each keeps to its own CPU (no 4 threads on 2).
    assert plan_actors({"CPU": 2.0}, actors=2).threads == 1
    # Two simulated 1-CPU nodes: one actor, on a node of one CPU.
    assert plan_actors({"CPU": 2.0}, node_cpus=1.0) == Actors(1, 1, 0.0, 1.0, 1)
    # Room for two actors or more on a node: each keeps to its own CPUs.
    assert plan_actors({"CPU": 3.0}).threads == 1
    assert plan_actors({"CPU": 64.0}, node_cpus=16.0).threads == 1
    # An actor of 4 CPUs alone on an 8-CPU node; two fit on 9.
    assert plan_actors({"CPU": 8.0}, num_cpus=4).threads == 8
    assert plan_actors({"CPU": 9.0}, num_cpus=4).threads == 4
    # GPU actors and explicit threads are left as asked.
    assert plan_actors({"CPU": 2.0, "GPU": 1.0}).threads == 1
    assert plan_actors({"CPU": 2.0}, threads=1).threads == 1
    assert plan_actors({"CPU": 16.0}, threads=3).threads == 3


def test_serve_run_arguments(tmp_path: Path) -> None:
    from service.ray.serving import app, deployment

    d = deployment(tmp_path, autoscaling_config={"min_replicas": 1, "max_replicas": 3})
    assert d.name == "bitserve"
    assert d.max_ongoing_requests == 128
    assert d._deployment_config.autoscaling_config.max_replicas == 3
    application = app(
        {
            "repository": str(tmp_path),
            "num_replicas": "2",
            "max_ongoing_requests": "16",
            "num_cpus": "2",
            "ray_actor_options": '{"memory": 1000000}',
            "auth_token": "secret",
        }
    )
    bound = application._bound_deployment
    assert bound.num_replicas == 2
    assert bound.max_ongoing_requests == 16
    assert bound.ray_actor_options == {"memory": 1000000, "num_cpus": 2}
    settings = bound.func_or_class.settings
    assert settings["auth_token"] == "secret"
    assert settings["model_repository"] == str(tmp_path.resolve())
    with pytest.raises(ValueError, match="max_body_bytes"):
        deployment(tmp_path, settings={"max_body_bytes": -1})
