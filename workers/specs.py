"""Reading a run spec from a file, with every problem named by the field it is in."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from stayalive.core.run.spec import RunSpec


class UsageError(Exception):
    pass


def load_spec(path: Path) -> RunSpec:
    """Read and validate a spec; every problem is reported with the field it is in."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path} is not JSON: {exc}") from None
    try:
        return RunSpec.model_validate(raw)
    except ValidationError as exc:
        raise UsageError(f"{path} is not a valid run spec:\n{describe_errors(exc)}") from None


def describe_errors(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        field = ".".join(str(p) for p in error["loc"]) or "spec"
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "missing":
            message = "required field is missing"
        elif error["type"] == "extra_forbidden":
            message = "unknown field (a typo?)"
        elif error["type"] == "union_tag_invalid":
            message = f"unknown kind {error['input'].get('kind')!r}; known: {error['ctx']['expected_tags']}"
        lines.append(f"  {field}: {message}")
    return "\n".join(lines)
