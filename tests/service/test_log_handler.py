"""The log handler writes one turn of the event loop's INFO lines in one write, in order."""

from __future__ import annotations

import asyncio
import logging

from service.observability.request_ids import BatchedStreamHandler


class Stream:
    """Records each write (each would be a system call on stderr)."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> None:
        self.writes.append(text)

    def flush(self) -> None:
        pass


def logger(stream: Stream) -> logging.Logger:
    log = logging.getLogger(f"test.batched.{id(stream)}")
    log.propagate = False
    log.setLevel(logging.DEBUG)
    handler = BatchedStreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log.addHandler(handler)
    return log


def test_a_turns_info_lines_go_out_in_one_write_and_warnings_keep_their_place() -> None:
    stream = Stream()
    log = logger(stream)

    async def main() -> None:
        for i in range(3):
            log.info("access %d", i)
        assert stream.writes == []
        await asyncio.sleep(0)
        assert stream.writes == ["INFO access 0\nINFO access 1\nINFO access 2\n"]
        log.info("before")
        log.warning("now")  # written at once, after what was held
        assert stream.writes[1:] == ["INFO before\nWARNING now\n"]
        log.info("held")

    asyncio.run(main())
    assert stream.writes[2:] == ["INFO held\n"]  # the loop's last turn wrote it


def test_outside_an_event_loop_lines_are_written_at_once() -> None:
    stream = Stream()
    log = logger(stream)
    log.info("one")
    log.debug("two")
    assert stream.writes == ["INFO one\n", "DEBUG two\n"]
