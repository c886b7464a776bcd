"""docker-compose.yml is valid Compose, checked without a Docker engine."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.helpers import ROOT


def test_compose_file_is_valid_and_has_the_production_stack() -> None:
    tool = shutil.which("docker-compose")
    if tool is None:
        if os.environ.get("STAYALIVE_REQUIRE_COMPOSE"):
            pytest.fail("docker-compose is required here: apt-get install docker-compose")
        pytest.skip("docker-compose is not installed (apt-get install docker-compose); CI installs it")
    check = subprocess.run([tool, "config", "-q"], cwd=ROOT, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    services = subprocess.run([tool, "config", "--services"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert set(services.stdout.split()) == {
        "postgresql",
        "temporal",
        "temporal-ui",
        "supervisor",
        "node-agent",
    }
