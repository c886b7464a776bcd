"""deploy/kubernetes, checked offline: every manifest against the Kubernetes API's JSON schemas (shipped
inside the kubernetes-validate package), and what a schema cannot see against the code the manifests
run: the workers' real flags, the metrics port, the search attributes, the volumes, Temporal's address."""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import re
import shlex
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.service import TLSConfig

from stayalive.workers import node_agent, supervisor
from stayalive.workers.temporal import add_temporal_flags, client_config

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.30"  # the oldest minor version still under a cloud's standard support
NAMESPACE = "stayalive"
NOT_MANIFESTS = {"kustomization.yaml", "temporal-values.yaml"}  # read by kustomize and Helm, not applied

Doc = dict[str, Any]


def documents(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def kustomization() -> Doc:
    return documents(DEPLOY / "kustomization.yaml")[0]


def manifests() -> list[tuple[str, Doc]]:
    """(file name, document) for every document of every file kustomize applies."""
    return [(name, doc) for name in kustomization()["resources"] for doc in documents(DEPLOY / name)]


def find(kind: str, name: str | None = None) -> Doc:
    found = [doc for _, doc in manifests() if doc["kind"] == kind and name in (None, doc["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_spec(workload: Doc) -> Doc:
    spec: Doc = workload["spec"]["template"]["spec"]
    return spec


def only_container(workload: Doc) -> Doc:
    (container,) = pod_spec(workload)["containers"]
    return container


def parse(cli: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """argv as the worker would parse it, or the test fails with argparse's own complaint."""
    complaint = io.StringIO()
    with contextlib.redirect_stderr(complaint), contextlib.suppress(SystemExit):
        return cli.parse_args(argv)
    pytest.fail(f"{cli.prog} rejects {argv}: {complaint.getvalue()}")


def worker_args(workload: Doc, module: str, cli: argparse.ArgumentParser) -> argparse.Namespace:
    container = only_container(workload)
    command = [*container["command"], *container.get("args", [])]
    assert command[:3] == ["python", "-m", module]
    return parse(cli, command[3:])


def supervisor_args() -> argparse.Namespace:
    return worker_args(find("Deployment", "stayalive-supervisor"), "stayalive.workers.supervisor", supervisor.parser())


def agent_args() -> argparse.Namespace:
    return worker_args(find("DaemonSet", "stayalive-node-agent"), "stayalive.workers.node_agent", node_agent.parser())


def workloads() -> list[Doc]:
    return [doc for _, doc in manifests() if doc["kind"] in {"Deployment", "DaemonSet", "Job"}]


def mount_of(workload: Doc, path: str) -> tuple[Doc, Doc]:
    """The (volumeMount, volume) a file at `path` lies in, in the workload's only container."""
    mounts = [m for m in only_container(workload)["volumeMounts"] if PurePosixPath(path).is_relative_to(m["mountPath"])]
    assert mounts, f"{workload['metadata']['name']}: nothing is mounted where {path} lies"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    (volume,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"]]
    return mount, volume


def test_the_kustomization_lists_every_manifest_in_the_folder() -> None:
    listed = kustomization()["resources"]
    on_disk = {p.name for p in DEPLOY.iterdir() if p.suffix in {".yaml", ".yml"}} - NOT_MANIFESTS
    assert sorted(listed) == sorted(on_disk), "a manifest kustomize never applies, or a listed one that is gone"
    assert kustomization()["namespace"] == NAMESPACE


@pytest.mark.parametrize(("name", "doc"), manifests(), ids=lambda x: x if isinstance(x, str) else x["kind"])
def test_every_document_is_valid_kubernetes(name: str, doc: Doc) -> None:
    invalid = None
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)  # strict: unknown fields fail
    except kubernetes_validate.ValidationError as exc:
        invalid = f"{name}: {'.'.join(map(str, exc.path))}: {exc.message}"
    except kubernetes_validate.SchemaNotFoundError as exc:  # a kind or apiVersion Kubernetes does not have
        invalid = f"{name}: {exc.message}"
    assert invalid is None, invalid
    if doc["kind"] == "Namespace":
        assert doc["metadata"]["name"] == NAMESPACE
    else:
        assert doc["metadata"]["namespace"] == NAMESPACE, "also right under plain `kubectl apply -f`"


def test_the_validator_rejects_what_the_api_server_would() -> None:
    """The check above is worth something only if it bites: a misspelt field and a wrong type."""
    agent = find("DaemonSet")
    misspelt = copy.deepcopy(agent)
    only_container(misspelt)["imagePulPolicy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError, match="imagePulPolicy"):
        kubernetes_validate.validate(misspelt, KUBERNETES_VERSION, strict=True)
    mistyped = copy.deepcopy(agent)
    pod_spec(mistyped)["hostNetwork"] = "yes"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(mistyped, KUBERNETES_VERSION, strict=True)


def test_the_workers_run_the_image_with_flags_they_accept() -> None:
    supervisor_args(), agent_args()  # each fails the test with argparse's message for an unknown flag
    for workload in (find("Deployment"), find("DaemonSet")):
        assert only_container(workload)["image"] == "stayalive:latest"  # the Dockerfile's, one for both


def test_every_variable_a_command_names_is_defined() -> None:
    """Kubernetes leaves an undefined $(NAME) in a command as it is: the agent would be node `$(NODE)`."""
    config_maps = {doc["metadata"]["name"]: doc.get("data", {}) for _, doc in manifests() if doc["kind"] == "ConfigMap"}
    for workload in workloads():
        for container in pod_spec(workload)["containers"]:
            defined = {env["name"] for env in container.get("env", [])}
            for source in container.get("envFrom", []):
                defined |= set(config_maps[source["configMapRef"]["name"]])
            named = set(re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", " ".join(container.get("command", []))))
            named |= set(re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", " ".join(container.get("args", []))))
            assert named <= defined, f"{workload['metadata']['name']}: undefined {named - defined}"


def test_every_mounted_volume_is_declared_and_every_declared_one_mounted() -> None:
    for workload in workloads():
        declared = {volume["name"] for volume in pod_spec(workload).get("volumes", [])}
        mounted = {m["name"] for c in pod_spec(workload)["containers"] for m in c.get("volumeMounts", [])}
        assert mounted == declared, f"{workload['metadata']['name']}: mounted {mounted}, declared {declared}"


def test_the_metrics_service_reaches_the_supervisors_metrics_port() -> None:
    args = supervisor_args()
    deployment, service = find("Deployment"), find("Service", "stayalive-supervisor-metrics")
    assert args.metrics_host == "0.0.0.0", "on loopback, nothing outside the pod can scrape it"
    ports = {p["name"]: p["containerPort"] for p in only_container(deployment)["ports"]}
    (port,) = service["spec"]["ports"]
    target = port["targetPort"]
    assert ports.get(target, target) == args.metrics_port
    annotations = service["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(args.metrics_port)
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_the_node_agent_runs_on_every_gpu_host_on_its_network() -> None:
    daemonset = find("DaemonSet", "stayalive-node-agent")
    spec, container, args = pod_spec(daemonset), only_container(daemonset), agent_args()
    assert spec["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) > 0
    assert spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet", "else the Temporal frontend's DNS name does not resolve"
    assert args.host == "0.0.0.0"
    fields = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"] if "valueFrom" in e}
    assert args.node == "$(NODE_NAME)" and fields["NODE_NAME"] == "spec.nodeName"
    assert args.advertise == "$(HOST_IP)" and fields["HOST_IP"] == "status.hostIP"
    assert args.memory_dir is None, "the host-memory tier defaults to /dev/shm"
    _, shm = mount_of(daemonset, "/dev/shm/stayalive")
    assert shm["emptyDir"]["medium"] == "Memory"
    mount_of(daemonset, str(args.state_dir))
    assert daemonset["spec"]["updateStrategy"]["type"] == "OnDelete", "a rolling update would kill a run's ranks"


def test_both_workers_read_the_fleet_secret_from_its_secret() -> None:
    creation = (DEPLOY / "kustomization.yaml").read_text()
    created = re.search(r"kubectl create secret generic (\S+) --from-file=(\w+)=\S+ -n " + NAMESPACE, creation)
    assert created, "kustomization.yaml says how to create the fleet's secret"
    for workload, args in ((find("Deployment"), supervisor_args()), (find("DaemonSet"), agent_args())):
        mount, volume = mount_of(workload, str(args.secret_file))
        assert volume["secret"]["secretName"] == created[1]
        in_volume = PurePosixPath(args.secret_file).relative_to(mount["mountPath"])
        assert str(in_volume) == created[2], "a secret volume holds a file per key, named after it"
        assert volume["secret"]["defaultMode"] & 0o077 == 0, "workers/secret.py warns of a readable secret"


def test_the_checkpoints_are_one_volume_that_every_host_shares() -> None:
    claim = find("PersistentVolumeClaim")
    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    mounts = set()
    for workload in (find("Deployment"), find("DaemonSet")):
        volume_names = {v["name"] for v in pod_spec(workload)["volumes"] if v.get("persistentVolumeClaim")}
        for mount in only_container(workload)["volumeMounts"]:
            if mount["name"] in volume_names:
                (volume,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"]]
                assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
                mounts.add(mount["mountPath"])
    assert mounts == {"/checkpoints"}, "the supervisor validates checkpoints at the paths the ranks wrote"


def registered_attributes(job: Doc) -> dict[str, IndexedValueType.ValueType]:
    script = "\n".join(only_container(job)["args"])
    attributes: dict[str, IndexedValueType.ValueType] = {}
    for line in script.splitlines():
        words = shlex.split(line)
        if words[:4] == ["temporal", "operator", "search-attribute", "create"]:
            flags = dict(zip(words[4::2], words[5::2], strict=True))
            kind = re.sub(r"(?<=[a-z])(?=[A-Z])", "_", flags["--type"]).upper()  # KeywordList → KEYWORD_LIST
            attributes[flags["--name"]] = IndexedValueType.Value(f"INDEXED_VALUE_TYPE_{kind}")
    return attributes


def test_the_job_registers_the_supervisors_search_attributes() -> None:
    job = find("Job")
    assert registered_attributes(job) == supervisor.SEARCH_ATTRIBUTES
    image, _, tag = only_container(job)["image"].partition(":")
    assert image == "temporalio/admin-tools" and tag not in {"", "latest"}, "a pinned image"


def temporal_config() -> dict[str, str]:
    data: dict[str, str] = find("ConfigMap", "stayalive-temporal")["data"]
    return data


def no_flags() -> argparse.Namespace:
    cli = argparse.ArgumentParser()
    add_temporal_flags(cli)
    return cli.parse_args([])


def test_every_temporal_client_gets_the_configmap() -> None:
    config = temporal_config()
    assert set(config) >= {"TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE"}
    connect = client_config(no_flags(), env=config)  # as workers/temporal.py reads the environment
    assert connect["target_host"] == config["TEMPORAL_ADDRESS"]
    assert connect["namespace"] == config["TEMPORAL_NAMESPACE"]
    for workload in workloads():
        sources = [s["configMapRef"]["name"] for s in only_container(workload).get("envFrom", [])]
        assert "stayalive-temporal" in sources, workload["metadata"]["name"]


def test_the_configmaps_mutual_tls_lines_turn_tls_on(tmp_path: Path) -> None:
    """Temporal Cloud is the commented lines uncommented: their names must be the ones read, and their
    files must lie in the mount of the TLS secret in every workload."""
    text = (DEPLOY / "temporal-config.yaml").read_text()
    tls = yaml.safe_load("\n".join(re.findall(r"^  # (TEMPORAL_\w+: .*)$", text, flags=re.MULTILINE)))
    paths = {name: PurePosixPath(value) for name, value in tls.items() if name.endswith("_PATH")}
    assert paths, "temporal-config.yaml shows how to turn mutual TLS on"
    for workload in workloads():
        for path in paths.values():
            _, volume = mount_of(workload, str(path))
            assert volume["secret"]["secretName"] == "stayalive-temporal-tls"
    env = {**temporal_config(), **tls}
    for name, path in paths.items():
        (tmp_path / path.name).write_text("PEM")
        env[name] = str(tmp_path / path.name)
    tls_config = client_config(no_flags(), env=env).get("tls")
    assert isinstance(tls_config, TLSConfig) and tls_config.client_cert == b"PEM"


def test_the_helm_values_give_the_workers_their_temporal() -> None:
    text = (DEPLOY / "temporal-values.yaml").read_text()
    install = re.search(r"^#\s+helm install (\S+) temporal/temporal .*?-n (\S+) -f deploy/kubernetes/", text, re.M)
    assert install, "temporal-values.yaml opens with the helm install command"
    release, namespace = install[1], install[2]
    assert namespace == NAMESPACE
    config = temporal_config()
    assert config["TEMPORAL_ADDRESS"] == f"{release}-frontend.{namespace}.svc.cluster.local:7233"
    values = yaml.safe_load(text)
    assert values["web"]["enabled"] is True
    namespaces = values["server"]["config"]["namespaces"]
    assert namespaces["create"] is True
    assert config["TEMPORAL_NAMESPACE"] in {n["name"] for n in namespaces["namespace"]}
    for store in values["server"]["config"]["persistence"]["datastores"].values():
        assert store["sql"]["pluginName"].startswith("postgres12")
        assert f"kubectl create secret generic {store['sql']['existingSecret']} " in text, "say how to create it"
