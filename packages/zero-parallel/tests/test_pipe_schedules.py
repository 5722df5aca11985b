"""Pipeline schedules, partitions and topologies read as data (no ranks, no model), against DeepSpeed 0.19.8:

* ``TrainSchedule`` (1F1B) gives DeepSpeed's instruction lists; for every degree and micro-batch count each stage
  runs each micro-batch's forward then backward once, every send meets its receive in the same step on the
  neighbouring stage, a buffer slot is never reused while its micro-batch is in flight, and the last step reduces
  and steps;
* ``InferenceSchedule`` runs each micro-batch forward once per stage with matched transfers;
* ``partition_uniform`` / ``partition_balanced`` cut where DeepSpeed cuts (values computed by DeepSpeed);
* ``ProcessTopology`` answers DeepSpeed's documented examples;
* the interleaved 1F1B schedule (virtual stages, Megatron's order) runs every chunk's forward and backward of every
  micro-batch exactly once without deadlock when sends never block and receives wait;
* the zero-bubble schedule (ZB-H1) runs every micro-batch's forward, input-gradient and weight-gradient passes
  once each, in that order, without deadlock, its forwards and input passes in 1F1B's order, its weight passes
  deferred into the cool-down, and no more than ``2 * (stages - 1 - stage) + 1`` graphs held at once.
"""

import pytest

from zero_parallel.pipe import (
    BackwardInputPass,
    BackwardPass,
    BackwardWeightPass,
    ForwardPass,
    InferenceSchedule,
    InterleavedInferenceSchedule,
    InterleavedTrainSchedule,
    LoadMicroBatch,
    OptimizerStep,
    PipeModelDataParallelTopology,
    ProcessTopology,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    TrainSchedule,
    ZeroBubbleTrainSchedule,
    partition_balanced,
    partition_uniform,
)


def _names(steps):
    return [[(type(c).__name__, getattr(c, "buffer_id", None)) for c in step] for step in steps]


def test_train_schedule_gives_deepspeeds_instructions_for_three_micro_batches_on_two_stages():
    first = [[("LoadMicroBatch", 0), ("ForwardPass", 0)], [("SendActivation", 0)],
             [("LoadMicroBatch", 1), ("ForwardPass", 1)],
             [("RecvGrad", 0), ("SendActivation", 1), ("BackwardPass", 0)],
             [("LoadMicroBatch", 0), ("ForwardPass", 0)],
             [("RecvGrad", 1), ("SendActivation", 0), ("BackwardPass", 1)], [],
             [("RecvGrad", 0), ("BackwardPass", 0), ("ReduceTiedGrads", None), ("ReduceGrads", None),
              ("OptimizerStep", None)]]  # fmt: skip
    last = [[], [("RecvActivation", 0), ("LoadMicroBatch", 0), ("ForwardPass", 0)], [("BackwardPass", 0)],
            [("SendGrad", 0), ("RecvActivation", 1), ("LoadMicroBatch", 1), ("ForwardPass", 1)],
            [("BackwardPass", 1)], [("SendGrad", 1), ("RecvActivation", 0), ("LoadMicroBatch", 0), ("ForwardPass", 0)],
            [("BackwardPass", 0)],
            [("SendGrad", 0), ("ReduceTiedGrads", None), ("ReduceGrads", None), ("OptimizerStep", None)]]  # fmt: skip
    assert _names(TrainSchedule(3, 2, 0).steps()) == first
    assert _names(TrainSchedule(3, 2, 1).steps()) == last
    assert [TrainSchedule(3, 4, s).num_pipe_buffers() for s in range(4)] == [3, 3, 2, 2]


def _count(step, kind) -> int:
    return sum(isinstance(c, kind) for c in step)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("micro_batches", [1, 2, 3, 5])
def test_train_schedule_runs_each_micro_batch_once_with_matched_transfers(stages, micro_batches):
    plans = [TrainSchedule(micro_batches, stages, s) for s in range(stages)]
    all_steps = [p.steps() for p in plans]
    assert len({len(s) for s in all_steps}) == 1
    for s, (plan, steps) in enumerate(zip(plans, all_steps, strict=True)):
        slots: dict[int, int] = {}  # buffer -> micro-batch in flight there
        forwards = backwards = 0
        for t, step in enumerate(steps):
            if s + 1 < stages:  # every send has its receive on the neighbour in the same step
                assert _count(step, SendActivation) == _count(all_steps[s + 1][t], RecvActivation)
                assert _count(step, RecvGrad) == _count(all_steps[s + 1][t], SendGrad)
            for cmd in step:
                if isinstance(cmd, ForwardPass):
                    assert cmd.buffer_id not in slots, f"stage {s} step {t}: slot {cmd.buffer_id} still in flight"
                    slots[cmd.buffer_id] = forwards
                    forwards += 1
                elif isinstance(cmd, BackwardPass):
                    assert slots.pop(cmd.buffer_id) == backwards  # backwards in micro-batch order
                    backwards += 1
            assert len(slots) <= plan.num_pipe_buffers()
        assert forwards == backwards == micro_batches and not slots
        loads = sum(_count(step, LoadMicroBatch) for step in steps)
        assert loads == (micro_batches if s in (0, stages - 1) else 0)
        assert [type(c) for c in steps[-1][-3:]] == [ReduceTiedGrads, ReduceGrads, OptimizerStep]


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("micro_batches", [1, 2, 4])
def test_inference_schedule_runs_each_micro_batch_forward_once(stages, micro_batches):
    all_steps = [InferenceSchedule(micro_batches, stages, s).steps() for s in range(stages)]
    for s, steps in enumerate(all_steps):
        assert len(steps) == micro_batches + stages - 1
        assert sum(_count(step, ForwardPass) for step in steps) == micro_batches
        assert not any(_count(step, BackwardPass) or _count(step, OptimizerStep) for step in steps)
        for t, step in enumerate(steps):
            if s + 1 < stages:
                assert _count(step, SendActivation) == _count(all_steps[s + 1][t], RecvActivation)


def test_schedules_refuse_bad_sizes():
    with pytest.raises(ValueError, match="micro_batches must be an int >= 1"):
        TrainSchedule(0, 2, 0)
    with pytest.raises(ValueError, match=r"stage_id must be in 0\.\.1"):
        InferenceSchedule(2, 2, 2)


@pytest.mark.parametrize(
    ("weights", "parts", "deepspeed"),
    [([48, 0, 64, 0, 48], 2, [0, 4, 5]), ([48, 0, 64, 0, 48], 3, [0, 2, 4, 5]), ([1] * 7, 3, [0, 3, 5, 7]),
     ([0, 5, 0, 5, 0, 5], 3, [0, 3, 5, 6]), ([10, 1, 1, 1, 1, 10], 2, [0, 3, 6]), ([0, 0, 0, 0], 2, [0, 3, 4]),
     ([3, 3], 3, [0, 1, 2, 2])],
)  # fmt: skip
def test_balanced_partition_cuts_where_deepspeed_cuts(weights, parts, deepspeed):
    assert partition_balanced(weights, parts) == deepspeed


def test_uniform_partition_cuts_where_deepspeed_cuts():
    got = [partition_uniform(n, m) for n, m in [(5, 2), (7, 3), (2, 4), (8, 4)]]
    assert got == [[0, 3, 5], [0, 3, 5, 7], [0, 1, 2, 2, 2], [0, 2, 4, 6, 8]]


def test_topology_answers_deepspeeds_examples():
    topo = ProcessTopology(axes=["pipe", "data", "model"], dims=[2, 2, 2])
    assert topo.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.filter_match(pipe=0, data=1) == [2, 3]
    assert topo.get_rank(pipe=1, data=0, model=1) == 5 and topo.get_coord(5) == (1, 0, 1)
    assert topo.get_dim("model") == 2 and topo.get_dim("expert") == 0 and topo.world_size() == 8
    assert ProcessTopology(axes=["a", "b"], dims=[2, 2]).get_rank_repr(rank=3, omit_axes=[]) == "a_01-b_01"
    assert ProcessTopology(axes=["x", "y"], dims=[2, 3]).get_axis_list(axis="y", idx=0) == [0, 3]
    three_d = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=3)
    assert three_d.get_axis_names() == ["pipe", "data", "model"] and three_d.dims == [2, 3, 2]
    with pytest.raises(ValueError, match="one coordinate per axis"):
        topo.get_rank(pipe=0)
    with pytest.raises(ValueError, match="must be an int >= 1"):
        ProcessTopology(["pipe"], [0])


def _simulate(plans, stages: int, virtual: int, micro_batches: int) -> None:
    """Run every rank's instructions with sends that never block and receives that wait for their send; fail on a
    deadlock, a forward without its input, or a backward before its forward or its gradient."""
    queues = [[c for step in p.steps() for c in step] for p in plans]
    pcs, sent, done = [0] * stages, set(), set()
    last = stages * virtual - 1
    while any(pc < len(q) for pc, q in zip(pcs, queues, strict=True)):
        moved = False
        for r in range(stages):
            while pcs[r] < len(queues[r]):
                cmd = queues[r][pcs[r]]
                if not hasattr(cmd, "buffer_id"):
                    pcs[r] += 1
                    continue
                v, mb = cmd.chunk * stages + r, cmd.buffer_id % micro_batches
                if isinstance(cmd, RecvActivation) and ("act", v - 1, mb) not in sent:
                    break
                if isinstance(cmd, RecvGrad) and ("grad", v + 1, mb) not in sent:
                    break
                if isinstance(cmd, SendActivation):
                    sent.add(("act", v, mb))
                elif isinstance(cmd, SendGrad):
                    sent.add(("grad", v, mb))
                elif isinstance(cmd, ForwardPass):
                    assert v == 0 or ("act", v - 1, mb) in sent
                    done.add(("F", v, mb))
                elif isinstance(cmd, BackwardPass | BackwardInputPass):
                    assert ("F", v, mb) in done and (v == last or ("grad", v + 1, mb) in sent)
                    assert ("B", v, mb) not in done
                    done.add(("B", v, mb))
                elif isinstance(cmd, BackwardWeightPass):
                    assert ("B", v, mb) in done and ("W", v, mb) not in done
                    done.add(("W", v, mb))
                pcs[r] += 1
                moved = True
        assert moved, f"deadlock: ranks stopped at {[q[pc] if pc < len(q) else None for pc, q in zip(pcs, queues)]}"
    kinds = ("F",) if getattr(plans[0], "forward_only", False) else ("F", "B")
    if isinstance(plans[0], ZeroBubbleTrainSchedule):
        kinds = ("F", "B", "W")
    assert done == {(k, v, m) for k in kinds for v in range(last + 1) for m in range(micro_batches)}


@pytest.mark.parametrize(("stages", "virtual"), [(1, 2), (2, 2), (3, 2), (2, 3), (4, 2)])
@pytest.mark.parametrize("groups", [1, 2])
def test_interleaved_schedule_runs_every_chunk_and_micro_batch_without_deadlock(stages, virtual, groups):
    micro_batches = stages * groups
    train = [InterleavedTrainSchedule(micro_batches, stages, r, virtual) for r in range(stages)]
    _simulate(train, stages, virtual, micro_batches)
    for plan in train:
        assert [type(c) for c in plan.steps()[-1][-3:]] == [ReduceTiedGrads, ReduceGrads, OptimizerStep]
    _simulate([InterleavedInferenceSchedule(micro_batches, stages, r, virtual) for r in range(stages)], stages,
              virtual, micro_batches)  # fmt: skip


def test_interleaved_schedule_orders_work_as_megatron_does():
    # rank 0 of 2 with 2 chunks and 4 micro-batches: a warm-up of 4 forwards (2 per chunk), then 1F1B, chunk 1's
    # backwards first
    plan = InterleavedTrainSchedule(4, 2, 0, 2)
    work = [(type(c).__name__[0], c.chunk, c.buffer_id % 4) for step in plan.steps() for c in step
            if isinstance(c, ForwardPass | BackwardPass)]  # fmt: skip
    assert work == [("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1), ("F", 0, 2), ("B", 1, 0), ("F", 0, 3),
                    ("B", 1, 1), ("F", 1, 2), ("B", 0, 0), ("F", 1, 3), ("B", 0, 1), ("B", 1, 2), ("B", 1, 3),
                    ("B", 0, 2), ("B", 0, 3)]  # fmt: skip
    with pytest.raises(ValueError, match="must be a multiple of stages=2"):
        InterleavedTrainSchedule(3, 2, 0, 2)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("micro_batches", [1, 3, 5, 8])
def test_one_chunk_interleaved_order_is_1f1b_with_a_longer_warm_up_for_any_micro_batch_count(stages, micro_batches):
    plans = [InterleavedTrainSchedule(micro_batches, stages, s, 1) for s in range(stages)]
    _simulate(plans, stages, 1, micro_batches)
    for s, plan in enumerate(plans):
        work = [(type(c) is ForwardPass, c.buffer_id) for step in plan.steps() for c in step
                if isinstance(c, ForwardPass | BackwardPass)]  # fmt: skip
        assert [mb for forward, mb in work if not forward] == list(range(micro_batches))  # 1F1B's gradient order
        warm = min(2 * (stages - s - 1), micro_batches)
        assert work[:warm] == [(True, mb) for mb in range(warm)] and (warm == micro_batches or not work[warm + 1][0])
        held = peak = 0
        for forward, _ in work:
            held += 1 if forward else -1
            peak = max(peak, held)
        assert peak == min(warm + 1, micro_batches)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("micro_batches", [1, 2, 3, 4, 6])
def test_zero_bubble_schedule_runs_each_pass_once_without_deadlock(stages, micro_batches):
    plans = [ZeroBubbleTrainSchedule(micro_batches, stages, s) for s in range(stages)]
    _simulate(plans, stages, 1, micro_batches)
    for s, plan in enumerate(plans):
        steps = plan.steps()
        assert [type(c) for c in steps[-1][-3:]] == [ReduceTiedGrads, ReduceGrads, OptimizerStep]
        work = [c for step in steps for c in step if isinstance(c, ForwardPass | BackwardInputPass)]
        one_f_one_b = [c for step in TrainSchedule(micro_batches, stages, s).steps() for c in step
                       if isinstance(c, ForwardPass | BackwardPass)]  # fmt: skip
        assert [(type(c) is ForwardPass) for c in work] == [(type(c) is ForwardPass) for c in one_f_one_b]
        held = peak = 0
        for c in (c for step in steps for c in step):
            held += isinstance(c, ForwardPass) - isinstance(c, BackwardWeightPass)
            peak = max(peak, held)
        assert peak == min(2 * (stages - 1 - s) + 1, micro_batches)


def test_zero_bubble_schedule_defers_weight_passes_into_the_cool_down():
    # first of 3 stages, 4 micro-batches: 2 warm-up forwards, W deferred by 2, one W after each cool-down B
    work = [(type(c).__name__[:9], c.buffer_id) for step in ZeroBubbleTrainSchedule(4, 3, 0).steps() for c in step
            if isinstance(c, ForwardPass | BackwardInputPass | BackwardWeightPass)]  # fmt: skip
    assert work == [("ForwardPa", 0), ("ForwardPa", 1), ("ForwardPa", 2), ("BackwardI", 0), ("ForwardPa", 3),
                    ("BackwardI", 1), ("BackwardI", 2), ("BackwardW", 0), ("BackwardI", 3), ("BackwardW", 1),
                    ("BackwardW", 2), ("BackwardW", 3)]  # fmt: skip
    last = [type(c).__name__ for step in ZeroBubbleTrainSchedule(2, 3, 2).steps() for c in step]
    assert last[:6] == ["RecvActivation", "LoadMicroBatch", "ForwardPass", "BackwardInputPass", "SendGrad",
                        "BackwardWeightPass"]  # fmt: skip
