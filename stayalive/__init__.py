"""stayalive: keep a month-long synchronous PyTorch training run alive, and its result trustworthy.

The installed package is this one root. Its parts are the repository's top-level folders:
`stayalive.core` (pure decisions), `stayalive.workflows` and `stayalive.activities` (the Temporal
side), `stayalive.agent` (the node agent), `stayalive.training` (what runs in a rank),
`stayalive.workers` (entry points and the CLI) and `stayalive.sim` (the simulated cluster).

The public training API is `stayalive.Run` (training/run.py): a training loop of the user's own adds a
few lines and gets stayalive's checkpoints, commands and hang diagnosis; `stayalive.init_process_group()`
joins the run's default group on its backend and names the rank's device (training/accelerator.py).
It is imported on first use: the workflows import this package and must never load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stayalive.training.accelerator import init_process_group
    from stayalive.training.run import Run, Stateful

__all__ = ["Run", "Stateful", "init_process_group"]
_MODULES = {"Run": "run", "Stateful": "run", "init_process_group": "accelerator"}  # under stayalive.training


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return getattr(importlib.import_module(f"stayalive.training.{_MODULES[name]}"), name)
    raise AttributeError(f"module 'stayalive' has no attribute {name!r}")
