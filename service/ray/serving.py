"""Ray Serve: the V2 REST server as a deployment, its replicas spread over a cluster.

Each replica runs the server's own application (:func:`service.server.in_process_app`: the
same data plane, control plane, batching, limits and error bodies as ``bitserve serve``) over
its own model repository, loaded on the replica's device when it starts (the GPU Ray gives it
with ``ray_actor_options={"num_gpus": 1}``, else the CPU); Serve's proxy hands it the HTTP
requests as ASGI calls, so Triton's binary tensor extension and every route work through it::

    from ray import serve
    from service.ray import deployment

    serve.run(deployment("models/", autoscaling_config={"min_replicas": 1,
                                                        "max_replicas": 8}).bind())

or from the command line (``key=value`` arguments of :func:`app`)::

    serve run service.ray.serving:app repository=models/ num_gpus=1

Inference goes REST's general route (Serve's proxy speaks ASGI, not to bitserve's HTTP
connection, so the express lane is not in the way), over the same data plane core
(``service.ticket``) as every transport.

Serve's options (``num_replicas``, ``autoscaling_config``, ``ray_actor_options``,
``max_ongoing_requests``, ...) pass through unchanged, from here or from a Serve config
file. gRPC is not served through Serve (its proxy speaks Serve's own gRPC protocol).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from ray import serve
from ray.serve.deployment import Application, Deployment

from service.settings import Settings

DEFAULT_MAX_ONGOING_REQUESTS = 128
"""Requests Serve lets one replica hold at once (Serve's default, 5, would starve the
dynamic batcher: a batch forms from the requests waiting together)."""

_SERVE_OPTIONS = ("num_replicas", "max_ongoing_requests", "max_queued_requests",
                  "autoscaling_config", "ray_actor_options", "health_check_period_s",
                  "health_check_timeout_s", "graceful_shutdown_timeout_s")  # fmt: skip


class _Replica:
    """One replica: the server's application over its own repository.

    ``settings`` (a class attribute set by :func:`deployment`) are the ``Settings`` fields
    that differ from the environment's ``BITSERVE_*`` (the replica's own environment).
    """

    settings: ClassVar[dict[str, Any]] = {}

    def __init__(self) -> None:
        from service.models.devices import set_torch_threads
        from service.ray.scorer import ray_cpus

        threads = ray_cpus()
        if threads is not None:
            set_torch_threads(threads, 1)
        self._settings = Settings(**self.settings)

    def __serve_build_asgi_app__(self) -> Any:
        from service.server import in_process_app

        return OneRequestId(in_process_app(self._settings))


class OneRequestId:
    """The application behind Serve's proxy, which adds ``X-Request-ID`` to every response
    (the client's, else its own, as the application sees it too): the application's own
    copy of the header is left out so that a client gets one, not two.

    Everything else (Serve's ``add_exception_handler``, ``state``) is the application's.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_one(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != _RID]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_one)


_RID = b"x-request-id"


def deployment(
    repository: str | Path | None = None,
    *,
    settings: Mapping[str, Any] | None = None,
    name: str = "bitserve",
    **options: Any,
) -> Deployment:
    """A Serve deployment of the V2 server; ``.bind()`` it and ``serve.run`` the result.

    Args:
        repository: the model repository folder (every node must see it at this path);
            None: the built-in demo model.
        settings: other server settings (``Settings`` fields, e.g. ``{"auth_token": ...}``);
            checked here.
        name: the deployment's name.
        options: Serve's deployment options, passed through (``num_replicas``,
            ``autoscaling_config``, ``ray_actor_options``, ...); ``max_ongoing_requests``
            defaults to 128.

    Raises:
        pydantic.ValidationError: invalid settings.
    """
    values = dict(settings or {})
    if repository is not None:
        values["model_repository"] = str(Path(repository).resolve())
    values.setdefault("grpc_port", 0)  # the replica serves HTTP through Serve's proxy only
    Settings(**values)  # fail here, not in every replica
    replica = type("Bitserve", (_Replica,), {"settings": values, "__module__": __name__})
    ingress = serve.ingress()(replica)
    opts = {"max_ongoing_requests": DEFAULT_MAX_ONGOING_REQUESTS, **options}
    made: Deployment = serve.deployment(ingress, name=name)  # type: ignore[assignment]
    return made.options(**opts)


def app(args: Mapping[str, Any]) -> Application:
    """The application builder of ``serve run service.ray.serving:app key=value ...``.

    Keys: ``repository``; Serve's ``num_replicas``, ``max_ongoing_requests``,
    ``max_queued_requests``, ``autoscaling_config``, ``ray_actor_options``, health-check and
    shutdown timeouts (values as JSON: ``autoscaling_config='{"max_replicas": 4}'``);
    ``num_gpus`` and ``num_cpus`` (per replica, into ``ray_actor_options``); ``name``; any
    other key is a server setting (``auth_token``, ``max_batch_bytes``, ...).
    """
    rest = dict(args)
    repository = rest.pop("repository", None)
    name = str(rest.pop("name", "bitserve"))
    options: dict[str, Any] = {}
    for key in _SERVE_OPTIONS:
        if key in rest:
            options[key] = _value(rest.pop(key))
    actor = dict(options.get("ray_actor_options") or {})
    for key in ("num_gpus", "num_cpus"):
        if key in rest:
            actor[key] = _value(rest.pop(key))
    if actor:
        options["ray_actor_options"] = actor
    return deployment(repository, settings=rest, name=name, **options).bind()


def _value(value: Any) -> Any:
    """A ``serve run`` argument (always a string there) as the JSON it spells, else as it is
    (``"2"`` -> 2, ``'{"min_replicas": 1}'`` -> a dict, ``"auto"`` -> ``"auto"``)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value
