"""Server settings: ``BITSERVE_*`` environment variables, each also a ``bitserve serve`` flag.

Built once in ``main()`` (or by a test) and passed to ``create_app``; never a module global.
Precedence: command-line flag > environment variable > default.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


class Settings(BaseSettings):
    """Everything ``bitserve serve`` can be told; see the README's settings table."""

    model_config = SettingsConfigDict(
        env_prefix="BITSERVE_",
        use_attribute_docstrings=True,
        extra="forbid",
        validate_default=True,
    )

    host: str = "127.0.0.1"
    """Interface to listen on (``0.0.0.0`` for all; the default only accepts local clients)."""

    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port to listen on (0 picks a free one)."""

    model_repository: Path | None = None
    """Model repository folder (one sub-folder per model); unset serves the built-in demo."""

    device: str = "auto"
    """Device for models whose config says ``auto``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""

    max_body_bytes: int = Field(default=64 << 20, gt=0)
    """Largest request body accepted, checked before reading and again after decompression."""

    max_json_bytes: int = Field(default=16 << 20, gt=0)
    """Largest JSON part of an inference request (the whole body without
    ``Inference-Header-Content-Length``, else the header's first bytes), checked before it is
    parsed: JSON tensors cost tens of bytes of memory per element, so big tensors belong in
    the binary tensor data extension. Larger is answered 413."""

    body_timeout_s: float = Field(default=60.0, gt=0)
    """Most seconds a request body may take to arrive, from the first read to the last byte;
    a slower upload is answered 408 and its connection closed (a client trickling bytes holds
    only what it has sent, and only this long)."""

    max_header_bytes: int = Field(default=64 << 10, ge=1024)
    """Largest HTTP request head (request line and headers); enforced by the h11 parser."""

    max_headers: int = Field(default=100, ge=8)
    """Most request headers accepted; more are answered 431 (h11 counts only their bytes)."""

    response_compression: Literal["auto", "always", "never"] = "auto"
    """Compress inference responses when the client's ``Accept-Encoding`` allows it:
    ``auto`` compresses JSON bodies and binary bodies that a trial on a prefix shows to shrink
    (float tensors rarely do), ``always`` every body of 1 KiB or more, ``never`` none."""

    auth_token: SecretStr | None = None
    """If set, every endpoint except health needs ``Authorization: Bearer <token>`` (prefer
    the environment variable: a flag is visible to other users in ``ps``)."""

    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    """Logging level of the server and of uvicorn."""

    access_log: bool = True
    """Log one line per request (method, path, status, duration, request id)."""

    graceful_shutdown_s: int = Field(default=30, ge=0)
    """On SIGTERM, how long in-flight requests may take to finish before the server exits."""

    warmup: bool = True
    """Run one batch through every model at load, so the first request is not slow."""

    http: Literal["auto", "h11", "httptools"] = "h11"
    """HTTP/1.1 parser; ``h11`` enforces ``max_header_bytes``, ``httptools`` is faster."""

    limit_concurrency: int | None = Field(default=None, gt=0)
    """Connections plus tasks above which new requests get a 503 (unset: no limit). That 503
    comes from uvicorn itself before the application runs: its body is the plain text
    ``Service Unavailable`` (not ``{"error": ...}``) and it carries no ``Retry-After``, so
    clients should treat any 503 as retryable with their own backoff."""

    timeout_keep_alive_s: int = Field(default=5, ge=0)
    """Seconds an idle keep-alive connection stays open."""

    workers: int | Literal["auto"] = "auto"
    """Server processes sharing the port, each with its own copy of the models: an integer
    >= 1, or ``auto`` (from the cores and GPUs; the start-up log says what it chose). With a
    GPU, worker i puts ``auto``-device models on ``cuda:(i mod GPUs)``. ``1`` runs the server
    in this process alone."""

    @field_validator("model_repository", "auth_token", mode="before")
    @classmethod
    def _empty_is_unset(cls, v: object) -> object:
        # `BITSERVE_AUTH_TOKEN=` in a compose file means "no token", not an empty token.
        return None if v == "" else v

    @field_validator("workers", mode="before")
    @classmethod
    def _workers_syntax(cls, v: object) -> int | str:
        # One message for every wrong form (pydantic's own would list both union branches).
        text = str(v).strip()
        if isinstance(v, bool) or not (text == "auto" or text.lstrip("+-").isdigit()):
            raise ValueError(f"workers must be an integer >= 1 or 'auto', got {text[:64]!r}")
        if text == "auto":
            return "auto"
        if int(text) < 1:
            raise ValueError(f"workers must be an integer >= 1 or 'auto', got {int(text)}")
        return int(text)

    @field_validator("device")
    @classmethod
    def _device_syntax(cls, v: str) -> str:
        if not _DEVICE.match(v):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {v!r}")
        return v

    @model_validator(mode="after")
    def _check_host_resources(self) -> Settings:
        if self.model_repository is not None and not self.model_repository.is_dir():
            raise ValueError(f"model_repository {str(self.model_repository)!r} is not a folder")
        if self.device.startswith("cuda"):
            import torch  # only here: settings stay importable and cheap otherwise

            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            index = int(self.device.split(":", 1)[1]) if ":" in self.device else 0
            if index >= count:
                raise ValueError(
                    f"device {self.device!r} requested but this host has {count} CUDA "
                    "device(s); use device='auto' or 'cpu'"
                )
        return self
