"""The published scripts under examples/ are what their projects published, changed only by the
patches their UPSTREAM file lists: taking the patches back out gives every file's upstream blob."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ROOT

VENDORED = sorted(p.parent for p in (ROOT / "examples").glob("*/UPSTREAM"))


def upstream(directory: Path) -> tuple[list[str], dict[str, str]]:
    """(patches in the order applied, file → git blob id upstream)."""
    patches, blobs = [], {}
    for line in (directory / "UPSTREAM").read_text().splitlines():
        kind, *rest = line.split()
        if kind == "patch":
            patches.append(rest[0])
        elif kind == "blob":
            blobs[rest[0]] = rest[1]
    return patches, blobs


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_two_published_scripts_are_vendored() -> None:
    assert [d.name for d in VENDORED] == ["fsdp2", "nanogpt"]


@pytest.mark.parametrize("directory", VENDORED, ids=lambda d: d.name)
def test_taking_the_patches_out_gives_back_the_published_files(directory: Path, tmp_path: Path) -> None:
    patches, blobs = upstream(directory)
    assert patches and blobs and (directory / "LICENSE").is_file()
    for name in blobs:
        shutil.copy(directory / name, tmp_path / name)
    for patch in reversed(patches):
        subprocess.run(["git", "apply", "--reverse", str(directory / patch)], cwd=tmp_path, check=True)
    assert {name: git_blob_id((tmp_path / name).read_bytes()) for name in blobs} == blobs
    changed = {name for name in blobs if (tmp_path / name).read_bytes() != (directory / name).read_bytes()}
    assert changed, "the patches change nothing"
