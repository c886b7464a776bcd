"""The fleet's secret: shared by the supervisor and every node agent, it is what a node agent's hub
takes for the supervisor's requests, and each run's token derives from it (core.protocol.access). One file,
readable by the user the workers run as only:

    python -c 'import secrets; print(secrets.token_hex(32))' > secret && chmod 600 secret
    python -m stayalive.workers.supervisor --secret-file secret      (or STAYALIVE_SECRET_FILE=secret)

The dev stack makes one in its state folder.
"""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path

import structlog

log = structlog.get_logger()

SECRET_ENV = "STAYALIVE_SECRET_FILE"
MIN_BYTES = 16  # anything shorter could be guessed


def add_secret_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--secret-file",
        type=Path,
        default=os.environ.get(SECRET_ENV),
        help=f"the fleet's secret, shared by the supervisor and the node agents (default ${SECRET_ENV})",
    )


def load_secret(path: Path | None) -> bytes:
    """The secret in `path`; SystemExit saying what is wrong when there is none to be had."""
    if path is None:
        raise SystemExit(f"error: no fleet secret: pass --secret-file or set {SECRET_ENV} (see workers/secret.py)")
    try:
        secret = path.read_bytes().strip()
        mode = path.stat().st_mode
    except OSError as exc:
        raise SystemExit(f"error: cannot read the fleet secret {path}: {exc.strerror}") from None
    if len(secret) < MIN_BYTES:
        raise SystemExit(f"error: the fleet secret in {path} has {len(secret)} bytes; it needs {MIN_BYTES} or more")
    if mode & 0o077:
        log.warning("the fleet secret is readable by other users", path=str(path), mode=oct(mode & 0o777))
    return secret


def create_secret(path: Path) -> Path:
    """A new random secret in `path` (mode 600), unless one is there already."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path
