"""What a checkpoint of a user's loop holds (training/run.py), and putting it back.

The model and optimizer go in as DCP state dicts (sharded for FSDP2, so DCP reshards them at another
world size), with the objects the same on every rank (an LR scheduler, say). What is each rank's own
(its RNG streams, its data loader's position) goes in as one opaque value per rank, which other world
sizes neither need nor could reshard.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from stayalive.training.checkpoint import DcpManifest
from stayalive.training.rng import reseed, rng_state, set_rng_state


class Stateful(Protocol):
    """What a data loader or any other saved object offers (torchdata's StatefulDataLoader does)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None: ...


@dataclass
class LoopState:
    """The objects of a loop that its checkpoints hold: `per_rank` is saved per rank (a data loader's
    position), `shared` is the same on every rank (an LR scheduler)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    shared: dict[str, Stateful] = field(default_factory=dict)
    per_rank: dict[str, Stateful] = field(default_factory=dict)

    def state(self, rank: int) -> dict[str, Any]:
        """What a checkpoint holds, as it stands: `rank`'s own value under `ranks/{rank}`. Its model
        parameters and optimizer state may be copied later, until the loop's next update (which waits
        for them: training/state_checkpointer.py); what else can change before that is a copy already:
        the model's buffers (a forward changes batch norm's) and the other objects' states."""
        state: dict[str, Any] = {}
        if self.optimizer is not None:
            state["model"], state["optim"] = get_state_dict(self.model, self.optimizer)
        else:
            state["model"] = get_model_state_dict(self.model)
        buffers = {b.data_ptr() for b in self.model.buffers() if not isinstance(b, DTensor)}
        state["model"] = {key: _copied_if_in(value, buffers) for key, value in state["model"].items()}
        state |= {f"state/{name}": copy.deepcopy(obj.state_dict()) for name, obj in self.shared.items()}
        mine = {"rng": rng_state()} | {name: obj.state_dict() for name, obj in self.per_rank.items()}
        buffer = io.BytesIO()
        torch.save(mine, buffer)
        state[_own(rank)] = buffer.getvalue()
        return state

    def loadable(self, rank: int, carried: bool) -> Callable[[DcpManifest], dict[str, Any]]:
        """What DCP loads a checkpoint into (state_restore.restore_state's `state_for`): the state as it
        is now, with this rank's own value only where the checkpoint saved one and this process did
        not carry its own over."""

        def state_for(manifest: DcpManifest) -> dict[str, Any]:
            current = self.state(rank)
            own = rank < manifest.world_size and not carried
            return current if own else {k: v for k, v in current.items() if k != _own(rank)}

        return state_for

    def load(self, loaded: dict[str, Any], rank: int, step: int, carried: bool) -> None:
        """Put what DCP loaded back into the loop's objects. A rank without a value of its own keeps
        its streams and position where its process carried them over, else starts fresh streams from
        the restored `step`."""
        if self.optimizer is not None:
            set_state_dict(
                self.model, self.optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
            )
        else:
            set_model_state_dict(self.model, loaded["model"])
        for name, obj in self.shared.items():
            obj.load_state_dict(loaded[f"state/{name}"])
        if (mine := loaded.get(_own(rank))) is not None:
            own = torch.load(io.BytesIO(mine), weights_only=True)
            set_rng_state(own.pop("rng"))
            for name, obj in self.per_rank.items():
                obj.load_state_dict(own[name])
        elif not carried:
            reseed(step, rank)


def _copied_if_in(value: Any, pointers: set[int]) -> Any:
    plain = isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
    return value.clone() if plain and value.data_ptr() in pointers else value


def _own(rank: int) -> str:
    """Where a checkpoint keeps a rank's own value."""
    return f"ranks/{rank}"
