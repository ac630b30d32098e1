"""Prometheus and Grafana config: they scrape and chart the metrics the server really exports."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from service.observability.metrics import Metrics

from ._manifests import DEPLOY, ROOT, load_yaml_documents
from ._replicas import Replica, free_port, infer_body

PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "bitserve.json"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "bitserve.yml"
# Labels Prometheus adds to every scraped series, and the histogram bucket label.
_SCRAPE_LABELS = {"instance", "job", "service", "le"}


def prometheus_targets() -> list[str]:
    """Targets of the ``bitserve`` scrape job."""
    (config,) = load_yaml_documents(PROMETHEUS)
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "bitserve"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    return [t for sc in job["static_configs"] for t in sc["targets"]]


@cache
def exported_series() -> dict[str, set[str]]:
    """Sample name -> label names, from a real Metrics after one call of every observer."""
    m = Metrics()
    m.request_started()
    m.request_started()
    m.request_finished("demo", "success", 0.01)
    m.observe_queue("demo", [0.001])
    m.observe_batch("demo", items=4, requests=2, compute_seconds=0.005)
    m.queue_depth.labels("demo").inc(3)
    m.set_device_memory("demo", "cuda:0", 1 << 20)
    series: dict[str, set[str]] = {}
    for line in m.render().decode().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        match = re.match(r"^(\w+)(?:\{(.*)\})? ", line)
        assert match, line
        labels = set(re.findall(r"(\w+)=\"", match.group(2) or ""))
        series.setdefault(match.group(1), set()).update(labels)
    return series


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dash["panels"] if p["type"] != "row"]


def expressions(dash: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in panels(dash) for t in p["targets"]]


def test_prometheus_scrapes_bitserve_directly() -> None:
    from ._nginx import upstream_servers

    # The service nginx sends to, scraped itself (not through nginx), once: any worker's
    # /metrics adds up every worker.
    assert prometheus_targets() == sorted(set(upstream_servers()))
    (config,) = load_yaml_documents(PROMETHEUS)
    assert config["global"]["scrape_interval"] == "5s"


needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool is not installed (Debian: prometheus)"
)


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, check=False)


@needs_promtool
def test_promtool_accepts_the_prometheus_config() -> None:
    result = promtool("check", "config", "--syntax-only", str(PROMETHEUS))
    assert result.returncode == 0, result.stdout + result.stderr


def grafana_to_promql(expr: str) -> str:
    """A dashboard expression with Grafana's variables replaced as Grafana would."""
    expr = expr.replace("$__rate_interval", "1m")
    return re.sub(r"\$(model|instance)\b", ".*", expr)


@needs_promtool
def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    # promtool parses recording rules with Prometheus's own PromQL parser.
    exprs = [grafana_to_promql(e) for e in expressions(dashboard())]
    rules: dict[str, Any] = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query{i}", "expr": e} for i, e in enumerate(exprs)
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(exprs)} rules found" in result.stdout
    # ...and it does reject a broken expression.
    rules["groups"][0]["rules"].append({"record": "dashboard:broken", "expr": "sum by (le rate(x)"})
    path.write_text(json.dumps(rules))
    assert promtool("check", "rules", str(path)).returncode != 0


def test_dashboard_queries_only_metrics_the_server_exports() -> None:
    series = exported_series()
    seen = set()
    for expr in expressions(dashboard()):
        for selector in re.finditer(r"\b(bitserve_\w+)(?:\{([^}]*)\})?", expr):
            name = selector.group(1)
            assert name in series, (
                f"{name} is not exported by service/observability/metrics.py ({expr})"
            )
            seen.add(name)
            used = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector.group(2) or ""))
            assert used <= series[name] | _SCRAPE_LABELS, (name, used - series[name])
        for group in re.findall(r"\bby\s*\(([^)]*)\)", expr):
            labels = {label.strip() for label in group.split(",")}
            names = {n for n in re.findall(r"\b(bitserve_\w+)", expr)}
            available = set.union(*(series[n] for n in names)) if names else set()
            assert labels <= available | _SCRAPE_LABELS, (expr, labels)
    # The issue's list: request rate, latency percentiles, queue time, batch size, errors,
    # device memory (+ compute time, queue depth and in-flight requests).
    assert {
        "bitserve_requests_total",
        "bitserve_request_latency_seconds_bucket",
        "bitserve_queue_seconds_bucket",
        "bitserve_compute_seconds_bucket",
        "bitserve_batch_size_sum",
        "bitserve_batch_size_bucket",
        "bitserve_batch_requests_sum",
        "bitserve_queue_depth",
        "bitserve_in_flight_requests",
        "bitserve_device_memory_bytes",
    } <= seen


def test_dashboard_has_the_panels_the_issue_lists() -> None:
    exprs = expressions(dashboard())
    for q in ("0.5", "0.99"):
        latency = f"histogram_quantile({q}, sum by (le) (rate(bitserve_request_latency"
        assert any(latency in e for e in exprs), q
    assert any('outcome!="success"' in e for e in exprs), "no error panel"
    assert any("rate(bitserve_requests_total" in e and "by (instance)" in e for e in exprs)
    units = {p["title"]: p["fieldConfig"]["defaults"]["unit"] for p in panels(dashboard())}
    assert units["Device memory"] == "bytes"
    assert units["Latency percentiles"] == units["Queue time"] == "s"


def test_dashboard_layout_and_datasource() -> None:
    dash = dashboard()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0, p["title"]
        assert g["x"] + g["w"] <= 24, p["title"]
        own = {(g["x"] + dx, g["y"] + dy) for dx in range(g["w"]) for dy in range(g["h"])}
        assert not own & cells, f"panel {p['title']!r} overlaps another"
        cells |= own
    (datasources,) = load_yaml_documents(DATASOURCES)
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    uids = {t["datasource"]["uid"] for p in panels(dash) for t in p["targets"]}
    uids |= {p["datasource"]["uid"] for p in panels(dash)}
    uids |= {v["datasource"]["uid"] for v in dash["templating"]["list"]}
    assert uids == {source["uid"]}
    # Template variables are used by the panels they filter.
    assert all("$instance" in e for e in expressions(dash))


def test_grafana_provisioning_paths_match_the_compose_mounts() -> None:
    (compose,) = load_yaml_documents(ROOT / "docker-compose.yml")
    mounts = {
        v["source"]: v["target"]
        for v in compose["services"]["grafana"]["volumes"]
        if isinstance(v, dict)
    }
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    (providers,) = load_yaml_documents(PROVIDERS)
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    grafana_env = compose["services"]["grafana"]["environment"]
    home = grafana_env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"
    (prom,) = [v for v in compose["services"]["prometheus"]["volumes"] if isinstance(v, dict)]
    assert prom["source"] == "./" + str(PROMETHEUS.relative_to(ROOT))


needs_prometheus = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="prometheus is not installed (Debian: prometheus)"
)


@contextmanager
def running_prometheus(config: dict[str, Any], tmp_path: Path, port: int) -> Iterator[str]:
    """A real Prometheus on 127.0.0.1:``port`` with ``config``; yields its base URL."""
    path = tmp_path / "prometheus.yml"
    path.write_text(json.dumps(config))
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={path}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(f"{base}/-/ready", timeout=2).status_code == 200, proc, 60)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def wait_for(
    condition: Callable[[], bool], proc: subprocess.Popen[bytes] | None, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if condition():
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(0.25)


def query(base: str, expr: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10)
    body = response.json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]  # type: ignore[no-any-return]


@pytest.mark.e2e
@needs_prometheus
def test_prometheus_scrapes_a_real_server_and_the_dashboard_shows_it(
    tmp_path: Path, server: Replica
) -> None:
    # The deployed config with a loopback target and a faster scrape, run by a real
    # Prometheus, against a real `bitserve serve --workers 2`.
    (config,) = load_yaml_documents(PROMETHEUS)
    port = free_port()
    config["global"]["scrape_interval"] = "1s"
    for job in config["scrape_configs"]:
        (static,) = job["static_configs"]
        if job["job_name"] == "bitserve":
            assert len(static["targets"]) == 1
            static["targets"] = [f"127.0.0.1:{server.port}"]
        else:
            static["targets"] = [f"127.0.0.1:{port}"]
    with running_prometheus(config, tmp_path, port) as base:
        wait_for(lambda: len(query(base, 'up{job="bitserve"} == 1')) == 1, None, 60)
        success = 'sum(bitserve_requests_total{outcome="success"})'
        before = query(base, success)
        start = float(before[0]["value"][1]) if before else 0.0
        # Traffic spread over a few scrapes and over both workers (a new connection each).
        metadata = httpx.get(f"{server.url}/v2/models/demo", timeout=30).json()
        (spec,) = metadata["inputs"]
        x = np.random.default_rng(1).integers(0, 256, [1, *spec["shape"][1:]], dtype=np.uint8)
        body, headers = infer_body(spec["name"], x, "UINT8", metadata["outputs"][0]["name"])
        workers: set[str] = set()
        sent = 0
        for _ in range(4):
            for _ in range(6):
                ok = httpx.post(
                    f"{server.url}/v2/models/demo/infer", content=body, headers=headers, timeout=60
                )
                assert ok.status_code == 200, ok.text
                workers.add(ok.headers["x-bitserve-worker"])
                sent += 1
            time.sleep(1.2)
        assert workers == {"0", "1"}
        # One target, and it counts what every worker served.
        wait_for(lambda: float(query(base, success)[0]["value"][1]) - start == sent, None, 30)

        results = {}
        for p in panels(dashboard()):
            for t in p["targets"]:
                expr = grafana_to_promql(t["expr"]).replace("[1m]", "[15s]")
                results[(p["title"], t["legendFormat"])] = query(base, expr)

        def value(title: str, legend: str) -> float:
            series = results[(title, legend)]
            assert series, f"{title} / {legend}: no data"
            return float(series[0]["value"][1])

        assert value("Replicas up", "up") == 1
        assert value("Requests / s", "requests/s") > 0
        assert len(results[("Request rate by replica", "{{instance}}")]) == 1
        assert 0 < value("Latency percentiles", "p50") <= value("Latency percentiles", "p99")
        # Each request above is sent alone, so it waits out the demo model's whole batching
        # window before its batch starts: the queue-time panel must show at least that (it
        # fails on a panel without data, or on a queue time that misses the wait).
        config = httpx.get(f"{server.url}/v2/models/demo/config", timeout=30).json()
        window_s = config["dynamic_batching"]["max_queue_delay_microseconds"] / 1e6
        assert window_s > 0
        assert window_s <= value("Queue time", "p99")
        assert value("Queue time", "p50") <= value("Queue time", "p99")
        assert value("Compute time per batch", "p50") > 0
        assert value("Batch size", "mean items / batch") >= 1
        assert value("Batch size", "mean requests / batch") >= 1
        # One series (device cpu): both workers' copies of the model, added up.
        (memory,) = results[("Device memory", "{{device}} {{instance}}")]
        assert float(memory["value"][1]) > 0
        assert value("Error ratio", "errors") == 0
