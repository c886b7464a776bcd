"""docker-compose.yml is valid Compose, checked without a Docker engine, and its parts fit together:
Prometheus scrapes where the supervisor serves, Grafana reads its provisioning where it is mounted,
the dashboard names the datasource that is provisioned, and the one-shot service registers the
search attributes RunWorkflow upserts."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from temporalio.api.enums.v1 import IndexedValueType

from stayalive.workers.supervisor import METRICS_PORT, SEARCH_ATTRIBUTES
from tests.dashboard import DASHBOARD, dashboard_uses, datasource_uids, load_dashboard
from tests.helpers import ROOT

SERVICES = {
    "postgresql",
    "temporal",
    "search-attributes",
    "temporal-ui",
    "supervisor",
    "node-agent",
    "prometheus",
    "grafana",
}


def compose() -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    return services


def mounts(service: dict[str, Any]) -> dict[str, Path]:
    """A service's bind mounts from this repository: where in the container → what, here."""
    found = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        if source.startswith("."):
            found[target] = (ROOT / source).resolve()
    return found


def flag(command: list[str], name: str) -> str:
    assert command.count(name) == 1, f"{name} once in {command}"
    return command[command.index(name) + 1]


def test_compose_file_is_valid_and_has_the_production_stack() -> None:
    tool = shutil.which("docker-compose")
    if tool is None:
        if os.environ.get("STAYALIVE_REQUIRE_COMPOSE"):
            pytest.fail("docker-compose is required here: apt-get install docker-compose")
        pytest.skip("docker-compose is not installed (apt-get install docker-compose); CI installs it")
    check = subprocess.run([tool, "config", "-q"], cwd=ROOT, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    services = subprocess.run([tool, "config", "--services"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert set(services.stdout.split()) == SERVICES
    assert set(compose()) == SERVICES  # the file the other tests read is the one Compose reads


def test_images_are_pinned() -> None:
    images = [s["image"] for s in compose().values() if "image" in s]
    assert all(re.fullmatch(r"[\w./-]+:[\w.-]+", i) and not i.endswith(":latest") for i in images), images


def test_prometheus_scrapes_the_supervisor_where_it_serves() -> None:
    services = compose()
    supervisor = services["supervisor"]["command"]
    port = flag(supervisor, "--metrics-port")
    assert flag(supervisor, "--metrics-host") == "0.0.0.0", "another container must reach /metrics"
    assert int(port) == METRICS_PORT

    prometheus = services["prometheus"]
    config_path = flag([part for arg in prometheus["command"] for part in arg.split("=", 1)], "--config.file")
    config = yaml.safe_load(mounts(prometheus)[config_path].read_text())
    targets = [t for job in config["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]
    assert targets == [f"supervisor:{port}"]


def test_grafana_reads_its_provisioning_and_the_dashboard() -> None:
    grafana = mounts(compose()["grafana"])
    provisioning = grafana["/etc/grafana/provisioning"]  # where Grafana looks, unless GF_PATHS_PROVISIONING moves it
    assert provisioning == ROOT / "deploy" / "grafana" / "provisioning"

    (provider,) = yaml.safe_load((provisioning / "dashboards" / "stayalive.yml").read_text())["providers"]
    assert provider["type"] == "file"
    assert grafana[provider["options"]["path"]] == DASHBOARD.parent, "the provider reads the mounted dashboards"
    assert (DASHBOARD.parent / "stayalive.json").is_file()

    home = compose()["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    folder, name = home.rsplit("/", 1)
    assert (grafana[folder] / name).is_file(), "the home dashboard is one that is mounted"


def test_the_dashboard_uses_the_provisioned_prometheus() -> None:
    datasources = yaml.safe_load(
        (ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )["datasources"]
    (prometheus,) = [d for d in datasources if d["type"] == "prometheus"]
    assert prometheus["url"] == "http://prometheus:9090", "the compose service, on Prometheus's own port"
    assert datasource_uids(load_dashboard()) == {prometheus["uid"]}


def test_the_dashboard_reads_only_stayalive_metrics() -> None:
    uses = dashboard_uses(load_dashboard())
    assert len(uses) >= 10 and all(use.metrics for use in uses), uses  # every expression reads a metric
    names = {name for use in uses for name in use.metrics}
    assert all(name.startswith("stayalive_") for name in names), names
    assert {"run_id", "category", "cause"} <= {label for use in uses for label in use.labels}


def test_the_search_attribute_service_registers_the_supervisors() -> None:
    service = compose()["search-attributes"]
    assert service["depends_on"]["temporal"]["condition"] == "service_healthy"
    script = "\n".join(service["entrypoint"])
    assert "temporal operator search-attribute create --address temporal:7233" in script
    assert '*"already exists"*)' in script, "a rerun must succeed"
    registered = dict(re.findall(r"^\s*create --name (\w+) --type (\w+)\s*$", script, re.MULTILINE))
    assert {name: IndexedValueType.Name(kind) for name, kind in SEARCH_ATTRIBUTES.items()} == {
        name: f"INDEXED_VALUE_TYPE_{kind.upper()}" for name, kind in registered.items()
    }
    # The workers start once the attributes are there: the run's first upsert needs them.
    assert compose()["supervisor"]["depends_on"]["search-attributes"]["condition"] == "service_completed_successfully"
