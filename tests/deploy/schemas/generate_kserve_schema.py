"""Generate ``kserve.schema.json`` from the KServe Python SDK's OpenAPI models.

KServe publishes its CRDs (with their openAPIV3Schema) only in its source repository and Helm
charts, none of which a package registry serves. Its Python SDK (PyPI ``kserve``) carries the
same API as generated OpenAPI model classes: each ``kserve/models/*.py`` class has an
``openapi_types`` map (attribute -> type), an ``attribute_map`` (attribute -> JSON key) and
setters that raise for required fields. This script reads those files as text (the SDK is never
imported: it would pull pandas, grpc and a second FastAPI into the test set-up) and writes a
JSON Schema (draft 2020-12):

* every KServe object is ``additionalProperties: false``, so a misspelt key fails;
* required fields come from the setters' ``must not be `None``` checks;
* Kubernetes types (``V1Container``, ``V1ResourceRequirements``, ...) are ``$ref``s into the
  Kubernetes definitions that the PyPI package ``kubernetes-validate`` ships
  (``https://kubernetes.io/api/_definitions.json``), which the tests register beside this
  schema;
* ``ServingRuntime``/``InferenceService`` pin their ``apiVersion`` and ``kind``.

Usage (what produced the committed file)::

    pip download --no-deps kserve==0.21.0 && unzip kserve-0.21.0-*.whl 'kserve/models/*'
    python tests/deploy/schemas/generate_kserve_schema.py kserve/models \
        tests/deploy/schemas/kserve.schema.json
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path
from typing import Any

K8S_DEFS = "https://kubernetes.io/api/_definitions.json"
# The Kubernetes version whose definitions resolve the Kubernetes types (kubernetes-validate).
K8S_VERSION = "1.37.0"
ROOTS = {
    "V1alpha1ServingRuntime": ("serving.kserve.io/v1alpha1", "ServingRuntime"),
    "V1alpha1ClusterServingRuntime": ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"),
    "V1beta1InferenceService": ("serving.kserve.io/v1beta1", "InferenceService"),
}
_REQUIRED = re.compile(r"Invalid value for `(\w+)`, must not be `None`")
_PRIMITIVES: dict[str, dict[str, Any]] = {
    "str": {"type": "string"},
    "int": {"type": "integer"},
    "float": {"type": "number"},
    "bool": {"type": "boolean"},
    "object": {},
    "datetime": {"type": "string"},
    "date": {"type": "string"},
}


def _dict_literal(tree: ast.ClassDef, name: str) -> dict[str, str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            assert isinstance(value, dict)
            return value
    raise ValueError(f"class {tree.name} has no {name}")


def read_models(models_dir: Path) -> dict[str, tuple[dict[str, str], dict[str, str], set[str]]]:
    """Return ``{class name: (openapi_types, attribute_map, required attribute names)}``."""
    out = {}
    for path in sorted(models_dir.glob("*.py")):
        source = path.read_text()
        for node in ast.parse(source).body:
            if isinstance(node, ast.ClassDef) and any(
                isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "openapi_types" for t in n.targets)
                for n in node.body
            ):
                out[node.name] = (
                    _dict_literal(node, "openapi_types"),
                    _dict_literal(node, "attribute_map"),
                    set(_REQUIRED.findall(ast.get_source_segment(source, node) or "")),
                )
    return out


def k8s_class_index(definitions: dict[str, Any]) -> dict[str, str]:
    """Map Kubernetes Python client class names (``V1Container``) to definition keys."""
    index: dict[str, list[str]] = {}
    for key in definitions:
        m = re.match(
            r"^io\.k8s\.(?:api\.[\w.]+|apimachinery\.pkg\.apis\.meta)\.(v\d\w*)\.(\w+)$", key
        )
        if m:
            name = m.group(1).capitalize() + m.group(2)
            index.setdefault(name, []).append(key)
    resolved = {"ResourceQuantity": "io.k8s.apimachinery.pkg.api.resource.Quantity"}
    for key in definitions:
        # Fully qualified client names: io.k8s.api.apps.v1.X -> K8sIoApiAppsV1X.
        parts = key.split(".")
        if len(parts) > 2:
            parts[0], parts[1] = parts[1], parts[0]
            resolved["".join(p[:1].upper() + p[1:] for p in parts)] = key
    for name, keys in index.items():
        # The client names clashing kinds after the core group; prefer core, then meta.
        keys.sort(key=lambda k: (not k.startswith("io.k8s.api.core."), "apimachinery" not in k))
        resolved[name] = keys[0]
    return resolved


def build(models_dir: Path, k8s_definitions: dict[str, Any]) -> dict[str, Any]:
    """Build the schema document."""
    models = read_models(models_dir)
    k8s = k8s_class_index(k8s_definitions)
    used_k8s: set[str] = set()
    unresolved: set[str] = set()

    def type_schema(t: str) -> dict[str, Any]:
        t = t.strip()
        if t in _PRIMITIVES:
            return dict(_PRIMITIVES[t])
        if m := re.fullmatch(r"list\[(.+)\]", t):
            return {"type": "array", "items": type_schema(m.group(1))}
        if m := re.fullmatch(r"dict\(str, (.+)\)", t):
            return {"type": "object", "additionalProperties": type_schema(m.group(1))}
        if t in models:
            return {"$ref": f"#/$defs/{t}"}
        if t in k8s:
            used_k8s.add(t)
            return {"$ref": f"{K8S_DEFS}#/$defs/{k8s[t]}"}
        # A few types are referred to but shipped by neither package (e.g. KServe's
        # V1beta1MetricQuantity): accepted as anything, and listed in the schema.
        unresolved.add(t)
        return {}

    # Only the definitions reachable from the roots: the SDK also has models that refer to
    # classes it does not ship (the LLM services), which these manifests never use.
    defs: dict[str, Any] = {}
    pending = list(ROOTS)
    while pending:
        name = pending.pop()
        if name in defs:
            continue
        types, attrs, required = models[name]
        if name in ROOTS:
            # Status is written by the controller, never by a manifest (and refers to Knative
            # types the SDK does not ship).
            types = {a: ("object" if a == "status" else t) for a, t in types.items()}
        props = {attrs[a]: type_schema(t) for a, t in types.items()}
        schema: dict[str, Any] = {
            "type": "object",
            "properties": props,
            "additionalProperties": False,
        }
        if required:
            schema["required"] = sorted(attrs[a] for a in required)
        if name in ROOTS:
            api_version, kind = ROOTS[name]
            props["apiVersion"] = {"const": api_version}
            props["kind"] = {"const": kind}
            schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind"})
        defs[name] = schema
        pending += [
            ref.removeprefix("#/$defs/")
            for ref in re.findall(r'"\$ref": "(#/\$defs/\w+)"', json.dumps(props))
        ]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://bitserve.local/schemas/kserve.schema.json",
        "description": (
            "KServe ServingRuntime/InferenceService schema generated by "
            "generate_kserve_schema.py from the kserve Python SDK's OpenAPI models; Kubernetes "
            f"types refer to kubernetes-validate's v{K8S_VERSION} definitions."
        ),
        "x-unresolved-types": sorted(unresolved),
        "$defs": defs,
    }


def main(argv: list[str]) -> int:
    """Entry point: ``generate_kserve_schema.py MODELS_DIR OUT.json``."""
    import kubernetes_validate  # type: ignore[import-untyped]  # a test-only dependency

    models_dir, out = Path(argv[1]), Path(argv[2])
    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    definitions = json.loads(
        (root / f"v{K8S_VERSION}-local-strict" / "_definitions.json").read_text()
    )
    doc = build(models_dir, definitions["$defs"])
    out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}: {len(doc['$defs'])} KServe definitions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
