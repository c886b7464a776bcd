"""Step telemetry at width: a node agent's batching of its ranks' reports, the binary frame a node
sends the run monitor, and the monitor's ingest of frames into per-step vectors and its summary."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from stayalive.core.monitor.progress import CompletedStep, StepBatcher, StepIngest
from stayalive.core.protocol.telemetry import (
    NodeSteps,
    Record,
    StepReport,
    frame_seq,
    pack_steps,
    rank_message,
    steps_frame,
)
from stayalive.core.run.status import Progress

NODE = range(8, 12)  # the node under test holds global ranks 8-11
GEN = 1


def report(rank: int, step: int, generation: int = GEN) -> StepReport:
    """Values derived from rank and step, so any of them can be checked where it lands."""
    return StepReport(
        rank=rank,
        generation=generation,
        step=step,
        compute_s=step + rank / 100,
        step_s=step + 0.5 + rank / 100,
        loss=None if rank == 10 and step == 2 else 2.0 + rank / 100,  # rank 10's step 2 was skipped
        samples=[rank, step],
        at=1000.0 + step + rank / 100,
    )


# ── node agent: StepBatcher ──────────────────────────────────────────────────────────────────────────

FLUSH = "flush"
# (reports as (rank, step[, generation]) or FLUSH, what comes out: (at which entry, step, missing ranks))
BATCHING = [
    pytest.param([(8, 1), (9, 1), (10, 1), (11, 1)], [(3, 1, ())], id="complete on the node's last report"),
    pytest.param([(11, 1), (9, 1), (8, 1), (10, 1)], [(3, 1, ())], id="in any order of ranks"),
    pytest.param([(8, 1), (9, 1), (10, 1)], [], id="incomplete: nothing yet"),
    pytest.param(
        [(8, 1), (9, 1), (10, 1), (8, 2), (9, 2), (10, 2), (11, 2)],
        [(6, 1, (11,)), (6, 2, ())],
        id="a lost report: partial once a newer step is complete",
    ),
    pytest.param(
        [(8, 1), (9, 1), (10, 1), (8, 2), (8, 3), (8, 4), (8, 5)],
        [(6, 1, (11,))],
        id="a rank lag steps ahead gives the oldest step up",
    ),
    pytest.param(
        [(8, 1), (8, 2), (8, 3), (8, 4), (8, 5), (8, 6)],
        [(4, 1, (9, 10, 11)), (5, 2, (9, 10, 11))],
        id="one at a time as the rank moves on",
    ),
    pytest.param([(8, 1), (9, 1), FLUSH], [(2, 1, (10, 11))], id="flush: what is pending, partial"),
    pytest.param(
        [(8, 1), (8, 2), (9, 2), FLUSH, (9, 1), (10, 2)], [(3, 1, (9, 10, 11)), (3, 2, (10, 11))], id="flush in order"
    ),
    pytest.param([FLUSH], [], id="flush with nothing pending"),
    pytest.param([(8, 1, 2), (9, 1, 2), (10, 1, 2), (11, 1, 2), (8, 1, 0)], [], id="other generations ignored"),
    pytest.param([(7, 1), (12, 1), (8, 1), (9, 1), (10, 1), (11, 1)], [(5, 1, ())], id="another node's ranks ignored"),
    pytest.param([(8, 1), (8, 1), (9, 1), (10, 1), (11, 1)], [(4, 1, ())], id="a report sent twice counts once"),
    pytest.param(
        [(8, 1), (9, 1), (10, 1), (11, 1), (8, 1), (9, 2), (8, 2), (10, 2), (11, 2)],
        [(3, 1, ()), (8, 2, ())],
        id="a report for a step already out is dropped",
    ),
    pytest.param([(8, 5), (9, 1), (9, 5), (10, 5), (11, 5)], [(4, 5, ())], id="a report lag steps late is dropped"),
]


@pytest.mark.parametrize(("entries", "expected"), BATCHING)
def test_batching(entries: list[tuple[int, ...] | str], expected: list[tuple[int, int, tuple[int, ...]]]) -> None:
    batcher = StepBatcher(GEN, NODE, lag=4)
    out: list[tuple[int, NodeSteps]] = []
    for i, entry in enumerate(entries):
        batches = batcher.flush() if entry == FLUSH else batcher.add(report(*entry))
        out += [(i, batch) for batch in batches]
    assert [(i, b.step, missing_ranks(b)) for i, b in out] == expected
    for _, batch in out:
        assert (batch.generation, batch.first_rank) == (GEN, NODE.start)
        for rank in set(NODE) - set(missing_ranks(batch)):
            sent = report(rank, batch.step)
            i = rank - NODE.start
            assert (batch.compute_s[i], batch.step_s[i]) == (sent.compute_s, sent.step_s)
            assert (batch.loss[i], batch.samples[i]) == (sent.loss, sent.samples)
        for rank in missing_ranks(batch):
            i = rank - NODE.start
            assert (batch.loss[i], batch.samples[i], math.isnan(batch.step_s[i])) == (None, [], True)
        assert batch.at == max(report(r, batch.step).at for r in NODE if r not in missing_ranks(batch))


def missing_ranks(batch: NodeSteps) -> tuple[int, ...]:
    return tuple(batch.first_rank + i for i, s in enumerate(batch.compute_s) if math.isnan(s))


def test_batching_memory_is_bounded_by_lag_with_a_dead_rank() -> None:
    batcher = StepBatcher(GEN, NODE, lag=4)
    steps = []
    for step in range(1, 1001):
        for rank in (8, 9, 10):  # rank 11 died without its agent noticing yet
            steps += [b.step for b in batcher.add(report(rank, step))]
            assert batcher.steps_pending <= 4
    assert steps == list(range(1, 997))
    assert [b.step for b in batcher.flush()] == [997, 998, 999, 1000]
    assert batcher.steps_pending == 0


def test_batcher_wants_a_contiguous_range_of_ranks() -> None:
    with pytest.raises(ValueError):
        StepBatcher(GEN, range(0, 16, 2))


# ── the frame ────────────────────────────────────────────────────────────────────────────────────────


def node_steps(
    step: int,
    node: int,
    ranks: int = 4,
    generation: int = 0,
    compute_s: list[float] | None = None,
    loss: list[float | None] | None = None,
) -> NodeSteps:
    """One node's step, its values derived from node, rank and step; step seconds 0.25 over compute."""
    compute = compute_s if compute_s is not None else [step + (node * ranks + i) / 1000 for i in range(ranks)]
    return NodeSteps(
        generation=generation,
        step=step,
        first_rank=node * ranks,
        compute_s=compute,
        step_s=[c + 0.25 for c in compute],
        loss=loss if loss is not None else [2.0 + c / 10 for c in compute],
        samples=[[i] for i in range(len(compute))],
        at=100.0 + step + node / 1000,
    )


def f32(values: list[float] | list[float | None]) -> np.ndarray:
    """As the frame carries them: float32, None as NaN."""
    return np.asarray(values, dtype=np.float32)


def decode(frame: bytes, ranks: int) -> np.ndarray:
    (record,) = np.frombuffer(frame, dtype=steps_frame(ranks))
    return record


FRAMES = [
    pytest.param([0.5, 0.25, 0.125, 1.5], [0.5, 0.25, 0.125, 1.5], id="full"),
    pytest.param([0.5, 0.25], [0.5, 0.25, math.nan, math.nan], id="fewer ranks: NaN-padded"),
    pytest.param([0.5, math.nan, 0.25, 1.0], [0.5, math.nan, 0.25, 1.0], id="a rank that did not report"),
]


@pytest.mark.parametrize(("values", "framed"), FRAMES)
def test_a_frame_round_trips(values: list[float], framed: list[float]) -> None:
    steps = node_steps(7, 3, compute_s=values, loss=[*[1.5] * (len(values) - 1), None])
    frame = pack_steps(42, steps, 4)
    assert len(frame) == steps_frame(4).itemsize == 32 + 12 * 4
    record = decode(frame, 4)
    assert (record["seq"], record["generation"], record["first_rank"], record["step"]) == (42, 0, 12, 7)
    assert record["at"] == steps.at
    assert frame_seq(frame) == 42
    np.testing.assert_array_equal(record["compute"], f32(framed))
    np.testing.assert_array_equal(record["step_s"], f32([x + 0.25 for x in framed]))
    expected_loss = [*[1.5] * (len(values) - 1), math.nan] + [math.nan] * (4 - len(values))
    np.testing.assert_array_equal(record["loss"], f32(expected_loss))


@pytest.mark.parametrize("loss", [None, math.inf, -math.inf, math.nan])
def test_a_loss_that_is_not_finite_is_framed_as_nan(loss: float | None) -> None:
    record = decode(pack_steps(1, node_steps(1, 0, loss=[1.0, loss, 1.0, 1.0]), 4), 4)
    assert np.isnan(record["loss"]).tolist() == [False, True, False, False]


def test_a_frame_holds_no_more_ranks_than_a_node_has() -> None:
    with pytest.raises(ValueError):
        pack_steps(1, node_steps(1, 0, ranks=8), 4)


def test_node_steps_travel_as_a_json_record_with_their_nans() -> None:
    steps = node_steps(3, 1, compute_s=[0.5, math.nan, 0.25, 0.125])
    line = Record(seq=9, node="n1", message=steps).model_dump_json()
    back = Record.model_validate_json(line).message
    assert isinstance(back, NodeSteps) and back.step == 3 and math.isnan(back.compute_s[1])
    assert rank_message.validate_json(steps.model_dump_json()).t == "steps"


# ── run monitor: StepIngest ──────────────────────────────────────────────────────────────────────────

NODES, RPN = 3, 4  # 12 ranks
# Which (node, step) frames arrive, and what completes: (step, nodes missing in it). Lag 4 throughout.
INGEST = [
    pytest.param([(n, 1) for n in range(NODES)], [(1, ())], id="every node in: complete"),
    pytest.param([(0, 1), (1, 1)], [], id="a node's frame not yet in"),
    pytest.param(
        [(n, s) for s in (3, 1, 2) for n in (2, 0, 1)], [(1, ()), (2, ()), (3, ())], id="in step order whatever came"
    ),
    pytest.param(
        [(n, s) for s in range(1, 7) for n in (0, 2)],
        [(1, (1,)), (2, (1,))],
        id="a silent node: NaN once a frame lag steps newer is in",
    ),
    pytest.param(
        [(0, 1), (1, 1), *[(n, 2) for n in range(NODES)]], [(1, (2,)), (2, ())], id="out once a newer step is complete"
    ),
    pytest.param([(0, 1), (0, 1), (1, 1), (0, 1)], [], id="a frame sent twice counts once"),
]


def frame(node: int, step: int, generation: int = 0, first_rank: int | None = None) -> bytes:
    steps = node_steps(step, node, RPN, generation)
    if first_rank is not None:
        steps = steps.model_copy(update={"first_rank": first_rank})
    return pack_steps(step * NODES + node, steps, RPN)


@pytest.mark.parametrize(("arrivals", "expected"), INGEST)
def test_ingest(arrivals: list[tuple[int, int]], expected: list[tuple[int, tuple[int, ...]]]) -> None:
    ingest = StepIngest(NODES * RPN, RPN, generation=0, lag=4)
    for node, step in arrivals:
        ingest.add(frame(node, step))
    done = ingest.complete()
    assert [(s.step, missing_nodes(s)) for s in done] == expected
    for s in done:
        sent = {n: node_steps(s.step, n, RPN) for n in range(NODES) if n not in missing_nodes(s)}
        assert s.at == max(steps.at for steps in sent.values())
        assert s.step_time == float(np.nanmedian(s.step_s))
        for n, steps in sent.items():
            ranks = slice(n * RPN, (n + 1) * RPN)
            np.testing.assert_array_equal(s.compute_s[ranks], f32(steps.compute_s))
            np.testing.assert_array_equal(s.step_s[ranks], f32(steps.step_s))
            np.testing.assert_array_equal(s.loss[ranks], f32(steps.loss))
    assert ingest.complete() == []  # nothing twice


def missing_nodes(step: CompletedStep) -> tuple[int, ...]:
    assert step.compute_s.shape == step.step_s.shape == step.loss.shape == (NODES * RPN,)
    return tuple(int(n) for n in np.flatnonzero(np.isnan(step.compute_s.reshape(NODES, RPN)).all(axis=1)))


@pytest.mark.parametrize(
    "stray",
    [
        pytest.param(frame(1, 1, generation=1), id="another generation"),
        pytest.param(frame(1, 1, first_rank=5), id="a first rank inside a node"),
        pytest.param(frame(1, 1, first_rank=NODES * RPN), id="a first rank past the run"),
    ],
)
def test_ingest_drops_frames_that_are_not_its_own(stray: bytes) -> None:
    ingest = StepIngest(NODES * RPN, RPN, generation=0)
    for f in (frame(0, 1), stray, frame(2, 1)):
        ingest.add(f)
    assert ingest.complete() == []
    ingest.add(frame(1, 1))
    assert [s.step for s in ingest.complete()] == [1]


def test_a_frame_for_a_step_already_out_is_dropped() -> None:
    ingest = StepIngest(NODES * RPN, RPN, generation=0)
    for node in range(NODES):
        ingest.add(frame(node, 1))
    assert len(ingest.complete()) == 1
    ingest.add(frame(0, 1))
    assert ingest.complete() == [] and ingest.steps_pending == 0


def test_add_only_keeps_the_bytes_and_complete_decodes_them_in_bulk_or_one_by_one_alike() -> None:
    # Each node's frames in step order (its stream), the streams interleaved at random but, as in
    # synchronous training, none more than one step ahead of another.
    streams = [[(s, frame(n, s)) for s in range(1, 30) if (n, s) not in {(1, 4), (2, 9)}] for n in range(NODES)]
    streams[0].append((30, frame(0, 30, generation=7)))
    rng = random.Random(0)
    frames = []
    while any(streams):
        behind = min(stream[0][0] for stream in streams if stream)
        frames.append(rng.choice([s for s in streams if s and s[0][0] <= behind + 1]).pop(0)[1])
    bulk, single = StepIngest(NODES * RPN, RPN, 0), StepIngest(NODES * RPN, RPN, 0)
    for f in frames:
        bulk.add(f)
    assert bulk.summary() == Progress() and bulk.steps_pending == 0  # add decoded nothing
    one_by_one: list[CompletedStep] = []
    for f in frames:
        single.add(f)
        one_by_one += single.complete()
    together = bulk.complete()
    assert [s.step for s in together] == [s.step for s in one_by_one] == list(range(1, 30))
    for a, b in zip(together, one_by_one, strict=True):
        assert a.at == b.at
        for field in ("compute_s", "step_s", "loss"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert missing_nodes(together[3]) == (1,) and missing_nodes(together[8]) == (2,)
    assert bulk.summary() == single.summary()


def test_ingest_memory_is_bounded_by_lag_with_a_silent_node() -> None:
    ingest = StepIngest(NODES * RPN, RPN, generation=0, lag=4)
    out = []
    for step in range(1, 201):
        for node in (0, 1):
            ingest.add(frame(node, step))
        out += [s.step for s in ingest.complete()]
        assert ingest.steps_pending <= 4
    assert out == list(range(1, 197))


def test_ingest_wants_whole_nodes() -> None:
    with pytest.raises(ValueError):
        StepIngest(10, 4, generation=0)


# ── the summary ──────────────────────────────────────────────────────────────────────────────────────


def test_summary_before_any_step() -> None:
    assert StepIngest(8, 4, generation=0).summary() == Progress()


def test_summary_against_hand_computed_figures() -> None:
    """2 nodes of 2 ranks; step k ends at 2k s, its ranks' step seconds are k, k, k+1, k+3 (median
    k + 0.5, max k + 3). Over 60 steps the window is the last 50 (11-60)."""
    ingest = StepIngest(4, 2, generation=0)
    for k in range(1, 61):
        step_s: list[list[float]] = [[k, k], [k + 1, k + 3]]
        compute = [[0.5, 0.75], [0.25, 0.5]]
        loss: list[list[float | None]] = [[2.0, 3.0], [None, 5.0]]
        if k == 60:
            compute = [[0.5, math.nan], [0.25, 0.5]]  # rank 1's report lost in the last step
            step_s = [[k, math.nan], [k + 1, k + 3]]
        for node in (1, 0):
            steps = NodeSteps(
                generation=0,
                step=k,
                first_rank=2 * node,
                compute_s=compute[node],
                step_s=step_s[node],
                loss=loss[node],
                samples=[[], []],
                at=2.0 * k - node / 10,
            )
            ingest.add(pack_steps(k, steps, 2))
        ingest.complete()
    progress = ingest.summary()
    assert progress.step == 60
    assert progress.at == 120.0
    assert progress.steps_per_second == pytest.approx((60 - 11) / (120 - 22))
    # each step's median: k + 0.5 for k = 11..59, and for 60 (values 60, 61, 63) 61
    assert progress.step_seconds_p50 == float(np.median([k + 0.5 for k in range(11, 60)] + [61]))
    assert progress.step_seconds_max == 63.0
    assert progress.loss == pytest.approx((2.0 + 3.0 + 5.0) / 3)  # the finite ones
    assert progress.slowest_rank == 0  # rank 1 (0.75 before) is NaN now and is ignored


def test_summary_when_no_loss_is_finite_and_no_compute_reported() -> None:
    ingest = StepIngest(2, 2, generation=0)
    steps = NodeSteps(
        generation=0, step=1, first_rank=0, compute_s=[math.nan] * 2, step_s=[1.0, 2.0], loss=[None, None],
        samples=[[], []], at=5.0,
    )  # fmt: skip
    ingest.add(pack_steps(1, steps, 2))
    ingest.complete()
    progress = ingest.summary()
    assert (progress.loss, progress.slowest_rank, progress.step_seconds_p50) == (None, None, 1.5)


# ── end to end: ranks → node agents → frames → monitor ───────────────────────────────────────────────


def test_reports_batched_framed_and_ingested_land_on_their_ranks() -> None:
    nodes = [range(0, 4), range(4, 8), NODE]
    batchers = [StepBatcher(GEN, ranks) for ranks in nodes]
    ingest = StepIngest(12, 4, generation=GEN)
    seq = 0
    for step in (1, 2, 3):
        for batcher, ranks in zip(batchers, nodes, strict=True):
            for rank in ranks:
                if (rank, step) == (5, 2):
                    continue  # lost
                for batch in batcher.add(report(rank, step)):
                    seq += 1
                    ingest.add(pack_steps(seq, batch, 4))
    for batcher in batchers:  # the ranks exit
        for batch in batcher.flush():
            seq += 1
            ingest.add(pack_steps(seq, batch, 4))
    done = ingest.complete()
    assert [s.step for s in done] == [1, 2, 3]
    for s in done:
        expected = [math.nan if (rank, s.step) == (5, 2) else report(rank, s.step).compute_s for rank in range(12)]
        np.testing.assert_allclose(s.compute_s, expected, rtol=1e-6)
        assert math.isnan(s.loss[10]) == (s.step == 2)  # rank 10's loss of step 2 was not finite
