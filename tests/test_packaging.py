"""The wheel a user installs into their training environment: one import root, torch as a range."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.helpers import ROOT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("stayalive-*.whl")
    return built


def test_stayalive_is_the_only_top_level_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"stayalive", f"{wheel.name.split('-py3')[0]}.dist-info"}
    for part in ("core", "training", "agent", "activities", "workflows", "workers", "sim"):
        assert f"stayalive/{part}/__init__.py" in names, part
    assert not any(name.startswith(("stayalive/tests/", "stayalive/bench/")) for name in names)


def test_torch_is_required_as_a_range_that_admits_the_tested_build(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    lines = metadata.splitlines()
    requires = [Requirement(line.split(":", 1)[1]) for line in lines if line.startswith("Requires-Dist:")]
    (torch,) = [r for r in requires if r.name == "torch"]
    assert len(torch.specifier) >= 2 and not any(spec.operator == "==" for spec in torch.specifier), torch
    tested = Version(__import__("torch").__version__)  # e.g. 2.13.0+cpu: a local build label is admitted
    assert torch.specifier.contains(tested.base_version), (torch, tested)
    assert torch.specifier.contains("2.13.0+cu128"), "a CUDA build of the tested version must be admitted"


def test_installed_it_imports_as_stayalive_and_shadows_nothing(wheel: Path, tmp_path: Path) -> None:
    """Unpacked where nothing of the repository is on the path (python -S: no .pth, so not the editable
    install either); the dependencies come from this environment's site-packages."""
    unpacked, site_packages = tmp_path / "site", sysconfig.get_paths()["purelib"]
    zipfile.ZipFile(wheel).extractall(unpacked)
    probe = (
        "import importlib, sys\n"
        f"sys.path[:] = [{str(unpacked)!r}, *{sys.path[1:]!r}]\n"
        f"sys.path = [p for p in sys.path if not p.startswith({str(ROOT)!r})] + [{site_packages!r}]\n"
        "import stayalive.training.checkpoint, stayalive.workflows.run\n"
        "assert stayalive.__file__.startswith(sys.path[0]), stayalive.__file__\n"
        "for name in ('core', 'training', 'workflows', 'workers', 'agent', 'activities', 'sim', 'bench'):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError:\n"
        "        continue\n"
        "    raise SystemExit(f'{name} is importable: the wheel put it at the top of site-packages')\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-S", "-c", probe], cwd=tmp_path, capture_output=True, text=True)
    assert done.stdout.strip() == "ok", done.stderr
