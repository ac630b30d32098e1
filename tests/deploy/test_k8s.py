"""deploy/k8s and deploy/kserve: schema-valid offline, and consistent with the server.

Kubernetes objects are checked against the strict schemas (unknown keys are errors) that the
PyPI package kubernetes-validate ships, for the oldest and the newest Kubernetes version
named below; KServe objects against a schema generated from the KServe SDK (schemas/README.md).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from service.settings import Settings

from ._manifests import DEPLOY, format_errors, k8s_errors, kserve_errors, load_yaml_documents
from .test_dockerfile import dockerfile_user_id

K8S_VERSIONS = ["1.30.0", "1.37.0"]
K8S_FILES = sorted((DEPLOY / "k8s").glob("*.yaml"))
KSERVE_FILES = sorted((DEPLOY / "kserve").glob("*.yaml"))


def objects(files: list[Path]) -> dict[str, dict[str, Any]]:
    """``{kind: object}`` over the files (one object of each kind)."""
    out: dict[str, dict[str, Any]] = {}
    for path in files:
        for doc in load_yaml_documents(path):
            assert doc["kind"] not in out, f"two {doc['kind']} objects"
            out[doc["kind"]] = doc
    return out


def container_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", K8S_FILES, ids=lambda p: p.name)
def test_k8s_manifests_match_the_kubernetes_schemas(path: Path, version: str) -> None:
    for doc in load_yaml_documents(path):
        errors = k8s_errors(doc, version)
        assert not errors, f"{path.name} ({doc['kind']}):\n{format_errors(errors)}"


@pytest.mark.parametrize("path", KSERVE_FILES, ids=lambda p: p.name)
def test_kserve_manifests_match_the_kserve_schema(path: Path) -> None:
    for doc in load_yaml_documents(path):
        errors = kserve_errors(doc)
        assert not errors, f"{path.name} ({doc['kind']}):\n{format_errors(errors)}"


def test_schemas_reject_broken_manifests() -> None:
    # The checks above must be able to fail: a misspelt key, a wrong type, a missing field.
    deployment = objects(K8S_FILES)["Deployment"]
    broken = copy.deepcopy(deployment)
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    assert k8s_errors(broken, K8S_VERSIONS[0])
    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = [
        1
    ]
    assert k8s_errors(broken, K8S_VERSIONS[-1])

    kserve = objects(KSERVE_FILES)
    runtime = copy.deepcopy(kserve["ServingRuntime"])
    runtime["spec"]["protocolVersion"] = runtime["spec"].pop("protocolVersions")
    assert kserve_errors(runtime)
    isvc = copy.deepcopy(kserve["InferenceService"])
    del isvc["spec"]["predictor"]["model"]["modelFormat"]
    assert kserve_errors(isvc)
    isvc = copy.deepcopy(kserve["InferenceService"])
    isvc["spec"]["predictor"]["minReplicas"] = "one"
    assert kserve_errors(isvc)


def test_deployment_holds_a_nodes_gpus_and_probes_the_v2_health_endpoints() -> None:
    k8s = objects(K8S_FILES)
    pod = k8s["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    resources = container["resources"]
    # One pod per GPU node, holding its GPUs (several), its workers spread over them.
    gpus = int(resources["limits"]["nvidia.com/gpu"])
    assert gpus > 1
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"]
    env = container_env(container)
    assert env["BITSERVE_DEVICE"] == "cuda"
    assert Settings(workers=env["BITSERVE_WORKERS"]).workers == "auto"
    # auto counts the CPU limit (the cgroup quota): enough for two workers per GPU.
    assert int(resources["limits"]["cpu"]) >= 2 * gpus
    assert resources["requests"]["cpu"] == resources["limits"]["cpu"]
    assert env["BITSERVE_HOST"] == "0.0.0.0"
    (port,) = container["ports"]
    assert port["containerPort"] == int(env["BITSERVE_PORT"])
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/v2/health/ready", "port": port["name"]}
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    for key in env:
        assert key.removeprefix("BITSERVE_").lower() in Settings.model_fields, key


def test_deployment_drains_before_it_is_killed() -> None:
    pod = objects(K8S_FILES)["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop_s = int(command[1])
    drain_s = float(container_env(container)["BITSERVE_GRACEFUL_SHUTDOWN_S"])
    # The grace period counts from the start of preStop: it must cover both.
    assert pod["terminationGracePeriodSeconds"] > pre_stop_s + drain_s
    # Long enough for the endpoint removal to reach every proxy, shorter than the readiness
    # probe's failure window would make it pointless.
    assert pre_stop_s >= 5


def test_model_repository_comes_from_the_claim_read_only() -> None:
    k8s = objects(K8S_FILES)
    pod = k8s["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    repository = container["args"][container["args"].index("--model-repository") + 1]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == repository]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    claim = volume["persistentVolumeClaim"]
    assert claim["claimName"] == k8s["PersistentVolumeClaim"]["metadata"]["name"]
    assert claim["readOnly"] is True
    assert "ReadOnlyMany" in k8s["PersistentVolumeClaim"]["spec"]["accessModes"]


def test_pod_runs_as_the_image_user() -> None:
    pod = objects(K8S_FILES)["Deployment"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == dockerfile_user_id()
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # With a read-only root, the places torch/Triton write to must be volumes.
    mounted = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/tmp", "/home/bitserve"} <= mounted


def test_service_pdb_and_hpa_select_the_deployment() -> None:
    k8s = objects(K8S_FILES)
    deployment = k8s["Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = k8s["Service"]
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert port["targetPort"] in {p["name"] for p in container["ports"]}
    assert k8s["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    target = k8s["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    (metric,) = k8s["HorizontalPodAutoscaler"]["spec"]["metrics"]
    # A gauge the server really exports (service/observability/metrics.py).
    from .test_monitoring import exported_series

    assert metric["pods"]["metric"]["name"] in exported_series()


def test_inference_service_uses_the_runtime_with_the_v2_protocol() -> None:
    kserve = objects(KSERVE_FILES)
    runtime, isvc = kserve["ServingRuntime"], kserve["InferenceService"]
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["protocolVersion"] == "v2"
    assert "v2" in runtime["spec"]["protocolVersions"]
    formats = {(f["name"], f.get("version")) for f in runtime["spec"]["supportedModelFormats"]}
    assert (model["modelFormat"]["name"], model["modelFormat"].get("version")) in formats
    assert model["resources"]["limits"]["nvidia.com/gpu"] == "1"
    (container,) = runtime["spec"]["containers"]
    assert container["name"] == "kserve-container"
    env = container_env(container)
    (port,) = container["ports"]
    assert port["containerPort"] == int(env["BITSERVE_PORT"]) == 8080
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": 8080}
    # KServe's storage initializer puts the storageUri's content at /mnt/models.
    assert container["args"] == ["serve", "--model-repository", "/mnt/models"]
    for key in env:
        assert key.removeprefix("BITSERVE_").lower() in Settings.model_fields, key
