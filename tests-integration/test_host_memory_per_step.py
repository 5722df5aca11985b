"""The main job's resident memory rose step after step (``zero train``, ZeRO-3 on 2 ranks: about 3 MiB a step after
warm-up, every step a new peak). Nothing the process keeps grows per step: the Python objects and the tensors alive
after a step are the same number at step 30 as at step 10 (no list, cache, gathered unit or logging state grows),
so the growth is freed heap glibc keeps, which stage 3 training on the CPU gives back once it piles up
(``zero_core.heap_trim``; measured in docs/benchmarks.md). Run here with the main job's config on its smallest
model, and the trim's rule on a recorded resident-size curve.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from zero_comm.testing import run_ranks
from zero_core.heap_trim import FreedHeapTrim

MAIN_JOB = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.002, "betas": [0.9, 0.95], "weight_decay": 0.1}},
            "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_unit_numel": 4000000,
                                  "stage3_shared_shards": "auto"}}  # fmt: skip


def _live() -> tuple[int, int]:
    """(objects the collector tracks, tensors among them) after a full collection."""
    gc.collect()
    objects = gc.get_objects()
    return len(objects), sum(1 for o in objects if isinstance(o, torch.Tensor))


def _steps() -> dict:
    import zero
    from zero.train.model import build_model

    model = build_model("tiny", 32, 1234)
    engine, *_ = zero.initialize(model=model, config=MAIN_JOB)
    g = torch.Generator().manual_seed(dist.get_rank())
    seen = {}
    for step in range(1, 31):
        x = torch.randint(0, 256, (2, 31), generator=g)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        float(loss)
        if step in (10, 30):
            seen[step] = _live()
    trim = engine.runtime.params.heap_trim
    out = {"seen": seen, "trim_steps": None if trim is None else trim.steps}
    engine.destroy()
    return out


def test_nothing_kept_grows_per_step_at_stage3_on_the_cpu():
    for rank, out in enumerate(run_ranks(_steps, 2, timeout=600)):
        (objects_10, tensors_10), (objects_30, tensors_30) = out["seen"][10], out["seen"][30]
        assert tensors_30 == tensors_10, f"rank {rank}: {tensors_10} tensors alive at step 10, {tensors_30} at 30"
        # a handful of objects the measurement itself leaves (its first list), never one or more per step
        assert objects_30 - objects_10 < 20, f"rank {rank}: {objects_10} objects at step 10, {objects_30} at 30"
        assert out["trim_steps"] == 30, rank  # the CPU training store watches every step


def test_freed_heap_is_given_back_once_it_piles_up_and_never_at_every_step():
    mib = 2**20
    # resident size after each step: warm-up, a plateau, creeping growth, a trim's drop, a real rise (evaluation)
    curve = [900, 1000, 1050, 1080, 1100, 1100, 1102, 1104, 1150, 1158, 1100, 1104, 1300, 1302, 1304, 1306]
    trims: list[int] = []
    t = FreedHeapTrim(
        warmup_steps=5, slack=0.05, rss=lambda: curve[t.steps - 1] * mib, trim=lambda: trims.append(t.steps) or True
    )
    done = [t.after_step() for _ in curve]
    assert t.level == 1302 * mib  # the rise that a trim did not undo became the level
    # 1158 > 1100 * 1.05: trimmed at step 10; 1300 at step 13, trimmed; 1302 at step 14 still above: level moved
    assert trims == [10, 13] and t.trims == 2
    assert [i + 1 for i, d in enumerate(done) if d] == [10, 13]
    assert not any(a and b for a, b in zip(done, done[1:]))  # never two steps in a row
