"""Loading the deployment files and their schemas (shared by the tests of ``tests/deploy``)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # no stubs in the test set-up
import yaml
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SCHEMAS = Path(__file__).resolve().parent / "schemas"


def load_yaml_documents(path: Path) -> list[dict[str, Any]]:
    """Every non-empty YAML document of ``path`` (safe loader: merge keys, no tags)."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path} holds no YAML document"
    assert all(isinstance(d, dict) for d in docs), f"{path}: a document is not a mapping"
    return docs


def format_errors(errors: list[jsonschema.ValidationError]) -> str:
    """One line per error: where (JSON path) and what."""
    return "\n".join(f"{e.json_path}: {e.message[:300]}" for e in errors)


@cache
def compose_validator() -> jsonschema.protocols.Validator:
    """A validator for the Compose Specification (vendored schema, see schemas/README.md)."""
    schema = json.loads((SCHEMAS / "compose-spec.json").read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def _k8s_schema_dir(version: str) -> Path:
    import kubernetes_validate  # type: ignore[import-untyped]  # test-only dependency

    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    path = root / f"v{version}-local-strict"
    assert path.is_dir(), f"kubernetes-validate has no schemas for Kubernetes {version}"
    return path


@cache
def _k8s_definitions(version: str) -> Resource[Any]:
    return Resource.from_contents(
        json.loads((_k8s_schema_dir(version) / "_definitions.json").read_text())
    )


def k8s_errors(doc: dict[str, Any], version: str) -> list[jsonschema.ValidationError]:
    """Errors of one Kubernetes object against the strict schemas of Kubernetes ``version``.

    Strict: unknown keys are errors. Same lookup as ``kubernetes_validate.validate`` (kind and
    group/version pick the schema file), but returning every error, not the first.
    """
    group_version = doc["apiVersion"]
    group, _, api = group_version.rpartition("/")
    # kubernetes-validate names files <kind>-<group's first label>-<version>.json.
    prefix = group.split(".")[0] + "-" if group else ""
    path = _k8s_schema_dir(version) / f"{doc['kind'].lower()}-{prefix}{api}.json"
    assert path.is_file(), f"no schema for {doc['kind']} {group_version} in Kubernetes {version}"
    schema = json.loads(path.read_text())
    registry: Registry[Any] = _k8s_definitions(version) @ Registry()
    validator = jsonschema.Draft202012Validator(schema, registry=registry)
    return sorted(validator.iter_errors(doc), key=lambda e: e.json_path)


# The Kubernetes definitions the generated KServe schema refers to (see schemas/README.md).
KSERVE_K8S_VERSION = "1.37.0"
_KSERVE_ROOTS = {
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): "V1alpha1ServingRuntime",
    ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"): "V1alpha1ClusterServingRuntime",
    ("serving.kserve.io/v1beta1", "InferenceService"): "V1beta1InferenceService",
}


@cache
def _kserve_schema() -> dict[str, Any]:
    return json.loads((SCHEMAS / "kserve.schema.json").read_text())  # type: ignore[no-any-return]


def kserve_errors(doc: dict[str, Any]) -> list[jsonschema.ValidationError]:
    """Errors of one KServe object against the schema generated from the KServe SDK."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    assert key in _KSERVE_ROOTS, f"not a KServe kind this test knows: {key}"
    schema = _kserve_schema()
    registry: Registry[Any] = Resource.from_contents(schema) @ (
        _k8s_definitions(KSERVE_K8S_VERSION) @ Registry()
    )
    root = {"$ref": f"{schema['$id']}#/$defs/{_KSERVE_ROOTS[key]}"}
    validator = jsonschema.Draft202012Validator(root, registry=registry)
    return sorted(validator.iter_errors(doc), key=lambda e: e.json_path)
