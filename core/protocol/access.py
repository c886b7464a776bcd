"""Who may use a node agent's hub: holders of the fleet's secret (the supervisor and the node agents),
and, for one run only, holders of that run's token (its ranks).

A caller proves it holds its key without sending it: the hub's first line is a Challenge (a fresh
nonce) and the caller's first line a Proof, HMAC(key, nonce), before the line that says why it
calls. The keys never cross the network, and a proof overheard is worth nothing on the next
connection.

A run's token is HMAC(fleet secret, run id): a node agent hands it to the run's ranks in their
environment and checks it without keeping anything, and it is never written into workflow history.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Literal

from pydantic import BaseModel, ConfigDict


class Challenge(BaseModel):
    model_config = ConfigDict(frozen=True)

    t: Literal["challenge"] = "challenge"
    nonce: str


class Proof(BaseModel):
    model_config = ConfigDict(frozen=True)

    t: Literal["proof"] = "proof"
    mac: str


def run_token(secret: bytes, run_id: str) -> str:
    """The key the ranks of `run_id` hold (STAYALIVE_RUN_TOKEN): no other run's, no fleet request's."""
    return hmac.new(secret, b"stayalive run token\x00" + run_id.encode(), hashlib.sha256).hexdigest()


def prove(key: bytes, nonce: str) -> str:
    return hmac.new(key, b"stayalive hub\x00" + nonce.encode(), hashlib.sha256).hexdigest()


def proven(key: bytes, nonce: str, proof: Proof) -> bool:
    return hmac.compare_digest(prove(key, nonce), proof.mac)


def knock(challenge: bytes, key: bytes, opening: BaseModel) -> bytes:
    """A caller's answer to the hub's challenge line: its proof, then the line that says why it calls.
    Raises pydantic's ValidationError when `challenge` is no challenge (what answered is no hub)."""
    nonce = Challenge.model_validate_json(challenge).nonce
    return b"%s\n%s\n" % (Proof(mac=prove(key, nonce)).model_dump_json().encode(), opening.model_dump_json().encode())
