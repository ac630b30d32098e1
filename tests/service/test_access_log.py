"""The access log's own lines are the bytes ``logging`` writes for the same request.

``AccessLog.write`` makes a line itself where the server's logging configuration is the one
in force (:func:`service.observability.request_ids.logging_config`), and goes through ``logging``
(the plain reference) otherwise: both are compared here on random requests, at the same
clock, with and without a worker's tag, and the fallbacks on configurations it must not
take over (another handler, a filter, another format, a level).
"""

from __future__ import annotations

import asyncio
import logging
import string
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from service.observability.access_log import MESSAGE, AccessLog
from service.observability.log_settings import LevelSwitches, LogSettings
from service.observability.request_ids import (
    BatchedStreamHandler,
    RequestIdFilter,
    logging_config,
    request_id_var,
)
from tests.service.test_log_handler import Stream


def server_handler(stream: Stream, worker: int | None) -> BatchedStreamHandler:
    """The handler ``logging_config`` describes (what ``dictConfig`` builds from it)."""
    config = logging_config("info", worker)
    spec = config["handlers"]["default"]
    assert spec["class"] == "service.observability.request_ids.BatchedStreamHandler"
    assert spec["filters"] == ["request_id"]
    assert config["filters"]["request_id"] == {"()": RequestIdFilter}
    assert set(config["formatters"]["default"]) == {"format"}
    handler = BatchedStreamHandler(stream)
    handler.setFormatter(logging.Formatter(config["formatters"]["default"]["format"]))
    handler.addFilter(RequestIdFilter())
    return handler


def as_served(root: logging.Logger, handler: BatchedStreamHandler, log_format: str) -> None:
    """``handler`` alone on ``root``, with what the server's log settings put on it at start
    (their level switches) and its ``log_format`` (``POST /v2/logging``)."""
    root.handlers = [handler]
    LogSettings("info", loggers=[root.name]).update({"log_format": log_format})
    assert any(isinstance(f, LevelSwitches) for f in handler.filters)


@pytest.fixture
def tree() -> Iterator[tuple[logging.Logger, logging.Logger]]:
    """A private ``<root>`` logger (as ``service``: a handler, not propagating) and its
    ``<root>.rest.gateway.access`` child."""
    root = logging.getLogger(f"accesstest{uuid.uuid4().hex}")
    root.propagate = False
    root.setLevel(logging.INFO)
    child = logging.getLogger(f"{root.name}.rest.gateway.access")
    kept = root.handlers  # pytest's capture handlers, where it puts some
    root.handlers = []
    factory = logging.getLogRecordFactory()  # Ray replaces it when imported by a test
    logging.setLogRecordFactory(logging.LogRecord)
    yield root, child
    logging.setLogRecordFactory(factory)
    root.handlers = kept


def plain(log: logging.Logger, method: str, path: str, status: int, ms: float, rid: str) -> None:
    """The reference: what the server logged before (a record with the id in its context)."""
    token = request_id_var.set(rid)
    log.info(MESSAGE, method, path, status, ms)
    request_id_var.reset(token)


def random_requests(rng: np.random.Generator, n: int) -> list[tuple[str, str, int, float, str]]:
    chars = string.ascii_letters + string.digits + "/-_.%~\\\"'{}"
    out = []
    for _ in range(n):
        path = "/" + "".join(rng.choice(list(chars), int(rng.integers(0, 40))))
        rid = "".join(rng.choice(list(string.ascii_letters + "._:-"), int(rng.integers(1, 30))))
        method = str(rng.choice(["POST", "GET", "DELETE"]))
        status = int(rng.choice([200, 400, 404, 499, 503]))
        ms = float(rng.choice([rng.random() * 10, rng.random() * 1e4, 0.0, 0.05, 0.15]))
        out.append((method, path, status, ms, rid))
    return out


def clock_ticks(monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> list[float]:
    """``time.time`` (read by both ``LogRecord`` and ``AccessLog``) made to step through
    seconds and their fractions; returns the sequence (read twice per request)."""
    start = 1_780_000_000 + float(rng.integers(0, 10**6))
    ticks = np.cumsum(rng.choice([0.0, 0.0004, 0.3, 0.9999, 1.0, 61.0], 400)) + start
    seq = [float(t) for t in np.repeat(ticks, 2)]  # each tick twice: direct, then plain
    it = iter(seq)
    monkeypatch.setattr(time, "time", lambda: next(it))
    return seq


@pytest.mark.parametrize("log_format", ["default", "ISO8601"])
@pytest.mark.parametrize("worker", [None, 3])
def test_the_direct_lines_are_the_records_lines_on_random_requests(
    tree: tuple[logging.Logger, logging.Logger],
    monkeypatch: pytest.MonkeyPatch,
    worker: int | None,
    log_format: str,
) -> None:
    root, child = tree
    rng = np.random.default_rng(23 + (worker or 0))
    direct_stream, plain_stream = Stream(), Stream()
    direct_handler = server_handler(direct_stream, worker)
    plain_handler = server_handler(plain_stream, worker)
    as_served(root, plain_handler, log_format)
    as_served(root, direct_handler, log_format)
    access = AccessLog(child)
    requests = random_requests(rng, 400)
    clock_ticks(monkeypatch, rng)
    for req in requests:
        root.handlers = [direct_handler]
        assert access._direct() is not None
        access.write(*req)
        root.handlers = [plain_handler]
        plain(child, *req)
    direct_lines = "".join(direct_stream.writes).splitlines()
    plain_lines = "".join(plain_stream.writes).splitlines()
    assert len(plain_lines) == len(requests)
    assert direct_lines == plain_lines
    tag = "" if worker is None else f" w{worker}"
    assert f" INFO {child.name}{tag} [{requests[0][4]}] " in plain_lines[0]


def test_on_the_event_loop_a_turns_lines_go_out_in_one_write_in_order(
    tree: tuple[logging.Logger, logging.Logger],
) -> None:
    """The direct lines take the handler's batching, and keep their place among records."""
    root, child = tree
    stream = Stream()
    root.handlers = [server_handler(stream, None)]
    access = AccessLog(child)

    async def main() -> None:
        access.write("POST", "/a", 200, 1.0, "r1")
        child.info("between")
        access.write("POST", "/b", 200, 2.0, "r2")
        assert stream.writes == []
        await asyncio.sleep(0)
        assert len(stream.writes) == 1
        lines = stream.writes[0].splitlines()
        assert [line.split("] ", 1)[1] for line in lines] == [
            "POST /a 200 1.0ms",
            "between",
            "POST /b 200 2.0ms",
        ]

    asyncio.run(main())


def _another_handler(root: logging.Logger, child: logging.Logger) -> None:
    root.addHandler(logging.NullHandler())


def _a_filter(root: logging.Logger, child: logging.Logger) -> None:
    child.addFilter(lambda record: True)


def _a_format(root: logging.Logger, child: logging.Logger) -> None:
    root.handlers[0].setFormatter(logging.Formatter("%(asctime)s %(message)s"))


def _a_formatter_class(root: logging.Logger, child: logging.Logger) -> None:
    class Upper(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            return super().format(record).upper()

    fmt = logging_config("info")["formatters"]["default"]["format"]
    root.handlers[0].setFormatter(Upper(fmt))


def _a_handler_level(root: logging.Logger, child: logging.Logger) -> None:
    root.handlers[0].setLevel(logging.WARNING)


def _propagating(root: logging.Logger, child: logging.Logger) -> None:
    root.propagate = True  # the root logger's handlers see the lines too
    logging.getLogger().handlers = [logging.NullHandler()]  # (restored by the monkeypatch)


def _disabled(root: logging.Logger, child: logging.Logger) -> None:
    child.disabled = True


def _a_record_factory(root: logging.Logger, child: logging.Logger) -> None:
    def factory(*args: object, **kwargs: object) -> logging.LogRecord:
        record = logging.LogRecord(*args, **kwargs)  # type: ignore[arg-type]
        record.created = int(record.created)  # as a factory may: here, whole seconds
        return record

    logging.setLogRecordFactory(factory)  # (the fixture restores the process's)


def _info_switched_off(root: logging.Logger, child: logging.Logger) -> None:
    as_served(root, root.handlers[0], "default")  # type: ignore[arg-type]
    for f in root.handlers[0].filters:
        if isinstance(f, LevelSwitches):
            f.info = False  # as ``log_info: false``, before the loggers' levels follow


@pytest.mark.parametrize(
    "change",
    [_another_handler, _a_filter, _a_format, _a_formatter_class, _a_handler_level, _propagating,
     _disabled, _a_record_factory, _info_switched_off],
)  # fmt: skip
def test_any_other_configuration_goes_through_logging(
    tree: tuple[logging.Logger, logging.Logger], monkeypatch: pytest.MonkeyPatch, change: object
) -> None:
    root, child = tree
    stream, reference = Stream(), Stream()
    handler = server_handler(stream, None)
    root.handlers = [handler]
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # pytest's capture, if any
    assert callable(change)
    change(root, child)
    access = AccessLog(child)
    assert access._direct() is None
    monkeypatch.setattr(time, "time", lambda: 1_780_000_000.25)
    access.write("GET", "/x", 404, 0.5, "rid-1")
    handler.stream = reference
    plain(child, "GET", "/x", 404, 0.5, "rid-1")
    assert stream.writes == reference.writes


def test_a_level_above_info_writes_nothing(tree: tuple[logging.Logger, logging.Logger]) -> None:
    root, child = tree
    stream = Stream()
    root.handlers = [server_handler(stream, None)]
    root.setLevel(logging.WARNING)
    AccessLog(child).write("GET", "/x", 200, 0.5, "rid")
    assert stream.writes == []
