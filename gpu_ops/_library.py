"""The ``bitserve`` operator library: ops defined with :class:`torch.library.Library`.

:func:`torch.library.custom_op` would do the same registrations, but it wraps every call of
its op in Python layers (argument and aliasing checks, a frame that disables dynamo): about
30 µs a call measured here on a one-byte tensor, against a few µs for an op whose kernels the
dispatcher calls directly. A server answering small batches calls two ops per batch, so the
ops are defined with the lower-level API: a schema, one kernel per dispatch key, a fake (meta)
kernel through :func:`torch.library.register_fake`, autograd through
:func:`torch.library.register_autograd`. ``torch.library.opcheck``, ``torch.compile`` and
``torch.export`` treat them like custom ops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["Op"]

LIBRARY = torch.library.Library("bitserve", "DEF")  # type: ignore[no-untyped-call]
# Where a kernel registered for a device goes; None: the kernel of every other device.
_KEYS = {"cpu": "CPU", "cuda": "CUDA", None: "CompositeExplicitAutograd"}
F = Callable[..., Any]
K = TypeVar("K", bound=F)


class Op:
    """One ``torch.ops.bitserve`` operator: call it like the op.

    Args:
        schema: its schema without the namespace, e.g.
            ``"packbits(Tensor x, SymInt dim, str bitorder) -> Tensor"``.

    Attributes:
        overload: ``torch.ops.bitserve.<name>.default`` (what ``opcheck`` takes).
        kernels: the kernel registered for each device (None: every other device).
    """

    def __init__(self, schema: str) -> None:
        LIBRARY.define(schema)  # type: ignore[no-untyped-call]
        self.name = schema.split("(", 1)[0]
        self.qualname = f"bitserve::{self.name}"
        self.overload: torch._ops.OpOverload = getattr(torch.ops.bitserve, self.name).default
        self.kernels: dict[str | None, F] = {}

    def __call__(self, *args: Any) -> Any:
        return self.overload(*args)

    def register_kernel(self, device: str | None) -> Callable[[K], K]:
        """Decorator: the kernel of ``device`` (``"cpu"``, ``"cuda"``; None: every other)."""

        def register(fn: K) -> K:
            LIBRARY.impl(self.name, fn, _KEYS[device])  # type: ignore[no-untyped-call]
            self.kernels[device] = fn
            return fn

        return register

    def register_fake(self, fn: F) -> F:
        """Decorator: the fake kernel (shapes and dtypes only, for compile and export)."""
        torch.library.register_fake(self.qualname, fn, lib=LIBRARY)
        return fn

    def register_autograd(self, backward: F, *, setup_context: F) -> None:
        """The op's derivative, as :func:`torch.library.register_autograd` takes it."""
        torch.library.register_autograd(
            self.qualname, backward, setup_context=setup_context, lib=LIBRARY
        )
