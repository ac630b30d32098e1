"""docker-compose.yml's services as ``docker run`` flags, for engines without Compose v2.

Debian bookworm's ``docker-compose`` (1.29) refuses the file (top-level ``name:``,
``depends_on.required``) and its Compose v2 plugin is not packaged, so the container tests run
the file's services with ``docker run`` on one user-defined network, each flag taken from the
file: what the file says is what runs. Every key a service may have is either translated
here or named as not a run flag (image, build, profiles, deploy, depends_on); any other key
fails the translation, so a new key in the file cannot be skipped silently.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._manifests import ROOT

# Keys that are not flags of `docker run`: the image is given, the build is done, the
# profile is chosen, the start order is the caller's; `deploy` reserves GPUs, which the
# container tests (no GPU) do not run.
NOT_RUN_FLAGS = frozenset({"image", "build", "profiles", "deploy", "depends_on"})
_VARIABLE = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(value: str, env: Mapping[str, str] | None = None) -> str:
    """Compose's ``${VAR:-default}`` / ``${VAR}``, with ``env`` (empty by default)."""
    env = env or {}
    return _VARIABLE.sub(lambda m: env.get(m.group(1)) or m.group(2) or "", value)


def _seconds(text: str) -> int:
    units = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    total = sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text))
    return max(1, round(total))


def _healthcheck(check: dict[str, Any]) -> list[str]:
    test = check["test"]
    if test[0] == "CMD":
        command = shlex.join(test[1:])  # docker run's --health-cmd is run by a shell
    elif test[0] == "CMD-SHELL":
        (command,) = test[1:]
    else:
        raise ValueError(f"healthcheck test {test[0]!r} is not translated")
    out = ["--health-cmd", command]
    for key, flag in (("interval", "--health-interval"), ("timeout", "--health-timeout"),
                      ("start_period", "--health-start-period")):  # fmt: skip
        if key in check:
            out += [flag, f"{_seconds(check[key])}s"]
    if "retries" in check:
        out += ["--health-retries", str(check["retries"])]
    unknown = set(check) - {"test", "interval", "timeout", "start_period", "retries"}
    if unknown:
        raise ValueError(f"healthcheck keys not translated: {sorted(unknown)}")
    return out


def run_args(
    name: str,
    service: dict[str, Any],
    *,
    network: str,
    env: Mapping[str, str] | None = None,
    sources: Mapping[str, Path] | None = None,
) -> list[str]:
    """The ``docker run`` flags (before the image) for compose service ``name``.

    Args:
        name: the service's name; like Compose, it is a DNS name on the network.
        service: the service's mapping, YAML merge keys resolved.
        network: the user-defined network to join.
        env: the variables the file interpolates (``${BITSERVE_WORKERS:-auto}``, ...).
        sources: bind mount sources to use instead of the file's, by the interpolated
            source (``{"./models": tmp_path}``); other relative sources are the project's.
    Returns:
        The flags. Published ports go to a free loopback port (``-p 127.0.0.1::PORT``),
        never the file's host port: other servers on the machine may hold it.

    Raises:
        ValueError: a key or value this translation does not know.
    """
    unknown = set(service) - NOT_RUN_FLAGS - _TRANSLATED
    if unknown:
        raise ValueError(f"service {name}: keys not translated to docker run: {sorted(unknown)}")
    sources = sources or {}
    out = ["--network", network, "--network-alias", name]
    for alias in service.get("networks", {}).get("default", {}).get("aliases", []):
        out += ["--network-alias", alias]
    if set(service.get("networks", {})) - {"default"}:
        raise ValueError(f"service {name}: only the default network is translated")
    for key, value in service.get("environment", {}).items():
        out += ["-e", f"{key}={interpolate(str(value), env)}"]
    for volume in service.get("volumes", []):
        if not isinstance(volume, dict) or volume.get("type") != "bind":
            raise ValueError(f"service {name}: only long-form bind mounts are translated")
        source = interpolate(volume["source"], env)
        path = sources.get(source) or (ROOT / source).resolve()
        mount = f"type=bind,source={path},target={volume['target']}"
        out += ["--mount", mount + (",readonly" if volume.get("read_only") else "")]
    for port in service.get("ports", []):
        out += ["-p", f"127.0.0.1::{interpolate(str(port), env).rsplit(':', 1)[-1]}"]
    for port in service.get("expose", []):
        out += ["--expose", str(port)]
    if service.get("read_only"):
        out.append("--read-only")
    for mount in service.get("tmpfs", []):
        out += ["--tmpfs", mount]
    if "shm_size" in service:
        out += ["--shm-size", str(service["shm_size"])]
    for limit, value in service.get("ulimits", {}).items():
        soft, hard = (value, value) if isinstance(value, int) else (value["soft"], value["hard"])
        out += ["--ulimit", f"{limit}={soft}:{hard}"]
    if "restart" in service:
        out += ["--restart", service["restart"]]
    if "stop_grace_period" in service:
        out += ["--stop-timeout", str(_seconds(service["stop_grace_period"]))]
    if "healthcheck" in service:
        out += _healthcheck(service["healthcheck"])
    return out


_TRANSLATED = frozenset(
    {"networks", "environment", "volumes", "ports", "expose", "read_only", "tmpfs", "shm_size",
     "ulimits", "restart", "stop_grace_period", "healthcheck"}
)  # fmt: skip
