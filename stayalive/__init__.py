"""stayalive: keep a month-long synchronous PyTorch training run alive, and its result trustworthy.

The installed package is this one root. Its parts are the repository's top-level folders:
`stayalive.core` (pure decisions), `stayalive.workflows` and `stayalive.activities` (the Temporal
side), `stayalive.agent` (the node agent), `stayalive.training` (what runs in a rank),
`stayalive.workers` (entry points and the CLI) and `stayalive.sim` (the simulated cluster).

The public training API is `stayalive.Run` (training/run.py): a training loop of the user's own adds a
few lines and gets stayalive's checkpoints, commands and hang diagnosis. It is imported on first use:
the workflows import this package and must never load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stayalive.training.run import Run, Stateful

__all__ = ["Run", "Stateful"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from stayalive.training import run

        return getattr(run, name)
    raise AttributeError(f"module 'stayalive' has no attribute {name!r}")
