"""deploy/router (compose) and deploy/k8s/router (a kustomize overlay) agree with each other, with the replicas
they route to and with the router the suite runs: parsed, since no Docker engine or cluster runs here."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from server.config import ServerConfig
from tests.docker.test_deployment import compose as docker_compose
from tests.docker.test_deployment import hadolint

ROOT = Path(__file__).resolve().parents[2]
ROUTER = ROOT / "deploy" / "router"
OVERLAY = ROOT / "deploy" / "k8s" / "router"
PORT = ServerConfig().port


def compose(name: str) -> dict[str, Any]:
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!reset", lambda loader, node: "!reset")
    return yaml.load((ROUTER / name).read_text(), Loader=Loader)


def flag(args: list[str], name: str) -> list[str]:
    """The values of ``--name`` in an argument list: ``--name=v`` or ``--name v1 v2 ...`` up to the next flag."""
    for i, a in enumerate(args):
        if a.startswith(f"--{name}="):
            return [a.split("=", 1)[1]]
        if a == f"--{name}":
            rest = args[i + 1 :]
            return rest[: next((j for j, r in enumerate(rest) if r.startswith("--")), len(rest))]
    return []


def pinned(package: str) -> str:
    [version] = re.findall(rf"^{package}==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    return version


def test_the_router_image_installs_the_router_the_suite_runs():
    text = (ROUTER / "router.Dockerfile").read_text()
    assert f"ARG VLLM_ROUTER={pinned('vllm-router')}" in text
    assert 'pip install --no-cache-dir "vllm-router==${VLLM_ROUTER}"' in text
    result = subprocess.run([hadolint(), str(ROUTER / "router.Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_router_sends_to_every_replica_and_prometheus_scrapes_them_and_the_router():
    services = compose("compose.yaml")["services"]
    replicas = sorted(s for s in services if s.startswith("specd-"))
    assert len(replicas) >= 2
    args = services["router"]["command"]
    assert flag(args, "policy") == ["${ROUTER_POLICY:-cache_aware}"]
    assert flag(args, "worker-urls") == [f"http://{r}:{PORT}" for r in replicas]
    assert flag(args, "port") == [str(PORT)]
    assert [p.rsplit(":", 1)[1] for p in services["router"]["ports"]] == [str(PORT)]
    assert all("ports" not in services[r] for r in replicas), "only the router is published"
    for r in replicas:
        assert services["router"]["depends_on"][r]["condition"] == "service_healthy"  # the image's HEALTHCHECK
    prometheus = yaml.safe_load((ROUTER / "prometheus.yml").read_text())
    targets = {j["job_name"]: j["static_configs"][0]["targets"] for j in prometheus["scrape_configs"]}
    assert targets["specd"] == [f"{r}:{PORT}" for r in replicas]
    assert targets["router"] == [f"router:{flag(args, 'prometheus-port')[0]}"]


def test_each_replica_is_the_specd_image_on_a_gpu_of_its_own_and_the_cpu_override_drops_them():
    stack = compose("compose.yaml")
    base = docker_compose()["services"]["specd"]
    replicas = {n: s for n, s in stack["services"].items() if n.startswith("specd-")}
    gpus = []
    for service in replicas.values():
        assert (ROUTER / service["build"]["context"] / service["build"]["dockerfile"]).resolve() == ROOT / "Dockerfile"
        assert service["environment"].items() <= base["environment"].items(), "docker/compose.yaml's variables"
        [device] = service["deploy"]["resources"]["reservations"]["devices"]
        gpus += device["device_ids"]
    assert len(set(gpus)) == len(gpus) == len(replicas), f"one GPU per replica: {gpus}"
    cpu = compose("compose.cpu.yaml")["services"]
    assert set(cpu) == set(replicas) and all(s["deploy"] == "!reset" for s in cpu.values())
    grafana = stack["services"]["grafana"]
    for volume in grafana["volumes"]:
        source = volume.split(":", 1)[0]
        if source.startswith("."):
            assert (ROUTER / source).exists(), source


def objects(path: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for doc in yaml.safe_load_all(path.read_text()):
        if doc:
            out[doc["kind"]] = doc
    return out


def test_the_kubernetes_router_finds_the_specd_pods_and_not_itself():
    kustomization = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    assert all((OVERLAY / r).exists() for r in kustomization["resources"])
    assert all((OVERLAY / p["path"]).is_file() for p in kustomization["patches"])
    specd = objects(ROOT / "deploy" / "k8s" / "deployment.yaml")["Deployment"]
    specd_labels = specd["spec"]["template"]["metadata"]["labels"]
    [container] = specd["spec"]["template"]["spec"]["containers"]
    router = objects(OVERLAY / "router.yaml")
    deployment = router["Deployment"]["spec"]["template"]
    [rc] = deployment["spec"]["containers"]
    selector = dict(s.split("=", 1) for s in flag(rc["args"], "selector"))
    assert selector and selector.items() <= specd_labels.items(), "the router discovers the specd pods"
    assert not selector.items() <= deployment["metadata"]["labels"].items(), "and not its own"
    assert flag(rc["args"], "service-discovery-port") == [str(p["containerPort"]) for p in container["ports"]
                                                          if p["name"] == "http"]
    assert flag(rc["args"], "policy") == ["cache_aware"]
    rbac = objects(OVERLAY / "rbac.yaml")
    assert deployment["spec"]["serviceAccountName"] == rbac["ServiceAccount"]["metadata"]["name"]
    [rule] = rbac["Role"]["rules"]
    assert rule["resources"] == ["pods"] and {"list", "watch"} <= set(rule["verbs"])
    assert rbac["RoleBinding"]["roleRef"]["name"] == rbac["Role"]["metadata"]["name"]


def test_the_ingress_sends_v1_to_the_router_service():
    patch = yaml.safe_load((OVERLAY / "ingress-to-router.yaml").read_text())
    base = objects(ROOT / "deploy" / "k8s" / "ingress.yaml")["Ingress"]
    assert patch["metadata"]["name"] == base["metadata"]["name"]
    [path] = patch["spec"]["rules"][0]["http"]["paths"]
    assert path["path"] == "/v1"
    service = objects(OVERLAY / "router.yaml")["Service"]
    assert path["backend"]["service"]["name"] == service["metadata"]["name"]
    assert path["backend"]["service"]["port"]["name"] in {p["name"] for p in service["spec"]["ports"]}


@pytest.mark.parametrize("path", sorted(p.name for p in OVERLAY.glob("*.yaml")))
def test_every_overlay_manifest_parses_and_names_its_object(path):
    for doc in (d for d in yaml.safe_load_all((OVERLAY / path).read_text()) if d):
        if doc["kind"] != "Kustomization":
            assert doc["apiVersion"] and doc["metadata"]["name"]
