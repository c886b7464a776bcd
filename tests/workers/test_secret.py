"""The fleet's secret file: made private, read back, refused when there is none worth the name."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from stayalive.workers.secret import create_secret, load_secret


def test_a_new_secret_is_private_random_and_kept(tmp_path: Path) -> None:
    path = create_secret(tmp_path / "state" / "secret")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = load_secret(path)
    assert len(secret) == 64
    assert load_secret(create_secret(path)) == secret  # a second start keeps it
    assert load_secret(create_secret(tmp_path / "other")) != secret


def test_no_secret_or_a_short_one_stops_the_worker(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no fleet secret"):
        load_secret(None)
    with pytest.raises(SystemExit, match="cannot read"):
        load_secret(tmp_path / "missing")
    (tmp_path / "short").write_text("hunter2\n")
    with pytest.raises(SystemExit, match="needs 16 or more"):
        load_secret(tmp_path / "short")
