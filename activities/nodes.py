"""The supervisor's activities that act on nodes: each carries one request (core.messages.control) to the node
agents of a run, many at once, over their hubs, whose addresses the fleet keeps.

This is the run's fan-out to its nodes. It lives in activities, not in workflow history: whatever the
width, a launch is one local activity, and a node that does not answer is named in the result (a lost
node to replace), never an error that fails the run.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import structlog
from temporalio import activity

from stayalive.activities.fleet import FleetActivities
from stayalive.activities.hubs import NoAnswer, ask, ask_each
from stayalive.core.fleet.model import SelfTestResult
from stayalive.core.fleet.requests import SelfTestInput
from stayalive.core.judgement.hangs import SITE_NAMES, CollectiveProgress, HangFinding, find_culprit, stack_groups
from stayalive.core.messages.control import (
    CommandRanks,
    DumpStacks,
    HangInput,
    HangStacks,
    Prepare,
    Prepared,
    Released,
    ReleaseRanks,
    ReleaseRun,
    RunSelfTest,
    SelfTested,
    SendCommand,
    Sent,
    StackDump,
    StartRanks,
)
from stayalive.core.run.launch import Launch, Launched, NodeLaunch
from stayalive.training.checkpoint import within_root, write_fence

log = structlog.get_logger()

# Starting ranks takes longer than answering: the fork server may still be warming up.
START_ALLOWANCE_S = 60.0
COMMAND_WITHIN_S = 10.0
STACKS_WITHIN_S = 15.0  # the agent waits up to 3 s for its ranks' dumps
RELEASE_WITHIN_S = 30.0  # ranks get 5 s after SIGTERM before SIGKILL
SELF_TEST_LIMIT_S = 600.0
HEARTBEAT_S = 5.0


class NodeActivities:
    def __init__(self, fleet: FleetActivities, secret: bytes) -> None:
        self.fleet = fleet
        self.secret = secret  # the fleet's: what the agents' hubs take for the supervisor's requests

    @activity.defn
    async def launch(self, request: Launch) -> Launched:
        """Every node's agent is asked whether it is there (the first opens the generation's fresh
        rendezvous store); only when all answered is each sent its part of the generation."""
        nodes, host = request.nodes, request.nodes[0]
        if request.checkpoint_dir is not None:
            await asyncio.to_thread(raise_fence, request.run_id, Path(request.checkpoint_dir), request.generation)
        hubs = await self.fleet.hubs(nodes)
        ready, missing = await ask_each(
            hubs,
            nodes,
            lambda node: Prepare(
                run_id=request.run_id,
                generation=request.generation,
                open_store=node == host,
                backend=request.backend,
                ranks_per_node=request.ranks_per_node,
                workdir=request.workdir,
            ),
            request.answer_within,
            self.secret,
        )
        refused = {node: a.refused for node, a in ready.items() if isinstance(a, Prepared) and a.refused}
        if missing or refused:
            log.warning(
                "launch: nodes did not answer or refused",
                run_id=request.run_id,
                unreachable=sorted(missing),
                refused=refused,
            )
            return Launched(unreachable=missing, refused=refused)
        prepared = ready[host]
        assert isinstance(prepared, Prepared) and prepared.rendezvous is not None
        index = {node: i for i, node in enumerate(nodes)}
        _, missing = await ask_each(
            hubs,
            nodes,
            lambda node: StartRanks(launch=NodeLaunch.of(request, index[node], prepared.rendezvous)),  # type: ignore[arg-type]
            request.answer_within + START_ALLOWANCE_S,
            self.secret,
        )
        log.info(
            "generation launched",
            run_id=request.run_id,
            generation=request.generation,
            nodes=len(nodes),
            unreachable=sorted(missing),
        )
        return Launched(rendezvous=str(prepared.rendezvous), unreachable=missing)

    @activity.defn
    async def command(self, request: CommandRanks) -> int:
        """The command to every rank of the run on these nodes; how many ranks it reached. A node that
        did not take it is lost or about to be, which the run monitor reports."""
        hubs = await self.fleet.hubs(request.nodes)
        sent, missing = await ask_each(
            hubs,
            request.nodes,
            lambda _: SendCommand(run_id=request.run_id, command=request.command),
            COMMAND_WITHIN_S,
            self.secret,
        )
        if missing:
            log.warning("command not delivered everywhere", run_id=request.run_id, unreachable=sorted(missing))
        return sum(answer.reached for answer in sent.values() if isinstance(answer, Sent))

    @activity.defn
    async def release(self, request: ReleaseRanks) -> int:
        """Stop the run's ranks on these nodes and free its memory there; how many were still running.
        A node whose agent is gone has nothing left to release."""
        hubs = await self.fleet.hubs(request.nodes)
        released, missing = await ask_each(
            hubs, request.nodes, lambda _: ReleaseRun(run_id=request.run_id), RELEASE_WITHIN_S, self.secret
        )
        if missing:
            log.warning("release: nodes did not answer", run_id=request.run_id, unreachable=sorted(missing))
        return sum(answer.stopped for answer in released.values() if isinstance(answer, Released))

    @activity.defn
    async def dump_stacks(self, request: HangInput) -> HangStacks:
        """Every live rank's Python stacks and collective counts, kept in one file under the run's
        directory: the counts, each distinct stack once with the ranks that share it, and the culprit
        they point at (core/judgement/hangs.py: the counts first, then the stacks)."""
        hubs = await self.fleet.hubs(request.nodes)
        async with _heartbeating():
            dumps, missing = await ask_each(
                hubs, request.nodes, lambda _: DumpStacks(run_id=request.run_id), STACKS_WITHIN_S, self.secret
            )
        answered = [d for d in dumps.values() if isinstance(d, StackDump)]
        stacks = {rank: text for d in answered for rank, text in d.stacks.items()}
        progress = {rank: p for d in answered for rank, p in d.progress.items()}
        found = find_culprit(stacks, progress, request.generation)
        artifact = _write(request, stacks, progress, found, missing) if stacks else None
        log.info("stacks dumped", run_id=request.run_id, ranks=len(stacks), culprit=found.culprit, artifact=artifact)
        return HangStacks(
            culprit=found.culprit,
            suspects=found.suspects[:8],
            ranks_dumped=len(stacks),
            artifact=artifact,
            summary=found.summary,
        )

    @activity.defn
    async def self_test(self, input: SelfTestInput) -> SelfTestResult:
        """Ask a quarantined node's agent to vacate the node and run its checks. An agent that cannot
        be reached within `answer_within` has not run it: the node stays quarantined. Each try asks
        the fleet where the node's agent listens now: one that was restarted (a lost node, back)
        registered a new address, and it is that agent that must answer."""
        deadline = asyncio.get_running_loop().time() + input.answer_within
        async with _heartbeating():
            while True:
                hub = (await self.fleet.hubs([input.node])).get(input.node, input.hub)
                try:
                    answer = await ask(hub, RunSelfTest(node=input.node), SELF_TEST_LIMIT_S, self.secret)
                except NoAnswer as exc:
                    if asyncio.get_running_loop().time() < deadline and "unreachable" in str(exc):
                        await asyncio.sleep(1.0)
                        continue
                    detail = (
                        f"self-test not started: the node agent did not pick it up within {input.answer_within:g}s "
                        f"(agent down?): {exc}"
                    )
                    return SelfTestResult(node=input.node, passed=False, checks={}, detail=detail, at=datetime.now(UTC))
                assert isinstance(answer, SelfTested)
                return answer.result


def raise_fence(run_id: str, directory: Path, generation: int) -> None:
    """Before any rank of `generation` starts: no older generation commits a checkpoint of the run
    from now on (core/decisions/fencing.py). The first generation has nothing older, and no directory yet."""
    if not directory.is_dir():
        if generation > 0:
            log.warning("checkpoint directory unreachable: fence not raised", run_id=run_id, generation=generation)
        return
    try:
        write_fence(directory, generation)
    except OSError as exc:  # storage is away: nothing lands there now, and the keeper reads the fence later
        log.warning("fence not raised", run_id=run_id, generation=generation, error=str(exc))


def _shown(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks[:16]) + (f", … ({len(ranks)} ranks)" if len(ranks) > 16 else "")


def _write(
    request: HangInput,
    stacks: dict[int, str],
    progress: dict[int, CollectiveProgress],
    found: HangFinding,
    missing: dict[str, str],
) -> str:
    """One file a person reads: the finding, each rank's collective counts (ranks that agree, on
    one line), then each distinct main-thread stack with its ranks."""
    groups = stack_groups(stacks)
    distinct = f"{len(groups)} distinct main-thread stacks"
    if len(groups) == 1:
        distinct = "one main-thread stack, the same on every rank"
    lines = [
        f"run {request.run_id}, generation {request.generation}: no step after {request.step}",
        found.summary,
        f"{len(stacks)} ranks dumped their stacks; {distinct}",
        *(f"no stacks from {node}: {why}" for node, why in sorted(missing.items())),
        "",
    ]
    counts: dict[tuple[int, int, int, int], list[int]] = defaultdict(list)
    for rank in sorted(stacks.keys() & progress.keys()):
        seen = progress[rank].of(request.generation)
        counts[(seen.entered, seen.completed, seen.step, seen.site)].append(rank)
    if counts:
        lines.append(f"collectives entered / completed in generation {request.generation} (ranks that keep counts)")
    top = max((entered for entered, *_ in counts), default=0)
    for (entered, completed, step, site), ranks in sorted(counts.items()):
        marker = "  <- behind" if entered < top else ""
        where = SITE_NAMES.get(site, "none yet")
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_shown(ranks)}"
        lines.append(f"   {entered} / {completed}, step {step}, newest: {where}: {who}{marker}")
    if uncounted := sorted(stacks.keys() - progress.keys()):
        lines.append(f"   no counts: ranks {_shown(uncounted)}")
    lines.append("")
    for ranks in groups:
        marker = "  <- stands out" if set(ranks) & set(found.odd_stacks) else ""
        lines += [f"== ranks {_shown(ranks)}{marker}", stacks[ranks[0]].rstrip() or "(no Python frames)", ""]
    directory = within_root(request.directory, Path(request.directory) / "incidents")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"hang-g{request.generation}-step{request.step}.txt"
    path.write_text("\n".join(lines))
    return str(path)


@contextlib.asynccontextmanager
async def _heartbeating() -> AsyncIterator[None]:
    """Heartbeat while a long answer is awaited, so the activity is not taken for dead."""

    async def beat() -> None:
        while True:
            activity.heartbeat()
            await asyncio.sleep(HEARTBEAT_S)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
