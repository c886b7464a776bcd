"""Ranks start with exactly the environment torchrun gives its workers."""

from __future__ import annotations

import pytest

from stayalive.core.run.launch import Endpoint, NodeLaunch, assign_ranks, rank_env

STORE = Endpoint(host="127.0.0.1", port=41000)


def test_ranks_are_contiguous_per_node() -> None:
    assert assign_ranks(["a", "b", "c"], 2) == {"a": [0, 1], "b": [2, 3], "c": [4, 5]}


def test_rank_env_is_torchruns_with_a_fresh_store_namespace_per_generation() -> None:
    launch = NodeLaunch(
        run_id="r/1",
        node="b",
        generation=3,
        ranks=[2, 3],
        world_size=4,
        rendezvous=Endpoint(host="10.0.0.1", port=29500),
        entrypoint=["python", "x.py"],
        env={"STAYALIVE_RUN_ID": "r/1"},
    )
    env = rank_env(launch, local_rank=1, store=STORE)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")} == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
    }
    # The store is reached through this node's agent (its relay), never at the store host directly.
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "41000")
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert env["TORCHELASTIC_RESTART_COUNT"] == "3"
    assert env["STAYALIVE_RUN_ID"] == "r/1"


@pytest.mark.parametrize(
    ("ranks", "spec_env", "agent_env", "threads"),
    [
        ([2, 3], {}, {}, "1"),  # torchrun's default for several ranks on a node
        ([2], {}, {}, None),  # one rank: torch's own default, every core
        ([2, 3], {"OMP_NUM_THREADS": "4"}, {}, "4"),  # the spec chose
        ([2, 3], {}, {"OMP_NUM_THREADS": "8"}, None),  # the agent's environment chose: the rank inherits it
    ],
)
def test_ranks_sharing_a_node_get_one_thread_each_unless_someone_chose(
    ranks: list[int], spec_env: dict[str, str], agent_env: dict[str, str], threads: str | None
) -> None:
    launch = NodeLaunch(
        run_id="r/1",
        node="b",
        generation=0,
        ranks=ranks,
        world_size=4,
        rendezvous=Endpoint(host="10.0.0.1", port=29500),
        entrypoint=["python", "x.py"],
        env=spec_env,
    )
    assert rank_env(launch, local_rank=0, store=STORE, inherited=agent_env).get("OMP_NUM_THREADS") == threads
