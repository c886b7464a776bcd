"""The keys to a hub: a run's token is its own, and a proof is good for one key and one challenge."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from stayalive.core.protocol.access import Challenge, Proof, knock, proven, run_token
from stayalive.core.protocol.telemetry import Hello

SECRET = b"the fleet's secret, 32 bytes ok"


def test_a_runs_token_is_its_own_and_comes_from_the_fleets_secret() -> None:
    token = run_token(SECRET, "tiny/0000abcd")
    assert token == run_token(SECRET, "tiny/0000abcd")  # an agent derives what the ranks were given
    assert token != run_token(SECRET, "tiny/0000abce")
    assert token != run_token(b"another fleet's secret, 32 bytes", "tiny/0000abcd")
    assert SECRET.hex() not in token and len(token) == 64


def test_a_knock_proves_its_key_for_this_challenge_only_and_never_carries_it() -> None:
    key = run_token(SECRET, "tiny/0000abcd").encode()
    hello = Hello(run_id="tiny/0000abcd", rank=0, generation=0, pid=1)
    sent = knock(Challenge(nonce="n1").model_dump_json().encode(), key, hello)
    proof_line, opening_line, rest = sent.split(b"\n")
    proof = Proof.model_validate_json(proof_line)
    assert Hello.model_validate_json(opening_line) == hello and rest == b""
    assert key not in sent
    assert proven(key, "n1", proof)
    assert not proven(key, "n2", proof)  # overheard, it opens no other connection
    assert not proven(SECRET, "n1", proof)


def test_a_knock_at_something_that_is_no_hub_fails() -> None:
    with pytest.raises(ValidationError):
        knock(b"", SECRET, Hello(run_id="r", rank=0, generation=0, pid=1))
