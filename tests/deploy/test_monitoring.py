"""Prometheus and Grafana config: they scrape and chart the metrics the server really exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from functools import cache
from typing import Any

import pytest

from service.metrics import Metrics

from ._manifests import DEPLOY, ROOT, load_yaml_documents

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
    m.observe_request("demo", "success", 0.01)
    m.observe_queue("demo", 0.001)
    m.observe_batch("demo", items=4, requests=2, compute_seconds=0.005)
    m.set_queue_depth("demo", 3)
    m.set_device_memory("demo", "cuda:0", 1 << 20)
    m.in_flight.inc()
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


def test_prometheus_scrapes_every_replica_directly() -> None:
    from ._nginx import upstream_servers

    # The same replicas nginx balances over, each scraped itself (not through nginx).
    assert prometheus_targets() == upstream_servers()
    (config,) = load_yaml_documents(PROMETHEUS)
    assert config["global"]["scrape_interval"] == "5s"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_prometheus_config() -> None:
    result = subprocess.run(
        ["promtool", "check", "config", "--syntax-only", str(PROMETHEUS)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_queries_only_metrics_the_server_exports() -> None:
    series = exported_series()
    seen = set()
    for expr in expressions(dashboard()):
        for selector in re.finditer(r"\b(bitserve_\w+)(?:\{([^}]*)\})?", expr):
            name = selector.group(1)
            assert name in series, f"{name} is not exported by service/metrics.py ({expr})"
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
