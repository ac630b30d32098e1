"""Request lifecycle: what tracing costs, whether traces arrive whole, work dropped when its
client has gone, and priority levels (issue 22's targets).

1. **Tracing's cost.** The tiny model (``benchmarks/overhead/tiny.py``: the serving layer is
   the whole cost) under perf_analyzer at concurrency 16, interleaved rounds, medians:
   bitserve with tracing off, with tracing on at 1% (``OTEL_TRACES_SAMPLER=
   parentbased_traceidratio``, ``_ARG=0.01``) and at 100%, exporting OTLP/HTTP to a real
   receiver on loopback (``harness/otlp_receiver.py``); with ``--before DIR`` also bitserve as
   it was before (a checkout in DIR: ``git worktree add DIR main``).
2. **Traces arrive whole.** Every request the 1% and 100% servers traced must have reached the
   receiver with its four children and its batch's span (one in every 100 requests at 1%:
   the trace settings' counter); then 100 REST and 100 gRPC requests carrying a sampled W3C
   ``traceparent`` must each arrive whole with their caller's trace id.
3. **Cancellation.** A model whose batches take >= 50 ms (``harness/paced.py``,
   8 items a batch) is kept busy by 24 clients; 200 more send a request each and close their
   connection 20 ms later, while it is queued. How many of those were never computed is read
   from the model's statistics (its inference count less the answered requests; its success
   count must equal the answered ones) and ``bitserve_requests_cancelled_total``.
4. **Priority.** The same model with ``priority_levels = 2``: 200 low-priority clients keep
   about 200 requests queued while high-priority requests are sent one after another, each
   at a random moment of a batch; their median latency is compared with the model's batch
   time (and with the same requests sent without a priority).

    python -m benchmarks.bench_lifecycle                 # writes benchmarks/results/lifecycle.md
    python -m benchmarks.bench_lifecycle --before /tmp/bitserve-main
    python -m benchmarks.bench_lifecycle --smoke         # short, prints only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families

from benchmarks._common import markdown_table, parse_args, report
from benchmarks.bench_overhead import before_server, check_answer
from benchmarks.overhead import perf, tiny
from benchmarks.overhead.perf import Load, Running
from harness.otlp_receiver import OtlpReceiver, Span
from harness.paced import write_paced_model
from harness.server import free_port, perf_analyzer

CONCURRENCY = 16
SPAN_QUEUE = 1 << 16
"""``OTEL_BSP_MAX_QUEUE_SIZE`` of the server that traces every request."""
STAYING = 24
ONE = ("--workers", "1")
"""One process for every server here: the queue each request joins is the one measured."""
OFF, ON_1, ON_100, BEFORE = "tracing off", "tracing on, 1%", "tracing on, 100%", "before"
REST_SPAN = "POST /v2/models/{model}/infer"
GRPC_SPAN = "inference.GRPCInferenceService/ModelInfer"
CHILDREN = {"decode", "queue", "compute", "encode"}
PACED = "paced"


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``: (name, sorted labels) -> value."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def requests_total(url: str, model: str) -> float:
    return sum(
        v
        for (name, labels), v in scrape(url).items()
        if name == "bitserve_requests_total" and ("model", model) in labels
    )


def whole_traces(spans: list[Span]) -> tuple[int, int]:
    """(server spans, those whose four children and batch span arrived)."""
    by_parent: dict[str, set[str]] = {}
    batches = set()
    for s in spans:
        by_parent.setdefault(s.parent_span_id, set()).add(s.name)
        if s.name == "batch":
            batches.update(s.links)
    servers = [s for s in spans if s.name in (REST_SPAN, GRPC_SPAN)]
    ok = sum(
        1
        for s in servers
        if by_parent.get(s.span_id, set()) >= CHILDREN and (s.trace_id, s.span_id) in batches
    )
    return len(servers), ok


def callers_arrive(server: Running, grpc_port: int, receiver: OtlpReceiver, n: int) -> list[object]:
    """``n`` REST and ``n`` gRPC requests with a sampled ``traceparent``: how many arrived
    whole with their caller's trace id."""
    ids: dict[str, str] = {}
    head = (
        b'{"inputs":[{"name":"bits","datatype":"UINT8","shape":[1,1,1],'
        b'"parameters":{"binary_data_size":1}}]}'
    )
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for _ in range(n):
            trace_id = secrets.token_hex(16)
            ids[trace_id] = REST_SPAN
            r = client.post(
                f"/v2/models/{tiny.NAME}/infer",
                content=head + b"\x0f",
                headers={
                    "Inference-Header-Content-Length": str(len(head)),
                    "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01",
                },
            )
            r.raise_for_status()
    g = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    x = grpcclient.InferInput(tiny.INPUT, [1, 1, 1], "UINT8")
    x.set_data_from_numpy(np.array([[[15]]], np.uint8))
    for _ in range(n):
        trace_id = secrets.token_hex(16)
        ids[trace_id] = GRPC_SPAN
        g.infer(tiny.NAME, [x], headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
    g.close()

    def arrived(spans: list[Span]) -> int:
        # The callers' requests (the server span must be the one their transport names),
        # with every span they link to.
        mine = [s for s in spans if s.trace_id in ids and s.name not in (REST_SPAN, GRPC_SPAN)]
        mine += [s for s in spans if ids.get(s.trace_id) == s.name]
        return whole_traces(mine + [s for s in spans if s.name == "batch"])[1]

    deadline = time.monotonic() + 30
    while arrived(receiver.snapshot()) < 2 * n and time.monotonic() < deadline:
        time.sleep(0.2)
    got = arrived(receiver.snapshot())
    return [f"{n} REST + {n} gRPC requests with a sampled traceparent", 2 * n, got,
            "yes" if got == 2 * n else "NO"]  # fmt: skip


def tracing_cost(args: argparse.Namespace, before: Path | None) -> tuple[str, list[list[object]]]:
    command = perf_analyzer()
    if command is None and not args.smoke:
        raise SystemExit("perf_analyzer not found: set PERF_ANALYZER (benchmarks/overhead)")
    rounds = 1 if args.smoke else 5
    grpc_port = free_port()
    with (
        tempfile.TemporaryDirectory(prefix="bench-lifecycle-") as tmp,
        OtlpReceiver("http") as r1,
        OtlpReceiver("http") as r100,
    ):
        repo = tiny.write_repository(Path(tmp) / "tiny")

        def env(receiver: OtlpReceiver, arg: str, **more: str) -> list[str]:
            e = receiver.environ(
                OTEL_TRACES_SAMPLER="parentbased_traceidratio", OTEL_TRACES_SAMPLER_ARG=arg, **more
            )
            return ["env", *(f"{k}={v}" for k, v in e.items())]

        # Every request traced under a saturating load makes spans faster than one exporter
        # thread sends them: the SDK's span queue (2048 by default) would drop some.
        def grpc(port: int | None = None) -> tuple[str, str]:
            """Every server serves gRPC too (as in production), each on a port of its own."""
            return ("--grpc-port", str(port or free_port()))

        traced_all = env(r100, "1.0", OTEL_BSP_MAX_QUEUE_SIZE=str(SPAN_QUEUE))
        servers = [
            (OFF, perf.bitserve(repo, *ONE, *grpc())),
            (ON_1, [*env(r1, "0.01"), *perf.bitserve(repo, *ONE, *grpc(grpc_port))]),
            (ON_100, [*traced_all, *perf.bitserve(repo, *ONE, *grpc())]),
        ]
        if before is not None:
            servers.insert(0, (BEFORE, [*before_server(before, repo), *ONE, *grpc()]))
        loads: dict[str, list[Load]] = {}
        with perf.start(servers) as running:
            for r in running:
                check_answer(r)
            for _ in range(rounds):
                for r in running:
                    load = perf.measure(command, r, tiny.NAME, CONCURRENCY, smoke=args.smoke)
                    loads.setdefault(r.label, []).append(load)
                    print(f"{r.label}: {load.rps:.0f} req/s", flush=True)
            by_label = {r.label: r for r in running}
            arrivals = []
            for label, receiver, every in ((ON_1, r1, 100), (ON_100, r100, 1)):
                n = requests_total(by_label[label].url, tiny.NAME)
                expected = int(n) // every
                deadline = time.monotonic() + 30
                while whole_traces(receiver.snapshot())[1] < expected:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
                spans, ok = whole_traces(receiver.snapshot())
                arrivals.append([f"{label}: {int(n)} requests, 1 in {every} traced", expected, ok,
                                 "yes" if ok == spans == expected else "NO"])  # fmt: skip
            arrivals.append(callers_arrive(by_label[ON_1], grpc_port, r1, 5 if args.smoke else 100))

    def med(label: str, field: str) -> float:
        return statistics.median(getattr(x, field) for x in loads[label])

    labels = [s[0] for s in servers]
    rows = [[label, med(label, "rps"), med(label, "p50_us") / 1e3, med(label, "p99_us") / 1e3,
             med(label, "cpu_us_per_request")] for label in labels]  # fmt: skip
    table = markdown_table(["server", "req/s", "p50 ms", "p99 ms", "server CPU µs/req"], rows)
    arrival_table = markdown_table(["traced requests", "expected whole", "arrived whole", "all"],
                                   arrivals)  # fmt: skip

    def ratio(a: str, b: str) -> float:
        """The median over rounds of ``a``'s req/s over ``b``'s in the same round (servers
        measured one after the other: a busy spell of the machine hits both)."""
        return statistics.median(x.rps / y.rps for x, y in zip(loads[a], loads[b], strict=True))

    spread = min(x.rps for x in loads[OFF]) / max(x.rps for x in loads[OFF])
    targets: list[list[object]] = [
        [f"{ON_1} / {OFF} (req/s, median of the rounds' ratios)", ratio(ON_1, OFF), ">= 0.9"],
        [f"{ON_100} / {OFF}", ratio(ON_100, OFF), "reported"],
        [f"{OFF}: slowest / fastest round (the noise)", spread, "reported"],
    ]
    if before is not None:
        targets.insert(0, [f"{OFF} / {BEFORE}", ratio(OFF, BEFORE), "within noise of 1.0"])
    text = (
        f"Tiny model, V2 binary requests from perf_analyzer at concurrency {CONCURRENCY}, "
        f"{rounds} interleaved round(s), medians (load generator on the same "
        f"{os.cpu_count()} cores; every server serves gRPC too, idle here). The server that "
        f"traces every request has a span queue of "
        f"{SPAN_QUEUE} (`OTEL_BSP_MAX_QUEUE_SIZE`; the SDK's default of 2048 drops spans "
        f"when the exporter falls behind, and logs it).\n\n{table}\n\n"
        f"Traces at the OTLP receiver:\n\n{arrival_table}"
    )
    return text, targets


class Connection:
    """One kept-alive HTTP/1.1 connection sending paced requests, written by hand: a
    Python load of 200 clients must cost the two cores far less than httpx would."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    @staticmethod
    def request(rounds: int, priority: int | None = None) -> bytes:
        """A JSON V2 request for ``rounds`` rounds (at ``priority``)."""
        body: dict[str, object] = {
            "inputs": [{"name": "x", "datatype": "INT32", "shape": [1, 1], "data": [rounds]}]
        }
        if priority is not None:
            body["parameters"] = {"priority": priority}
        data = json.dumps(body).encode()
        head = f"POST /v2/models/{PACED}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}"
        return head.encode() + b"\r\n\r\n" + data

    async def send(self, request: bytes) -> float:
        """Send ``request`` and read its answer (which must be a 200); its latency."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        assert self.reader is not None
        t0 = time.perf_counter()
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"answered {head[:200]!r}")
        length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
        await self.reader.readexactly(length)
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def batch_seconds(url: str) -> float:
    m = scrape(url)
    key = (("model", PACED),)
    return m[("bitserve_compute_seconds_sum", key)] / m[("bitserve_compute_seconds_count", key)]


def stats(url: str) -> dict[str, float]:
    (s,) = httpx.get(f"{url}/v2/models/{PACED}/stats", timeout=30).json()["model_stats"]
    return {"success": s["inference_stats"]["success"]["count"], "computed": s["inference_count"]}


async def cancellation(url: str, port: int, rounds: int, leaving: int) -> list[list[object]]:
    """``STAYING`` clients keep the model busy (three batches' worth: two wait while one
    runs); ``leaving`` more close their connection 20 ms after sending, while queued."""
    before = stats(url)
    cancelled0 = scrape(url).get(
        ("bitserve_requests_cancelled_total", (("model", PACED), ("version", "1"))), 0.0
    )
    request = Connection.request(rounds)
    stop = asyncio.Event()
    answered = 0

    async def staying() -> None:
        nonlocal answered
        conn = Connection(port)
        while not stop.is_set():
            await conn.send(request)
            answered += 1
        conn.close()

    async def leave() -> None:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.close()

    stayers = [asyncio.create_task(staying()) for _ in range(STAYING)]
    await asyncio.sleep(1.0)  # the queue is deep before anyone leaves
    for _ in range(leaving):
        await leave()
        await asyncio.sleep(0.005)
    stop.set()
    await asyncio.gather(*stayers)
    await asyncio.sleep(1.0)  # the last batches end
    after = stats(url)
    computed = after["computed"] - before["computed"]
    cancelled = (
        scrape(url).get(
            ("bitserve_requests_cancelled_total", (("model", PACED), ("version", "1"))), 0.0
        )
        - cancelled0
    )
    never = leaving - (computed - answered)
    t = batch_seconds(url)
    return [
        ["batch time (mean, s)", t, ">= 0.05"],
        ["clients that closed their connection while queued", leaving, ""],
        ["of those, never computed (inference count - answered)", never, ""],
        ["never computed / closed", never / leaving, ">= 0.95"],
        ["bitserve_requests_cancelled_total", cancelled, f"= {never}"],
        ["success count - answered (closing clients answered before they closed)",
         after["success"] - before["success"] - answered, "= closed - never computed"],
    ]  # fmt: skip


async def priority(url: str, port: int, rounds: int, highs: int, lows: int) -> list[list[object]]:
    """``lows`` low-priority clients keep that many requests queued; high-priority (then
    priority-less) requests are sent one after another."""
    stop = asyncio.Event()
    low_request = Connection.request(rounds, priority=2)

    async def low() -> None:
        conn = Connection(port)
        while not stop.is_set():
            await conn.send(low_request)
        conn.close()

    lowers = [asyncio.create_task(low()) for _ in range(lows)]
    deadline = time.monotonic() + 60
    # Every low request queued but those of the running batch and the next.
    while scrape(url).get(("bitserve_queue_depth", (("model", PACED),)), 0) < lows - 16:
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    depth = scrape(url).get(("bitserve_queue_depth", (("model", PACED),)), 0)
    # Each sent at a random moment of a batch (right after an answer, the next batch has
    # just started: every request would wait for a whole one).
    rng = random.Random(22)
    pace = batch_seconds(url)
    conn = Connection(port)
    high, plain = [], []
    for _ in range(highs):
        await asyncio.sleep(rng.uniform(0, pace))
        high.append(await conn.send(Connection.request(rounds, priority=1)))
    for _ in range(max(2, highs // 4)):
        await asyncio.sleep(rng.uniform(0, pace))
        plain.append(await conn.send(Connection.request(rounds)))
    conn.close()
    stop.set()
    await asyncio.gather(*lowers)
    t = batch_seconds(url)
    return [
        ["low-priority requests queued when the highs were sent", depth, f"~{lows}"],
        ["batch time (mean, s)", t, ""],
        ["high-priority latency, median (s)", statistics.median(high), ""],
        ["high-priority median / batch time", statistics.median(high) / t, "<= 2"],
        ["the same requests without a priority (default level 2), median / batch time",
         statistics.median(plain) / t, "reported"],
    ]  # fmt: skip


def paced_server(args: argparse.Namespace) -> tuple[list[list[object]], list[list[object]]]:
    leaving, highs, lows = (10, 3, 20) if args.smoke else (200, 20, 200)
    with tempfile.TemporaryDirectory(prefix="bench-lifecycle-") as tmp:
        repo = write_paced_model(
            Path(tmp), PACED, max_batch_size=8, max_queue_size=1024, priority_levels=2,
            default_priority_level=2,
        )  # fmt: skip
        with perf.start([("paced", perf.bitserve(repo, *ONE, "--no-access-log"))]) as (server,):
            # Rounds per request for a batch of about 100 ms (>= 50 ms with room for a quieter
            # machine), from the fastest of three measured batches.
            per_round = asyncio.run(_calibrate(server.port, 40)) / 40
            rounds = max(1, int(0.1 / per_round) + 1)
            print(f"paced: {per_round * 1e3:.2f} ms a round: {rounds} rounds a request", flush=True)
            cancel = asyncio.run(cancellation(server.url, server.port, rounds, leaving))
            prio = asyncio.run(priority(server.url, server.port, rounds, highs, lows))
    return cancel, prio


async def _calibrate(port: int, rounds: int) -> float:
    """The fastest of three one-request batches of ``rounds`` rounds, in seconds (its
    latency: the batch and a request's handling)."""
    conn = Connection(port)
    seconds = min([await conn.send(Connection.request(rounds)) for _ in range(3)])
    conn.close()
    return seconds


def main() -> None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--before", type=Path, default=None)
    known, rest = pre.parse_known_args()
    args = parse_args(__doc__.splitlines()[0], rest)
    before = known.before.resolve() if known.before is not None else None
    cost_text, cost_targets = tracing_cost(args, before)
    cancel, prio = paced_server(args)
    body = f"""
## Tracing

{cost_text}

{markdown_table(["measure", "value", "target"], cost_targets)}

## Work dropped when its client has gone

{markdown_table(["measure", "value", "target"], cancel)}

## Priority levels

{markdown_table(["measure", "value", "target"], prio)}
"""
    report("lifecycle", "Request lifecycle: tracing, cancellation, priorities", body,
           smoke=args.smoke, devices=args.device)  # fmt: skip


if __name__ == "__main__":
    main()
