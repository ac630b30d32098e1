"""Server settings: ``BITSERVE_*`` environment variables, each also a ``bitserve serve`` flag.

Built once in ``main()`` (or by a test) and passed to ``create_app``; never a module global.
Precedence: command-line flag > environment variable > default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.models.config import DEFAULT_MAX_BATCH_BYTES, DEFAULT_MAX_OPERATOR_BYTES
from service.models.devices import parse_device, resolve_device
from service.residency.sizes import Size, parse_budget, parse_cache_config


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

    grpc_port: int = Field(default=8001, ge=0, le=65535)
    """TCP port of the gRPC service (Triton's ``inference.GRPCInferenceService`` and
    ``grpc.health.v1.Health``), on the same host as HTTP; 0 turns gRPC off."""

    grpc_keepalive_time_ms: int = Field(default=7_200_000, gt=0)
    """gRPC keepalive: how often the server pings a connection to check it is alive
    (Triton's default: 2 hours)."""

    grpc_keepalive_timeout_ms: int = Field(default=20_000, gt=0)
    """gRPC keepalive: how long the server waits for a ping's answer before it closes the
    connection."""

    grpc_keepalive_permit_without_calls: bool = False
    """gRPC keepalive: allow pings (the server's and the clients') on connections with no
    call in flight."""

    grpc_http2_max_pings_without_data: int = Field(default=2, ge=0)
    """gRPC keepalive: pings the server sends while no data flow before it waits for some
    (0: no limit)."""

    grpc_http2_min_recv_ping_interval_without_data_ms: int = Field(default=300_000, ge=0)
    """gRPC keepalive: the shortest interval between a client's pings while no data flow;
    each faster ping is a strike."""

    grpc_http2_max_ping_strikes: int = Field(default=2, ge=0)
    """gRPC keepalive: strikes after which the server closes the connection (GOAWAY
    ``too_many_pings``); 0: never."""

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

    max_operator_bytes: int = Field(default=DEFAULT_MAX_OPERATOR_BYTES, gt=0)
    """Most bytes one model's response operator may take on its device once built (its band
    of weights, window starts and row order). A bigger one, whether from a wide response, a
    huge ``support`` or a fine grid too coarse for it, is refused at load with its size,
    before anything is built; ``bitserve check-repo --max-operator-bytes`` applies the same
    limit. The default, 1 GiB, is about 25 times the demo's operator."""

    max_batch_bytes: int = Field(default=DEFAULT_MAX_BATCH_BYTES, gt=0)
    """Most bytes each input buffer of a model may take on its device: ``max(max_batch_size,
    1)`` items of the input's shape, in the dtype it is computed in, allocated whole at load.
    A bigger one is refused at load with its size (a load's config override of
    ``max_batch_size`` could otherwise ask for more memory than the host has); ``bitserve
    check-repo --max-batch-bytes`` applies the same limit. The default, 4 GiB, is 64 times
    the demo's."""

    max_inflight_bytes: int = Field(default=256 << 20, ge=0)
    """Most bytes of inference request bodies held at once (per worker process), over all
    connections, while they arrive and are computed (as received, plus the inflated copy of a
    compressed body); a request whose ``Content-Length`` would pass it is answered 503 with
    ``Retry-After`` before its body is read, a chunked or compressed one when it would (0: no
    limit). Bounds the memory a crowd of slow or large uploads can take."""

    max_header_bytes: int = Field(default=64 << 10, ge=1024)
    """Largest HTTP request head (request line and headers); larger is answered 431."""

    max_headers: int = Field(default=100, ge=8)
    """Most request headers accepted; more are answered 431."""

    response_compression: Literal["auto", "always", "never"] = "auto"
    """Compress inference responses when the client's ``Accept-Encoding`` allows it:
    ``auto`` compresses JSON bodies and binary bodies that a trial on a prefix shows to shrink
    (float tensors rarely do), ``always`` every body of 1 KiB or more, ``never`` none."""

    allow_client_shm: bool = False
    """Let clients register system shared memory regions (Triton's extension: tensors pass
    through POSIX shared memory on this host instead of request bodies). Off by default, as
    in Triton since 2.55: a client that can reach the API could then read and write the
    POSIX shared memory objects (``/dev/shm``) that the server's user can open."""

    max_shm_regions: int = Field(default=64, ge=1, le=4096)
    """Most system shared memory regions registered at once (with ``allow_client_shm``)."""

    auth_token: SecretStr | None = None
    """If set, every endpoint except health needs ``Authorization: Bearer <token>`` (prefer
    the environment variable: a flag is visible to other users in ``ps``)."""

    @property
    def token(self) -> str | None:
        """``auth_token``'s value, or None when the server takes every client."""
        return self.auth_token.get_secret_value() if self.auth_token else None

    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    """Logging level of the server and of uvicorn."""

    access_log: bool = True
    """Log one line per request (method, path, status, duration, request id)."""

    graceful_shutdown_s: int = Field(default=30, ge=0)
    """On SIGTERM, how long in-flight requests may take to finish before the server exits."""

    warmup: bool = True
    """Run the full batch of every model's dry run twice at load, so the first request is
    not slow (the dry run itself, at batch 1 and at max_batch_size, always runs)."""

    strict_readiness: bool = True
    """/v2/health/ready answers 200 only when every model is READY (Triton's default).
    False: 200 once the server is live and every model is READY or has failed to load, so
    one bad model does not take a healthy server out of a load balancer."""

    limit_concurrency: int | None = Field(default=None, gt=0)
    """Requests handled at once (per worker process) above which new ones are answered 503
    with ``Retry-After`` (unset: no limit; the models' queues and ``max_inflight_bytes`` are
    the finer bounds)."""

    max_connections: int = Field(default=1000, gt=0)
    """Open connections per worker process. A new connection beyond it closes, with a 503 and
    ``Retry-After``, the connection idle longest with nothing received (never one holding a
    request, part of one, or unread bytes); when none is idle the new one gets the 503.
    Lowered at start to fit the process's file-descriptor limit (docs/http.md)."""

    head_timeout_s: float = Field(default=10.0, gt=0)
    """Most seconds a request head (request line and headers) may take to arrive, from its
    first byte or from the connection's opening; slower clients get a 408 and are closed (one
    that sent no byte is closed without an answer). The unread rest of a body answered early
    (404, 503 from the headers) is skipped for this long at most."""

    timeout_keep_alive_s: int = Field(default=5, ge=0)
    """Seconds an idle keep-alive connection stays open."""

    device_memory_budget: str | None = None
    """Bytes of each device's memory the resident model versions may hold (``8GiB``,
    ``500MB``, ``75%`` of each device's memory, or per device: ``cpu=4GiB,cuda:0=20GiB``; the
    host's memory for ``device = "cpu"`` models). Past it the least recently used versions
    that hold no request are evicted, and load again on their next request (see
    docs/residency.md). Under ``--workers`` each worker keeps its share (the budget divided
    by the workers on the device). Unset: every version stays resident."""

    cache_config: str | None = None
    """The response cache, as Triton's ``--cache-config``: ``local,size=BYTES`` (units as
    above: ``local,size=256MiB``). Models that say ``[response_cache] enable = true`` are
    answered from it for a request equal to one answered before. Each worker process keeps
    its own. Unset: no cache."""

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
        parse_device(v)
        return v

    @field_validator("device_memory_budget", "cache_config", mode="before")
    @classmethod
    def _blank_is_unset(cls, v: object) -> object:
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("device_memory_budget")
    @classmethod
    def _budget_syntax(cls, v: str | None) -> str | None:
        if v is not None:
            parse_budget(v)
        return v

    @field_validator("cache_config")
    @classmethod
    def _cache_syntax(cls, v: str | None) -> str | None:
        if v is not None:
            parse_cache_config(v)
        return v

    @property
    def budget(self) -> dict[str, Size] | None:
        """``device_memory_budget`` parsed; None: no budget."""
        return (
            None if self.device_memory_budget is None else parse_budget(self.device_memory_budget)
        )

    @property
    def cache_bytes(self) -> int:
        """The response cache's size in bytes from ``cache_config``; 0: no cache."""
        return 0 if self.cache_config is None else parse_cache_config(self.cache_config)

    @model_validator(mode="after")
    def _check_host_resources(self) -> Settings:
        if self.grpc_port and self.grpc_port == self.port:
            raise ValueError(f"grpc_port and port are both {self.port}; give gRPC its own port")
        if self.model_repository is not None and not self.model_repository.is_dir():
            raise ValueError(f"model_repository {str(self.model_repository)!r} is not a folder")
        if parse_device(self.device)[0] == "cuda":
            try:
                resolve_device(self.device)  # the one check of a CUDA device's index
            except ValueError as e:
                raise ValueError(f"{e}; use device='auto' or 'cpu'") from None
        return self
