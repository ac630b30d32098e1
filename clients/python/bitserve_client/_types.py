"""Result and input types shared by the sync and async clients."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np

# Anything np.asarray accepts, plus torch tensors (converted with .detach().cpu().numpy()).
ArrayLike: TypeAlias = Any
# One input per name, or a single array for a model with exactly one input.
Inputs: TypeAlias = Mapping[str, ArrayLike] | ArrayLike

_NO_HEADERS: Mapping[str, str] = {}


class _Outputs(Mapping[str, np.ndarray[Any, Any]]):
    """A read-only mapping of output name -> array, with tritonclient's ``as_numpy``."""

    __slots__ = ("_outputs", "model_name")

    def __init__(self, outputs: dict[str, np.ndarray[Any, Any]], model_name: str) -> None:
        self._outputs = outputs
        self.model_name = model_name

    def __getitem__(self, name: str) -> np.ndarray[Any, Any]:
        try:
            return self._outputs[name]
        except KeyError:
            raise KeyError(
                f"no output {name!r} in the result of model {self.model_name!r}; "
                f"outputs: {sorted(self._outputs)}"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._outputs)

    def __len__(self) -> int:
        return len(self._outputs)

    def as_numpy(self, name: str) -> np.ndarray[Any, Any] | None:
        """The output ``name`` as a NumPy array, or None when there is no such output.

        The same as ``result[name]`` except for a missing name (tritonclient's behaviour).
        """
        return self._outputs.get(name)


class InferResult(_Outputs):
    """The outputs of one inference: a read-only mapping of output name -> NumPy array.

    Binary outputs are ``np.frombuffer`` views over the response body (no copy), so they are
    read-only; call ``.copy()`` on one to modify it. When the request was a single item
    without the batch dimension, the outputs come back without it too. ``result[name]``
    raises ``KeyError`` naming the outputs there are; ``result.as_numpy(name)`` returns None.

    Attributes:
        model_name: the model that answered.
        model_version: its version, or None when the server did not say.
        id: the response's ``id`` (the request's ``request_id``), or None.
        parameters: the response's ``parameters`` object (bitserve reports ``batch_size`` and
            ``batch_requests`` of the batch the request ran in).
        headers: the HTTP response headers (case-insensitive).
    """

    __slots__ = ("_entries", "headers", "id", "model_version", "parameters")

    def __init__(
        self,
        outputs: dict[str, np.ndarray[Any, Any]],
        *,
        model_name: str,
        model_version: str | None = None,
        id: str | None = None,
        parameters: dict[str, Any] | None = None,
        entries: Mapping[str, Mapping[str, Any]] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(outputs, model_name)
        self.model_version = model_version
        self.id = id
        self.parameters: dict[str, Any] = dict(parameters or {})
        self._entries = dict(entries or {})
        self.headers: Mapping[str, str] = headers if headers is not None else _NO_HEADERS

    @property
    def request_id(self) -> str | None:
        """The response's ``X-Request-ID`` header (the server's log names the request by it)."""
        return self.headers.get("X-Request-ID") or self.headers.get("x-request-id")

    def get_output(self, name: str) -> dict[str, Any] | None:
        """The output's entry in the response header, or None when there is no such output.

        Returns:
            ``{"name", "datatype", "shape", "parameters"}`` as the server sent them (the shape
            with the batch dimension, also for a single item), like tritonclient's.
        """
        entry = self._entries.get(name)
        return None if entry is None else dict(entry)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {v.dtype}{list(v.shape)}" for k, v in self._outputs.items())
        return (
            f"InferResult(model_name={self.model_name!r}, model_version={self.model_version!r}, "
            f"id={self.id!r}, outputs={{{shapes}}})"
        )


class BulkResult(_Outputs):
    """The outputs of ``infer_many``: output name -> all rows, in input order.

    With ``out=`` the arrays are read-only memmaps of the ``.npy`` files; otherwise they are
    in memory.

    Attributes:
        model_name: the model.
        rows: how many rows have their results (all of them unless the run failed part way:
            see :class:`~bitserve_client.BulkInferenceError`).
        paths: output name -> the ``.npy`` file it was written to (empty without ``out=``).
    """

    __slots__ = ("paths", "rows")

    def __init__(
        self,
        outputs: dict[str, np.ndarray[Any, Any]],
        *,
        model_name: str,
        rows: int,
        paths: Mapping[str, Path] | None = None,
    ) -> None:
        super().__init__(outputs, model_name)
        self.rows = rows
        self.paths: dict[str, Path] = dict(paths or {})

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {v.dtype}{list(v.shape)}" for k, v in self._outputs.items())
        where = f", paths={ {k: str(v) for k, v in self.paths.items()} }" if self.paths else ""
        return (
            f"BulkResult(model_name={self.model_name!r}, rows={self.rows}, "
            f"outputs={{{shapes}}}{where})"
        )
