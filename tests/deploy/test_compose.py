"""docker-compose.yml: valid Compose, and the stack the deployment issue asks for.

The file is validated against the Compose Specification's JSON schema (vendored, see
schemas/README.md), and by ``docker compose config`` where the Compose v2 plugin exists; its
CPU stack runs for real on a Docker engine in test_container.py, through the ``docker run``
flags that ``_compose_run.run_args`` reads off the file (checked here).
"""

from __future__ import annotations

import copy
import itertools
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from service.settings import Settings

from ._compose_run import NOT_RUN_FLAGS, interpolate, run_args
from ._manifests import ROOT, compose_validator, format_errors, load_yaml_documents
from ._nginx import upstream_servers

COMPOSE = ROOT / "docker-compose.yml"
MPS = ROOT / "deploy" / "compose.mps.yml"
MEMLOCK = ROOT / "deploy" / "compose.memlock.yml"
GPU, CPU = "bitserve-gpu", "bitserve-cpu"
SERVERS = [GPU, CPU]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    (doc,) = load_yaml_documents(COMPOSE)
    return doc


def active_services(compose: dict[str, Any], profiles: set[str]) -> set[str]:
    """The services ``docker compose --profile ... up`` starts (Compose's profile rule)."""
    return {
        name
        for name, svc in compose["services"].items()
        if not svc.get("profiles") or profiles & set(svc["profiles"])
    }


def env(svc: dict[str, Any]) -> dict[str, str]:
    e = svc.get("environment", {})
    assert isinstance(e, dict), "environment is written as a mapping"
    return {k: interpolate(str(v)) for k, v in e.items()}


def duration_s(text: str) -> float:
    units = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text))


def test_compose_file_matches_the_compose_specification(compose: dict[str, Any]) -> None:
    errors = list(compose_validator().iter_errors(compose))
    assert not errors, format_errors(errors)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("services", GPU, "deploy", "resources", "reservations", "devices"), "gpu"),
        (("services", GPU, "deploy", "resources", "reservations", "devices", 0, "count"), ["all"]),
        (("services", "nginx", "ports"), {"8000": 8080}),
        (("services", CPU, "stop_grace"), "40s"),
        (("services", GPU, "healthcheck", "test"), 42),
        (("services", GPU, "volumes", 0, "type"), "bindd"),
    ],
)
def test_schema_rejects_broken_variants(
    compose: dict[str, Any], path: tuple[str | int, ...], value: object
) -> None:
    # The schema check above must be able to fail: each broken copy is refused.
    broken = copy.deepcopy(compose)
    node: Any = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert list(compose_validator().iter_errors(broken))


def _docker_compose_available() -> bool:
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
    return probe.returncode == 0


@pytest.mark.skipif(not _docker_compose_available(), reason="no docker compose plugin here")
@pytest.mark.parametrize(
    ("profiles", "files"),
    [(["gpu"], [COMPOSE]), (["cpu"], [COMPOSE]), (["gpu", "monitoring"], [COMPOSE]),
     (["gpu"], [COMPOSE, MPS]), (["gpu"], [COMPOSE, MEMLOCK])],
)  # fmt: skip
def test_docker_compose_config_accepts_the_file(
    profiles: list[str], files: list[Path], tmp_path: Path
) -> None:
    args = [a for p in profiles for a in ("--profile", p)]
    result = subprocess.run(
        [
            "docker",
            "compose",
            *(a for f in files for a in ("-f", str(f))),
            *args,
            "config",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr


def test_services_and_profiles(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {*SERVERS, "nginx", "prometheus", "grafana"}
    # One bitserve service per profile, whatever the number of GPUs.
    assert active_services(compose, {"gpu"}) == {GPU, "nginx"}
    assert active_services(compose, {"cpu"}) == {CPU, "nginx"}
    assert active_services(compose, {"gpu", "monitoring"}) == {
        GPU,
        "nginx",
        "prometheus",
        "grafana",
    }
    assert active_services(compose, {"cpu", "monitoring"}) == {
        CPU,
        "nginx",
        "prometheus",
        "grafana",
    }
    # nginx's dependency of the inactive profile must not block it.
    assert set(compose["services"]["nginx"]["depends_on"]) == set(SERVERS)
    for spec in compose["services"]["nginx"]["depends_on"].values():
        assert spec["required"] is False


def test_the_gpu_service_takes_every_gpu_of_the_host(compose: dict[str, Any]) -> None:
    svc = compose["services"][GPU]
    (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
    # count: all, not device_ids: the same file on a host with 1 GPU or 8.
    assert device == {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}
    variables = env(svc)
    # Workers spread over the GPUs (worker i on cuda:(i mod GPUs)); the count is auto.
    assert variables["BITSERVE_DEVICE"] == "cuda"
    assert variables["BITSERVE_WORKERS"] == "auto"
    assert "gpus" not in svc


def test_cpu_profile_reserves_no_gpu(compose: dict[str, Any]) -> None:
    svc = compose["services"][CPU]
    assert "gpus" not in svc
    assert "devices" not in svc.get("deploy", {}).get("resources", {}).get("reservations", {})
    assert env(svc)["BITSERVE_DEVICE"] == "cpu"
    assert env(svc)["BITSERVE_WORKERS"] == "auto"


def test_both_profiles_answer_at_the_address_nginx_and_prometheus_use(
    compose: dict[str, Any],
) -> None:
    from .test_monitoring import prometheus_targets

    port = env(compose["services"][GPU])["BITSERVE_PORT"]
    for name in SERVERS:
        assert compose["services"][name]["networks"]["default"]["aliases"] == ["bitserve"]
        assert env(compose["services"][name])["BITSERVE_PORT"] == port
    # The same service twice in nginx's upstream (a retry's second path), once in Prometheus.
    assert upstream_servers() == [f"bitserve:{port}"] * 2
    assert prometheus_targets() == [f"bitserve:{port}"]


def test_model_repository_mounted_read_only(compose: dict[str, Any]) -> None:
    for name in SERVERS:
        svc = compose["services"][name]
        (volume,) = svc["volumes"]
        assert volume["type"] == "bind"
        assert volume["read_only"] is True
        assert volume["target"] == env(svc)["BITSERVE_MODEL_REPOSITORY"] == "/models"
        assert interpolate(volume["source"]) == "./models"


def test_server_settings_are_valid_server_settings(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Every BITSERVE_* variable the compose file sets must be a setting the server knows,
    # with a value it accepts (Settings has extra="forbid" for unknown keyword names, and
    # would silently ignore an unknown variable: hence the explicit name check).
    for name in SERVERS:
        variables = env(compose["services"][name])
        for key in variables:
            assert key.startswith("BITSERVE_")
            assert key.removeprefix("BITSERVE_").lower() in Settings.model_fields, key
        for key, value in variables.items():
            monkeypatch.setenv(key, value)
        # Host-dependent checks (the folder exists, a GPU exists) are for the container.
        monkeypatch.setenv("BITSERVE_MODEL_REPOSITORY", str(tmp_path))
        monkeypatch.setenv("BITSERVE_DEVICE", "cpu")
        settings = Settings()
        assert settings.host == "0.0.0.0"
        assert settings.max_body_bytes == Settings.model_fields["max_body_bytes"].default
        # SIGKILL must not come before the server's own drain deadline.
        grace = duration_s(compose["services"][name]["stop_grace_period"])
        assert grace > settings.graceful_shutdown_s


def test_health_check_probes_readiness_on_the_server_port(compose: dict[str, Any]) -> None:
    # Ready means every worker is ready (any worker answers for all).
    for name in SERVERS:
        svc = compose["services"][name]
        command = " ".join(svc["healthcheck"]["test"])
        assert f"127.0.0.1:{env(svc)['BITSERVE_PORT']}/v2/health/ready" in command


def test_bind_mounted_files_exist(compose: dict[str, Any]) -> None:
    for name in ("nginx", "prometheus", "grafana"):
        for volume in compose["services"][name]["volumes"]:
            if isinstance(volume, dict) and volume["type"] == "bind":
                assert (ROOT / volume["source"]).exists(), volume["source"]
                assert volume["read_only"] is True


def test_nginx_is_the_only_published_entry_point(compose: dict[str, Any]) -> None:
    for name in SERVERS:
        assert "ports" not in compose["services"][name]
    (port,) = compose["services"]["nginx"]["ports"]
    assert interpolate(port) == "8000:8080"
    # Monitoring UIs listen on the host's loopback only.
    for name in ("prometheus", "grafana"):
        assert all(p.startswith("127.0.0.1:") for p in compose["services"][name]["ports"])


def test_mps_override_adds_only_what_mps_needs(compose: dict[str, Any]) -> None:
    (override,) = load_yaml_documents(MPS)
    assert not list(compose_validator().iter_errors(override))
    assert set(override["services"]) == {GPU}
    svc = override["services"][GPU]
    assert svc["ipc"] == "host"
    pipes = svc["environment"]["CUDA_MPS_PIPE_DIRECTORY"]
    (mount,) = svc["volumes"]
    assert mount == {"type": "bind", "source": pipes, "target": pipes}
    # Below the base file's tmpfs /tmp, which Docker mounts first (shallower target).
    assert "/tmp" in compose["services"][GPU]["tmpfs"]
    assert pipes.startswith("/tmp/")


def test_no_limit_an_engine_may_refuse(compose: dict[str, Any]) -> None:
    # Raising RLIMIT_MEMLOCK is refused by some engines ("error setting rlimit type 8:
    # operation not permitted"), and bitserve does not need it: the base file sets no
    # ulimits, and the override that adds memlock adds nothing else.
    for name in SERVERS:
        assert "ulimits" not in compose["services"][name]
    (override,) = load_yaml_documents(MEMLOCK)
    assert not list(compose_validator().iter_errors(override))
    assert override == {"services": {GPU: {"ulimits": {"memlock": -1}}}}


def test_docker_run_flags_are_the_files_settings(compose: dict[str, Any], tmp_path: Path) -> None:
    svc = compose["services"][CPU]
    args = run_args(CPU, svc, network="net", env={"BITSERVE_WORKERS": "3"},
                    sources={"./models": tmp_path})  # fmt: skip
    pairs = list(itertools.pairwise(args))
    assert ("--network", "net") in pairs
    assert ("--network-alias", CPU) in pairs
    assert ("--network-alias", "bitserve") in pairs  # the name nginx and Prometheus use
    assert ("-e", "BITSERVE_WORKERS=3") in pairs
    assert ("-e", "BITSERVE_DEVICE=cpu") in pairs
    assert ("-e", "BITSERVE_LOG_LEVEL=info") in pairs  # the file's default
    assert ("--mount", f"type=bind,source={tmp_path},target=/models,readonly") in pairs
    assert "--read-only" in args
    assert [b for a, b in pairs if a == "--tmpfs"] == svc["tmpfs"]
    assert ("--shm-size", "1gb") in pairs
    assert ("--stop-timeout", "40") in pairs
    assert ("--restart", "unless-stopped") in pairs
    health = args[args.index("--health-cmd") + 1]
    assert health.startswith("python -c ")
    assert "/v2/health/ready" in health
    assert ("--health-interval", "10s") in pairs
    assert ("--health-start-period", "120s") in pairs
    nginx = run_args("nginx", compose["services"]["nginx"], network="net")
    assert ("-p", "127.0.0.1::8080") in itertools.pairwise(nginx)
    conf = ROOT / "deploy" / "nginx" / "bitserve.conf"
    assert f"type=bind,source={conf},target=/etc/nginx/conf.d/default.conf,readonly" in nginx


def test_docker_run_translation_refuses_what_it_does_not_know(compose: dict[str, Any]) -> None:
    # The translation must be able to fail: a key it does not turn into a flag is an error,
    # so a setting added to the file cannot be left out of the container tests silently.
    svc = copy.deepcopy(compose["services"][CPU])
    svc["cap_add"] = ["SYS_NICE"]
    with pytest.raises(ValueError, match="cap_add"):
        run_args(CPU, svc, network="net")
    assert "cap_add" not in NOT_RUN_FLAGS
    svc = copy.deepcopy(compose["services"][CPU])
    svc["healthcheck"]["start_interval"] = "1s"
    with pytest.raises(ValueError, match="start_interval"):
        run_args(CPU, svc, network="net")
