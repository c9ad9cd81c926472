"""The deployment files (deploy/, docker-compose.yml) are checked, not just written: the Dockerfile
passes hadolint (and is built where a Docker engine runs), the Kubernetes manifests validate against
the Kubernetes API's own schemas (kubernetes-validate, strict), and what the files must agree on
does: probe paths and ports, the drain deadline under the grace period, the user id, the consumer
group KEDA watches, and the pipelines they run load."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from etl.pipeline import load_pipeline

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
MANIFESTS = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))


def documents() -> list[dict[str, Any]]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def kind(name: str) -> dict[str, Any]:
    found = [doc for doc in documents() if doc["kind"] == name]
    assert len(found) == 1, (name, len(found))
    return found[0]


def image_env() -> dict[str, str]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    return dict(re.findall(r"(ETL_[A-Z_]+)=(\S+)", text.split("\nFROM ")[-1]))


def test_the_dockerfile_passes_hadolint_and_builds_where_docker_runs() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    linted = subprocess.run([hadolint, "--failure-threshold", "info", str(DOCKERFILE)], capture_output=True, text=True)
    assert linted.returncode == 0, linted.stdout + linted.stderr
    text = DOCKERFILE.read_text()
    assert re.search(r"^USER 10001$", text, re.M) and 'ENTRYPOINT ["etl", "run"]' in text  # non-root, exec form
    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        built = subprocess.run(["docker", "build", "-f", str(DOCKERFILE), "--build-arg", "LOCAL_MODEL=0", "-t",
                                "idem-etl-worker:test", str(ROOT)], capture_output=True, text=True, timeout=1800)
        assert built.returncode == 0, built.stderr[-3000:]


def test_kubernetes_manifests_validate_against_the_api_schemas() -> None:
    version = kubernetes_validate.latest_version()
    checked = []
    for doc in documents():
        if doc["apiVersion"].startswith("keda.sh/"):
            continue  # a CRD: not in Kubernetes' schemas (checked below against KEDA's documented fields)
        kubernetes_validate.validate(doc, version, strict=True)  # raises on any unknown or mistyped field
        checked.append(doc["kind"])
    assert sorted(checked) == ["ConfigMap", "Deployment", "PodDisruptionBudget"]


def test_the_files_agree_on_probes_drain_user_and_consumer_group(tmp_path: Path) -> None:
    deployment, scaled = kind("Deployment"), kind("ScaledObject")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    image = image_env()
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["probes"]
    assert str(port) == image["ETL_METRICS_PORT"] and image["ETL_METRICS_HOST"] == "0.0.0.0"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # Kubernetes kills at the grace period: the drain must end (and commit) well before it
    assert pod["terminationGracePeriodSeconds"] >= float(env["ETL_DRAIN_TIMEOUT_S"]) + 10
    assert pod["securityContext"]["runAsUser"] == 10001 and pod["securityContext"]["runAsNonRoot"]
    # the pipeline the ConfigMap mounts loads, and it is the consumer group KEDA scales by
    pipeline_file = tmp_path / "pipeline.py"
    pipeline_file.write_text(kind("ConfigMap")["data"]["pipeline.py"])
    loaded = load_pipeline(str(pipeline_file))
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["type"] == "kafka"
    metadata = trigger["metadata"]
    assert all(isinstance(v, str) for v in metadata.values()), metadata  # KEDA's metadata is map[string]string
    assert {"bootstrapServers", "consumerGroup", "topic", "lagThreshold"} <= metadata.keys()
    assert metadata["consumerGroup"] == loaded.source.group and metadata["topic"] == loaded.source.topic
    assert metadata["bootstrapServers"] == env["ETL_KAFKA_BOOTSTRAP"]
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]


def test_the_compose_worker_runs_a_pipeline_that_loads_within_its_grace_period() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    worker = compose["services"]["worker"]
    assert worker["build"]["dockerfile"] == "deploy/Dockerfile" and worker["deploy"]["replicas"] >= 2
    assert "worker" in worker["profiles"]  # the test services start without building it
    grace = float(worker["stop_grace_period"].rstrip("s"))
    assert grace >= float(worker["environment"]["ETL_DRAIN_TIMEOUT_S"]) + 10
    mount = {v.split(":")[1]: v.split(":")[0] for v in worker["volumes"]}
    pipeline = worker["command"][0]
    host = next(ROOT / src / pipeline[len(dst) + 1:] for dst, src in mount.items() if pipeline.startswith(dst + "/"))
    loaded = load_pipeline(str(host))
    assert loaded.source.group == "banking-workers"
    kafka = compose["services"]["kafka"]["environment"]
    assert worker["environment"]["ETL_KAFKA_BOOTSTRAP"] in kafka["KAFKA_ADVERTISED_LISTENERS"]
