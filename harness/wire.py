"""Request bodies and response decoders for each wire format the peers speak.

Bodies are built once per pool item before the load starts, so the load generator only sends
bytes and decodes answers. Formats:

- ``packed``: V2 with Triton's binary extension, input UINT8 (1, N, ceil(B/8)) packed bits,
  binary FP32 output (bitserve's native form);
- ``bool``: V2 binary extension, input BOOL (1, N, B), one byte per feature, binary output;
- ``json``: plain V2 JSON, BOOL data as ``true``/``false`` (what MLServer's and KServe's own
  codecs produce), JSON output;
- ``v2raw``: Triton's raw binary form for single-input models
  (``Inference-Header-Content-Length: 0``): the body is the packed UINT8 bytes alone, with no
  JSON header; binary V2 answer;
- ``raw``: the hand-written baseline's body, ``np.packbits`` bytes; the answer is raw
  little-endian float32 bytes;
- ``grpc``: a serialized ``inference.ModelInferRequest`` (Triton's gRPC protocol) with the
  packed UINT8 (1, N, ceil(B/8)) in ``raw_input_contents``; the answer is a
  ``ModelInferResponse`` with the float32 output in ``raw_output_contents``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from harness.workload import INPUT_NAME, N_COARSE, N_FUNCTIONS, OUTPUT_NAME

GRPC_MODEL = "demo"
"""The model gRPC requests name (bitserve's built-in demo; gRPC puts the name in the message)."""
GRPC_METHOD = "/inference.GRPCInferenceService/ModelInfer"

Format = Literal["packed", "v2raw", "bool", "json", "raw", "grpc"]
FORMATS: tuple[Format, ...] = ("packed", "v2raw", "bool", "json", "raw", "grpc")


@dataclass(frozen=True)
class Body:
    """One encoded request: its bytes and the headers that go with them."""

    content: bytes
    headers: dict[str, str]


def _binary(datatype: str, array: np.ndarray[Any, Any], params: dict[str, Any]) -> Body:
    data = np.ascontiguousarray(array).tobytes()
    header: dict[str, Any] = {
        "inputs": [
            {
                "name": INPUT_NAME,
                "datatype": datatype,
                "shape": list(array.shape),
                "parameters": {"binary_data_size": len(data)},
            }
        ],
        "outputs": [{"name": OUTPUT_NAME, "parameters": {"binary_data": True}}],
    }
    if params:
        header["parameters"] = params
    head = json.dumps(header, separators=(",", ":")).encode()
    return Body(
        head + data,
        {
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(len(head)),
        },
    )


def encode(
    fmt: Format, item: np.ndarray[Any, Any], parameters: dict[str, Any] | None = None
) -> Body:
    """The request body carrying one (N, B) bool item in format ``fmt``.

    ``parameters`` become the V2 request-level ``parameters`` (e.g. ``{"timeout": us}``);
    the ``raw`` format has nowhere to put them.
    """
    item = np.asarray(item, dtype=np.bool_)[None]
    params = dict(parameters or {})
    if fmt == "packed":
        return _binary("UINT8", np.packbits(item, axis=-1, bitorder="big"), params)
    if fmt == "bool":
        return _binary("BOOL", item, params)
    if fmt == "json":
        # json.dumps of a list of Python bools writes true/false, as the V2 spec asks for BOOL.
        doc: dict[str, Any] = {
            "inputs": [
                {
                    "name": INPUT_NAME,
                    "datatype": "BOOL",
                    "shape": list(item.shape),
                    "data": item.ravel().tolist(),
                }
            ],
            "outputs": [{"name": OUTPUT_NAME}],
        }
        if params:
            doc["parameters"] = params
        body = json.dumps(doc, separators=(",", ":")).encode()
        return Body(body, {"Content-Type": "application/json"})
    if fmt == "grpc":
        from service.grpc.proto import grpc_service_pb2 as pb

        packed = np.packbits(item, axis=-1, bitorder="big")
        msg = pb.ModelInferRequest(model_name=GRPC_MODEL, raw_input_contents=[packed.tobytes()])
        msg.inputs.add(name=INPUT_NAME, datatype="UINT8", shape=list(packed.shape))
        msg.outputs.add(name=OUTPUT_NAME)
        for key, value in params.items():
            msg.parameters[key].int64_param = int(value)
        return Body(msg.SerializeToString(), {})
    if fmt in ("raw", "v2raw"):
        if params:
            raise ValueError(f"the {fmt} format carries no parameters")
        packed = np.packbits(item, axis=-1, bitorder="big")
        headers = {"Content-Type": "application/octet-stream"}
        if fmt == "v2raw":
            headers["Inference-Header-Content-Length"] = "0"
        return Body(packed.tobytes(), headers)
    raise ValueError(f"unknown format {fmt!r}")


def decode(fmt: Format, headers: Mapping[str, str], content: bytes) -> np.ndarray[Any, Any]:
    """The (1, N, A) float32 answer in a 200 response of format ``fmt``.

    Raises:
        ValueError: the response does not carry the expected output.
    """
    shape = (1, N_FUNCTIONS, N_COARSE)
    if fmt == "raw":
        return np.frombuffer(content, dtype="<f4").reshape(shape)
    if fmt == "grpc":
        from service.grpc.proto import grpc_service_pb2 as pb

        response = pb.ModelInferResponse.FromString(content)
        for i, out in enumerate(response.outputs):
            if out.name == OUTPUT_NAME:
                if out.datatype != "FP32":
                    raise ValueError(f"output datatype {out.datatype}, expected FP32")
                data = np.frombuffer(response.raw_output_contents[i], dtype="<f4")
                return data.reshape(list(out.shape))
        raise ValueError(f"no output {OUTPUT_NAME!r} in the response")
    hlen = headers.get("inference-header-content-length")
    if hlen is not None:
        n = int(hlen)
        doc = json.loads(content[:n])
        offset = n
    else:
        doc = json.loads(content)
        offset = len(content)
    for out in doc["outputs"]:
        if out["name"] != OUTPUT_NAME:
            size = int((out.get("parameters") or {}).get("binary_data_size", 0))
            offset += size
            continue
        if out["datatype"] != "FP32":
            raise ValueError(f"output datatype {out['datatype']}, expected FP32")
        size = (out.get("parameters") or {}).get("binary_data_size")
        if size is not None and hlen is not None:
            data = np.frombuffer(content, dtype="<f4", count=int(size) // 4, offset=offset)
        else:
            data = np.asarray(out["data"], dtype=np.float32)
        return data.reshape(out["shape"])
    raise ValueError(f"no output {OUTPUT_NAME!r} in {list(doc)}")
