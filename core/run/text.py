"""Free text in the records a run carries (timeline entries, detections, pages), bounded: the state
travels whole through every continue-as-new and query, and one entry naming 2,048 unreachable nodes
or a long log line must not make it grow. A person reads one line; logs and artifacts hold the rest."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

TEXT_CHARS = 400


def clip(text: str, most: int = TEXT_CHARS) -> str:
    """`text`, or its first part and how much was left out."""
    if len(text) <= most:
        return text
    tail = f" … ({len(text) - most} more characters)"
    return text[: most - len(tail)] + tail


Text = Annotated[str, AfterValidator(clip)]
