"""Sizes in settings: ``--device-memory-budget`` and ``--cache-config`` (no torch here: the
``--workers`` supervisor reads settings without it)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "t": 10**12, "tb": 10**12,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30,
    "ti": 2**40, "tib": 2**40,
}  # fmt: skip
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z%]*)\s*$")


@dataclass(frozen=True)
class Size:
    """One budget: a number of bytes, or a fraction of the device's memory."""

    nbytes: int | None = None
    fraction: float | None = None

    def of(self, total: int) -> int:
        """The bytes of this budget on a device of ``total`` bytes."""
        if self.nbytes is not None:
            return self.nbytes
        assert self.fraction is not None
        return int(total * self.fraction)


def parse_size(text: str) -> Size:
    """``"8GiB"``, ``"500MB"``, ``"1234"`` (bytes) or ``"75%"``.

    Raises:
        ValueError: anything else, or a percentage outside (0, 100].
    """
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"{text.strip()[:64]!r} is not a size (e.g. 8GiB, 500MB, 75%)")
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit == "%":
        if not 0 < number <= 100:
            raise ValueError(f"{text.strip()!r}: a percentage must be in (0, 100]")
        return Size(fraction=number / 100)
    if unit not in _UNITS:
        raise ValueError(f"{text.strip()[:64]!r}: unknown unit {unit!r} (B, KB, MB, GB, KiB, ...)")
    if number <= 0:
        raise ValueError(f"{text.strip()!r}: a budget must be more than 0 bytes")
    return Size(nbytes=int(number * _UNITS[unit]))


def parse_budget(text: str) -> dict[str, Size]:
    """The ``--device-memory-budget`` setting: one size for every device, or a comma list of
    ``device=size`` (``cpu``, ``cuda``, ``cuda:N``), with an optional bare size for the others.

    Returns:
        Device -> size; the key ``""`` applies to every device not named.

    Raises:
        ValueError: naming the part that is wrong.
    """
    out: dict[str, Size] = {}
    for part in text.split(","):
        if not part.strip():
            raise ValueError(f"{text[:64]!r}: an empty item")
        device, _, size = part.rpartition("=")
        device = device.strip().lower()
        if device and not re.fullmatch(r"cpu|cuda(:[0-9]+)?", device):
            raise ValueError(f"{part.strip()[:64]!r}: the device must be cpu, cuda or cuda:N")
        if device in out:
            raise ValueError(f"{part.strip()[:64]!r}: device {device or '(all)'} given twice")
        out[device] = parse_size(size)
    return out


def parse_cache_config(text: str) -> int:
    """``--cache-config local,size=BYTES`` (Triton's syntax; a unit may follow the number):
    the response cache's size in bytes.

    Raises:
        ValueError: another cache than ``local``, no ``size``, or an unknown key.
    """
    kind, *items = [p.strip() for p in text.split(",")]
    if kind != "local":
        raise ValueError(f"cache_config {text[:64]!r}: only the 'local' cache exists")
    size: int | None = None
    for item in items:
        key, _, value = item.partition("=")
        if key.strip() != "size" or not value:
            raise ValueError(f"cache_config {text[:64]!r}: unknown item {item[:32]!r} (size=BYTES)")
        parsed = parse_size(value)
        if parsed.nbytes is None:
            raise ValueError(f"cache_config {text[:64]!r}: size takes bytes, not a percentage")
        size = parsed.nbytes
    if size is None:
        raise ValueError(f"cache_config {text[:64]!r}: no size (local,size=BYTES)")
    return size
