"""Triton's logging extension over the server's logging: the switches, the verbose level, the
format, refusals that change nothing, and the routes in process."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from service.errors import InvalidInput
from service.observability.log_settings import LOGGERS, LogSettings
from service.observability.metrics import Metrics
from service.observability.request_ids import RequestIdFilter
from service.server import in_process_app
from service.settings import Settings
from tests.service.app_fakes import FakeRepository


class Capture(logging.Handler):
    """Keeps every formatted line it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.addFilter(RequestIdFilter())

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture
def logger() -> Iterator[tuple[logging.Logger, Capture]]:
    """A private logger with a capturing handler, as ``logging_config`` sets ours up."""
    log = logging.getLogger(f"test-logs-{uuid.uuid4().hex}")
    log.propagate = False
    handler = Capture()
    log.addHandler(handler)
    yield log, handler
    log.removeHandler(handler)


def emit_all(log: logging.Logger) -> None:
    log.debug("d")
    log.info("i")
    log.warning("w")
    log.error("e")
    log.critical("c")


def written(handler: Capture) -> list[str]:
    return [line.rsplit(" ", 1)[-1] for line in handler.lines]


@pytest.mark.parametrize(
    ("level", "expected"),
    [
        ("debug", (True, True, True, 1)),
        ("info", (True, True, True, 0)),
        ("warning", (False, True, True, 0)),
        ("error", (False, False, True, 0)),
        ("critical", (False, False, False, 0)),
    ],
)
def test_starting_values_follow_the_log_level(
    level: str, expected: tuple[bool, bool, bool, int]
) -> None:
    got = LogSettings(level, loggers=()).get()
    assert got == {
        "log_file": "",
        "log_info": expected[0],
        "log_warning": expected[1],
        "log_error": expected[2],
        "log_verbose_level": expected[3],
        "log_format": "default",
    }


def test_switches_are_independent_and_verbose_writes_debug(
    logger: tuple[logging.Logger, Capture],
) -> None:
    log, handler = logger
    foreign = logging.NullHandler()  # not one of the server's: left alone
    log.addHandler(foreign)
    settings = LogSettings("info", loggers=[log.name])
    settings.attach()
    assert foreign.filters == []
    log.removeHandler(foreign)
    log.setLevel(logging.INFO)
    emit_all(log)
    assert written(handler) == ["i", "w", "e", "c"]
    # Warnings off while INFO stays on: not a threshold, as in Triton.
    settings.update({"log_warning": False, "log_verbose_level": 2})
    assert log.level == logging.DEBUG
    handler.lines.clear()
    emit_all(log)
    assert written(handler) == ["d", "i", "e", "c"]
    settings.update({"log_info": False, "log_verbose_level": 0, "log_error": False})
    assert log.level == logging.CRITICAL  # nothing below is written: not even made
    handler.lines.clear()
    emit_all(log)
    assert written(handler) == ["c"]  # CRITICAL is always written
    settings.update({"log_info": True, "log_warning": None})  # null leaves it as it is
    assert settings.get()["log_warning"] is False
    assert log.level == logging.INFO
    # A later server in the same process takes the handler over (one set of switches).
    LogSettings("info", loggers=[log.name]).attach()
    switches = [f for f in handler.filters if f.__class__.__name__ == "LevelSwitches"]
    assert len(switches) == 1
    assert switches[0] is not settings.switches


def test_iso8601_format(logger: tuple[logging.Logger, Capture]) -> None:
    log, handler = logger
    settings = LogSettings("info", loggers=[log.name])
    settings.attach()
    log.setLevel(logging.INFO)
    log.info("plain")
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO ", handler.lines[-1])
    assert settings.update({"log_format": "ISO8601"})["log_format"] == "ISO8601"
    log.info("iso")
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ INFO ", handler.lines[-1])
    settings.update({"log_format": "default"})
    log.info("plain again")
    assert "T" not in handler.lines[-1].split(" ")[0]


@pytest.mark.parametrize(
    ("changes", "text"),
    [
        ({"log_warnings": False}, "unknown settings ['log_warnings']"),
        ({"log_info": 1}, "log_info must be a boolean"),
        ({"log_error": "false"}, "log_error must be a boolean"),
        ({"log_verbose_level": -1}, "log_verbose_level must be an integer"),
        ({"log_verbose_level": True}, "log_verbose_level must be an integer"),
        ({"log_verbose_level": 2**32}, "log_verbose_level must be an integer"),
        ({"log_format": "json"}, "log_format must be one of"),
        ({"log_file": "/tmp/x.log"}, "log_file can not be changed"),
        # All or nothing: the good setting beside the bad one is not applied either.
        ({"log_info": False, "log_format": "xml"}, "log_format must be one of"),
    ],
)
def test_refusals_change_nothing(changes: dict[str, object], text: str) -> None:
    settings = LogSettings("info", loggers=())
    before = settings.get()
    with pytest.raises(InvalidInput, match=re.escape(text)):
        settings.update(changes)
    assert settings.get() == before
    assert settings.update({"log_file": ""}) == before  # the current value is no change


# --- the routes -----------------------------------------------------------------------------


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    levels = {name: logging.getLogger(name).level for name in LOGGERS}
    app = in_process_app(Settings(access_log=False), FakeRepository(), metrics=Metrics(nvml=None))
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                yield c
    finally:  # the routes change the process's loggers
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


@pytest.mark.anyio
async def test_logging_routes(client: httpx.AsyncClient) -> None:
    first = (await client.get("/v2/logging")).json()
    assert first["log_info"] is True
    assert first["log_format"] == "default"
    resp = await client.post("/v2/logging", json={"log_verbose_level": 1})
    assert resp.status_code == 200
    assert resp.json() == first | {"log_verbose_level": 1}
    assert logging.getLogger("service").level == logging.DEBUG
    assert (await client.get("/v2/logging")).json()["log_verbose_level"] == 1
    assert (await client.post("/v2/logging", content=b"")).json()["log_verbose_level"] == 1
    for body, text in (
        (b"[1]", "must be a JSON object"),
        (b"{nope", "malformed"),
        (b'{"log_info": "yes"}', "log_info must be a boolean"),
    ):
        resp = await client.post("/v2/logging", content=body)
        assert resp.status_code == 400, body
        assert text in resp.json()["error"]
    assert (await client.post("/v2/logging", json=first)).json() == first
    assert "logging" in (await client.get("/v2")).json()["extensions"]
