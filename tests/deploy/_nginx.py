"""Running deploy/nginx/bitserve.conf under a real, unprivileged nginx on loopback."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from ._manifests import DEPLOY

SITE = DEPLOY / "nginx" / "bitserve.conf"
# An upstream `server host:port params;` line, and the `listen` line.
_SERVER = re.compile(r"^([ \t]*server[ \t]+)([^\s;]+:\d+)((?:[ \t][^\n]*)?;)$", re.MULTILINE)
_LISTEN = re.compile(r"^([ \t]*listen[ \t]+)([^\s;]+)(;)$", re.MULTILINE)


def nginx_binary() -> str | None:
    """nginx on PATH, or Debian's /usr/sbin/nginx (not on a non-root user's PATH)."""
    found = shutil.which("nginx")
    if found:
        return found
    return "/usr/sbin/nginx" if Path("/usr/sbin/nginx").is_file() else None


def upstream_servers(text: str | None = None) -> list[str]:
    """The ``server`` addresses of the ``upstream`` block, in order."""
    text = SITE.read_text() if text is None else text
    block = re.search(r"upstream\s+bitserve\s*\{(.*?)\}", text, re.DOTALL)
    assert block, "no `upstream bitserve` block"
    return [m.group(2) for m in _SERVER.finditer(block.group(1))]


def loopback_site(replica_ports: list[int], listen_port: int) -> str:
    """The deployed site config with only the replica and listen addresses changed.

    Raises:
        AssertionError: if the file no longer has the shape this rewrite expects.
    """
    text = SITE.read_text()
    servers = upstream_servers(text)
    assert len(servers) == len(replica_ports), (servers, replica_ports)
    it = iter(replica_ports)
    out, n_servers = _SERVER.subn(lambda m: f"{m.group(1)}127.0.0.1:{next(it)}{m.group(3)}", text)
    assert n_servers == len(replica_ports)
    out, n_listen = _LISTEN.subn(lambda m: f"{m.group(1)}127.0.0.1:{listen_port}{m.group(3)}", out)
    assert n_listen == 1
    return out


def main_config(prefix: Path, site: Path) -> str:
    """A main nginx.conf for an unprivileged nginx whose every path lies under ``prefix``."""
    return f"""
daemon off;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log info;
events {{ worker_connections 256; }}
http {{
    access_log {prefix}/access.log;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    include {site};
}}
"""


def write_config(prefix: Path, replica_ports: list[int], listen_port: int) -> Path:
    """Write the site copy and its main config under ``prefix``; return the main config."""
    prefix.mkdir(parents=True, exist_ok=True)
    site = prefix / "bitserve.conf"
    site.write_text(loopback_site(replica_ports, listen_port))
    conf = prefix / "nginx.conf"
    conf.write_text(main_config(prefix, site))
    return conf


def nginx_command(binary: str, prefix: Path, conf: Path, *extra: str) -> list[str]:
    # -e: the error log before the config is read (defaults to /var/log/nginx, not writable).
    return [binary, "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf), *extra]


@contextmanager
def running_nginx(binary: str, prefix: Path, conf: Path, port: int) -> Iterator[str]:
    """Run nginx in the foreground of a child process; yield its base URL; stop it."""
    proc = subprocess.Popen(
        nginx_command(binary, prefix, conf),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 15
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"nginx exited with {proc.returncode}: {proc.stderr.read()}")  # type: ignore[union-attr]
            try:
                if httpx.get(f"{base}/nginx-health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("nginx did not answer /nginx-health within 15 s")
            time.sleep(0.05)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
