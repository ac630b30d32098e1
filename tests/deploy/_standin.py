"""Stand-in base images for the container tests, built offline from Debian packages.

The Dockerfile's ``BASE_IMAGE`` is ``pytorch/pytorch`` (Python, torch, CUDA) and
docker-compose's nginx is ``nginx:1.28-alpine``; neither can be pulled here (these machines
reach no image hub). The stand-ins, made from one Debian root file system (``debootstrap
--variant=minbase`` with python3, python3-venv, python-is-python3, nginx-light, wget, and
gcc with libc6-dev, which pytorch's CUDA runtime images carry since pytorch#170235 for Triton's
launchers, and which build bitserve's CPU kernels):

- ``bitserve-standin/nginx:<key>``: that file system running ``nginx -g "daemon off;"`` as
  the official image does (``/etc/nginx/conf.d/*.conf`` included, logs to stdout/stderr);
- ``bitserve-standin/python:<key>``: the same plus the pinned torch wheel and NumPy in the
  system Python (where the pytorch image has them) and a wheelhouse ``/wheels`` of the
  dependencies of the extras the Dockerfile installs (``image_extras``) at this test
  environment's versions, with ``PIP_NO_INDEX=1`` and ``PIP_FIND_LINKS=/wheels`` set: the
  Dockerfile, unmodified, then builds with
  ``--build-arg BASE_IMAGE=bitserve-standin/python:<key>`` and installs offline.

``<key>`` is a hash of everything that goes in (this file, the Debian suite and packages, the
image's extras, the pinned versions), so an unchanged set is built once per machine (the
engine keeps it) and any change builds anew. Building needs root (debootstrap, chroot) and
Debian's mirror; it takes about four minutes on a 2-core machine.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata as md
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ._engine import docker, image_exists
from ._manifests import ROOT

SUITE = "bookworm"  # its python3 is 3.11, the Python the pinned torch wheel is built for
PACKAGES = ("python3", "python3-venv", "python-is-python3", "nginx-light", "wget", "gcc",
            "libc6-dev")  # fmt: skip
MIRROR = os.environ.get("BITSERVE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
_LOCK = Path("/tmp/bitserve-standin.lock")
# Our own distributions: the image builds them from the source it is given.
_OURS = {"bitserve", "bitserve-client"}
_CHROOT_ENV = ["env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "LANG=C.UTF-8"]


@dataclass(frozen=True)
class StandIns:
    """The tags of the two stand-in images."""

    python: str
    nginx: str


def pins() -> list[str]:
    """``name==version`` of every distribution in this environment but ours: the versions
    the tests ran with are the versions the image gets."""
    names = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name and name.lower() not in _OURS:
            names[name.lower()] = f"{name}=={dist.version}"
    return sorted(names.values())


def image_extras() -> str:
    """The extras the Dockerfile installs bitserve with (``server,tracing``): the wheelhouse
    holds their dependencies."""
    found = re.search(r'pip install [^\n]*"\.\[([\w,-]+)\]"', (ROOT / "Dockerfile").read_text())
    if found is None:
        raise RuntimeError('the Dockerfile installs no ".[extras]" of bitserve')
    return found.group(1)


def _key(constraints: list[str]) -> str:
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update("\n".join([SUITE, *PACKAGES, image_extras(), *constraints]).encode())
    return digest.hexdigest()[:12]


def stand_ins() -> StandIns:
    """The stand-in images' tags, built first if this engine lacks them.

    Raises:
        RuntimeError: a build step failed (its output is in the message).
    """
    constraints = pins()
    key = _key(constraints)
    tags = StandIns(f"bitserve-standin/python:{key}", f"bitserve-standin/nginx:{key}")
    with _LOCK.open("w") as lock:  # one builder at a time among the test sessions
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (image_exists(tags.python) and image_exists(tags.nginx)):
            _build(tags, constraints)
    return tags


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        output = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{output}")


def _import(rootfs: Path, tag: str, changes: list[str]) -> None:
    """``docker import`` the folder as an image (one layer) with Dockerfile-like changes
    (``docker import`` takes CMD, ENTRYPOINT, ENV, EXPOSE, ONBUILD, USER, VOLUME, WORKDIR)."""
    args = [a for change in changes for a in ("--change", change)]
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    assert tar.stdout is not None
    with tar.stdout:  # the import alone reads the pipe: tar stops if it does
        done = subprocess.run(
            ["docker", "import", *args, "-", tag],
            stdin=tar.stdout,
            capture_output=True,
            check=False,
        )
    if done.returncode != 0:
        tar.kill()
    tar.wait()
    if done.returncode != 0 or tar.returncode != 0:
        raise RuntimeError(f"docker import {tag} failed: {done.stderr.decode(errors='replace')}")


def _build(tags: StandIns, constraints: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="bitserve-standin-", dir="/var/tmp") as tmp:
        rootfs = Path(tmp) / "rootfs"
        _run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE,
              str(rootfs), MIRROR])  # fmt: skip

        # nginx as the official image runs it: only conf.d's files, logs to the container's.
        (rootfs / "etc/nginx/sites-enabled/default").unlink(missing_ok=True)
        for log, target in (("access.log", "/dev/stdout"), ("error.log", "/dev/stderr")):
            path = rootfs / "var/log/nginx" / log
            path.unlink(missing_ok=True)
            path.symlink_to(target)
        nginx = ['CMD ["nginx", "-g", "daemon off;"]', "EXPOSE 80"]
        _import(rootfs, tags.nginx, nginx)

        # The wheelhouse: the image's extras, the build backend, torch and NumPy, at the pins.
        wheels = rootfs / "wheels"
        pinned = Path(tmp) / "constraints.txt"
        pinned.write_text("\n".join(constraints) + "\n")
        torch_pin = next(c for c in constraints if c.lower().startswith("torch=="))
        numpy_pin = next(c for c in constraints if c.lower().startswith("numpy=="))
        _run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
              "-d", str(wheels), "-c", str(pinned), f"{ROOT}[{image_extras()}]", "hatchling",
              torch_pin, numpy_pin])  # fmt: skip
        # torch and NumPy into the system Python, with a throwaway venv's pip (Debian's
        # python3 has none); then the torch wheel itself is not needed any more.
        install = (
            "python -m venv /tmp/pip && PYTHONPATH=$(echo /tmp/pip/lib/python3*/site-packages) "
            "python -m pip install -q --break-system-packages --no-index --find-links /wheels "
            f"'{torch_pin}' '{numpy_pin}' && rm -rf /tmp/pip"
        )
        _run([*_CHROOT_ENV, "chroot", str(rootfs), "sh", "-c", install])
        for wheel in wheels.glob("torch-*.whl"):
            wheel.unlink()
        python = ["ENV PIP_NO_INDEX=1", "ENV PIP_FIND_LINKS=/wheels", 'CMD ["python3"]']
        _import(rootfs, tags.python, python)
    docker("image", "inspect", tags.python)


def main() -> int:
    """``python -m tests.deploy._standin``: start an engine if needed and build the stand-ins
    (CI runs this in the background while the other tests run; the container tests then
    find the images, or wait for the build through its lock)."""
    from ._engine import engine

    problem = engine()
    if problem is not None:
        print(f"no Docker engine can run here: {problem}")
        return 0  # nothing to build for: the container tests will skip and say why
    t0 = time.monotonic()
    tags = stand_ins()
    print(f"stand-in images {tags.python} and {tags.nginx} ready in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
