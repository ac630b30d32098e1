"""Result and input types shared by the sync and async clients."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, TypeAlias

import numpy as np

# Anything np.asarray accepts, plus torch tensors (converted with .detach().cpu().numpy()).
ArrayLike: TypeAlias = Any
# One input per name, or a single array for a model with exactly one input.
Inputs: TypeAlias = Mapping[str, ArrayLike] | ArrayLike


class InferResult(Mapping[str, np.ndarray[Any, Any]]):
    """The outputs of one inference: a read-only mapping of output name -> NumPy array.

    Binary outputs are ``np.frombuffer`` views over the response body (no copy), so they are
    read-only; call ``.copy()`` on one to modify it. When the request was a single item
    without the batch dimension, the outputs come back without it too.

    Attributes:
        model_name: the model that answered.
        model_version: its version, or None when the server did not say.
        id: the request id echoed by the server, or None.
        parameters: the response's ``parameters`` object (bitserve reports ``batch_size`` and
            ``batch_requests`` of the batch the request ran in).
    """

    __slots__ = ("_outputs", "id", "model_name", "model_version", "parameters")

    def __init__(
        self,
        outputs: dict[str, np.ndarray[Any, Any]],
        *,
        model_name: str,
        model_version: str | None = None,
        id: str | None = None,
        parameters: dict[str, Any] | None = None,
    ) -> None:
        self._outputs = outputs
        self.model_name = model_name
        self.model_version = model_version
        self.id = id
        self.parameters: dict[str, Any] = dict(parameters or {})

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

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {v.dtype}{list(v.shape)}" for k, v in self._outputs.items())
        return (
            f"InferResult(model_name={self.model_name!r}, model_version={self.model_version!r}, "
            f"id={self.id!r}, outputs={{{shapes}}})"
        )
