"""The engine's observers from DeepSpeed's config keys, on 2 gloo ranks with a tiny model:
``comms_logger`` (counts match zero_comm's logger, O(buckets)), ``wall_clock_breakdown`` (every phase timed,
printed every ``steps_per_print``), ``flops_profiler`` (exact counts vs a single-process profile; full parameter
counts at stage 3; optimizer step not counted), ``memory_breakdown`` (runtime's bytes per category)."""

import contextlib
import copy
import io

import pytest
import torch
import torch.distributed as dist

import zero
from zero.engine.observe import EngineCommsLogger
from zero_comm import CommsLogger
from zero_comm.testing import run_ranks
from zero_profiler import FlopsProfiler

MICRO = 3


def _printed(fn, *args):
    """``(fn(*args), what it printed)``: warm workers keep the stdout they were spawned with, so capture here."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        out = fn(*args)
    return out, buf.getvalue()


def _net():
    """TinyNet (cases.md): 247 parameters, not divisible by 2, so every partition is padded."""
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(8, 13), torch.nn.GELU(), torch.nn.Linear(13, 7), torch.nn.GELU(),
                               torch.nn.Linear(7, 4))  # fmt: skip


def _cfg(stage: int, **extra):
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "steps_per_print": 1000,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}  # fmt: skip
    cfg.update(extra)
    return cfg


def _batch(step: int, micro: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    return torch.rand(MICRO, 8, generator=g) * 2 - 1


def _train_step(engine, step: int) -> None:
    xs = [_batch(step, m) for m in range(engine.gradient_accumulation_steps())]  # data ops outside any profile
    for x in xs:
        engine.backward(engine(x).square().mean())
        engine.step()


# --- comms_logger ----------------------------------------------------------------------------------------------
def comms_body(bucket: int) -> dict:
    cfg = _cfg(2, comms_logger={"enabled": True}, zero_optimization={"stage": 2, "reduce_bucket_size": bucket})
    engine, _, _, _ = zero.initialize(model=_net(), config=cfg)
    _train_step(engine, 1)  # warm-up step, also recorded by the engine's logger
    with CommsLogger() as outer:  # zero_comm's own logger around exactly one step
        _train_step(engine, 2)
    outer_counts = {n: outer.count(n) for n in {r.name for r in outer.records}}
    buckets = sum(len(g.buckets) for g in engine.runtime.flat_groups if g.group_index is not None)
    out = {"engine": engine.observer.last_comm_counts, "outer": outer_counts, "buckets": buckets,
           "total": engine.observer.comms.count(), "summary": engine.comms_summary()}  # fmt: skip
    engine.observer.close()
    return out


@pytest.mark.parametrize("bucket", [40, 10_000])
def test_comms_logger_counts_one_stage2_step_per_bucket(bucket):
    for out in run_ranks(comms_body, 2, bucket, timeout=60):
        b = out["buckets"]
        assert b == 1 if bucket == 10_000 else 1 < b < 6  # zero_core's split of 6 parameters into <= 40-element runs
        assert out["engine"] == out["outer"]  # the engine's per-step count is exactly zero_comm's
        # O(buckets), not O(parameters): one reduce-scatter and one all-gather per bucket, one norm all-reduce.
        assert out["engine"] == {"reduce_scatter_tensor": b, "all_gather_into_tensor": b, "all_reduce": 1}
        assert out["total"] == 2 * (2 * b + 1)  # both steps; the set-up broadcast precedes the logger
        assert f"| reduce_scatter_tensor | {2 * b} |" in out["summary"]


def comms_filter_body() -> dict:
    cfg = _cfg(2, comms_logger={"enabled": True, "prof_all": False, "prof_ops": ["all_gather"], "debug": True,
                                "verbose": True}, steps_per_print=1)  # fmt: skip
    engine, _, _, _ = zero.initialize(model=_net(), config=cfg)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        _train_step(engine, 1)
    out = {"counts": engine.observer.last_comm_counts, "callers": engine.observer.comms.caller_counts(),
           "printed": buf.getvalue()}  # fmt: skip
    engine.observer.close()
    return out


def test_comms_logger_prof_ops_debug_verbose_and_summary_every_steps_per_print():
    outs = run_ranks(comms_filter_body, 2, timeout=60)
    for out in outs:
        assert out["counts"] == {"all_gather_into_tensor": 1}  # prof_all false: only the listed op
        assert out["callers"] == {"all_gather_into_tensor <- zero_core.param_store.refresh": 1}
    printed = outs[0]["printed"]
    assert "comms step 1: all_gather_into_tensor torch.float32" in printed  # verbose
    assert "step 1: collectives on rank 0 (1 calls)" in printed  # summary at steps_per_print
    assert "| all_gather_into_tensor | 1 |" in printed
    assert outs[1]["printed"] == ""  # rank 0 only


def test_comms_logger_bad_prof_ops_is_a_clear_error():
    with pytest.raises(ValueError, match="prof_ops: 'allgather' names no collective"):
        EngineCommsLogger(prof_all=False, prof_ops=["allgather"])
    with pytest.raises(ValueError, match="prof_all is false and prof_ops is empty"):
        EngineCommsLogger(prof_all=False, prof_ops=[])


def no_comms_body() -> str:
    engine, _, _, _ = zero.initialize(model=_net(), config=_cfg(2))
    try:
        engine.comms_summary()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_comms_summary_without_logger_names_the_key():
    assert "comms_logger.enabled" in run_ranks(no_comms_body, 2, timeout=60)[0]


# --- wall_clock_breakdown --------------------------------------------------------------------------------------
def timers_body() -> tuple[dict, str]:
    return _printed(_timers)


def _timers() -> dict:
    import time

    cfg = _cfg(3, wall_clock_breakdown=True, steps_per_print=2, gradient_accumulation_steps=2,
               train_batch_size=2 * MICRO * 2)  # fmt: skip
    engine, _, _, _ = zero.initialize(model=_net(), config=cfg)
    seconds, walls = [], []
    for step in (1, 2):
        t0 = time.perf_counter()
        _train_step(engine, step)
        walls.append(time.perf_counter() - t0)
        seconds.append(dict(engine.observer.last_seconds))
    with torch.no_grad():  # an evaluation forward is not a training phase
        engine(_batch(9))
    _train_step(engine, 3)
    seconds.append(dict(engine.observer.last_seconds))
    return {"seconds": seconds, "walls": walls}


def test_wall_clock_breakdown_times_every_phase_and_prints_every_steps_per_print():
    results = run_ranks(timers_body, 2, timeout=60)
    for out, _ in results:
        for sec, wall in zip(out["seconds"], out["walls"]):
            assert set(sec) == {"forward", "backward", "step"}
            assert all(v > 0 for v in sec.values())
            assert sum(sec.values()) <= wall  # phases are disjoint parts of the measured step
        assert set(out["seconds"][2]) == {"forward", "backward", "step"}
    printed = results[0][1]
    assert printed.count("time per step over the last 2 step(s):") == 1  # step 2 only (steps_per_print 2)
    assert results[1][1] == ""  # rank 0 only
    for phase in ("forward", "backward", "step"):
        assert f"  {phase}: mean " in printed


# --- flops_profiler --------------------------------------------------------------------------------------------
def flops_body(stage: int, tmp: str) -> tuple[dict, str]:
    return _printed(_flops, stage, tmp)


def _flops(stage: int, tmp: str) -> dict:
    fp = {"enabled": True, "profile_step": 2, "module_depth": 1, "top_modules": 2, "detailed": True,
          "output_file": f"{tmp}/flops-{dist.get_rank()}.json"}  # fmt: skip
    cfg = _cfg(stage, flops_profiler=fp, gradient_accumulation_steps=2, train_batch_size=2 * MICRO * 2)
    model = _net()
    ref = copy.deepcopy(model)
    engine, _, _, _ = zero.initialize(model=model, config=cfg)
    _train_step(engine, 1)
    assert engine.observer.flops is None and engine.observer.last_profile is None  # not profiling step 1
    _train_step(engine, 2)
    prof = engine.observer.last_profile
    xs = [_batch(2, m) for m in range(2)]
    with FlopsProfiler(ref) as rp:  # single-process reference: the same two micro-batches, plain PyTorch
        for x in xs:
            (ref(x).square().mean() / 2).backward()
    r = rp.profile
    shard = sum(g.shard_numel for g in engine.runtime.flat_groups if g.group_index is not None)
    w = torch.nn.Parameter(torch.zeros(shard))
    w.grad = torch.ones(shard)
    opt = torch.optim.AdamW([w], lr=1e-2)
    with FlopsProfiler(torch.nn.Module()) as op:  # what one AdamW step on this rank's shard would add
        opt.step()
    return {"shard": shard, "adam_flops": op.profile.outside.flops, "params": prof.total_params,
            "ref_params": sum(p.numel() for p in ref.parameters()),
            "fwd": (prof.forward.macs, prof.forward.flops), "ref_fwd": (r.forward.macs, r.forward.flops),
            "bwd_macs": prof.backward.macs, "ref_bwd_macs": r.backward.macs, "outside": prof.outside.flops,
            "ref_outside": r.outside.flops, "profiling_after": engine.observer.flops is not None,
            "modules": [(m.path, m.params, m.macs, m.flops, m.calls) for m in prof.modules],
            "ref_modules": [(m.path, m.params, m.macs, m.flops, m.calls) for m in r.modules]}  # fmt: skip


@pytest.mark.parametrize("stage", [0, 3])
def test_flops_profiler_counts_match_single_process_reference(stage, tmp_path):
    import json

    results = run_ranks(flops_body, 2, stage, str(tmp_path), timeout=60)
    outs = [out for out, _ in results]
    for out in outs:
        assert out["params"] == out["ref_params"] == 247  # stage 3: full counts, not shard sizes
        assert out["fwd"] == out["ref_fwd"]  # exactly the reference's MACs and FLOPs (two micro-batches)
        assert out["modules"] == out["ref_modules"]  # per module: full params, MACs, FLOPs, calls
        assert out["bwd_macs"] == out["ref_bwd_macs"]
        # Outside the model: the loss, plus at stage 3 the reduce-scatter's local work on gloo (the all-to-all
        # algorithm adds the w - 1 received chunks, "avg" divides once) and the accumulation into the gradient
        # shard: <= w + 1 = 3 FLOPs per shard element per micro-batch; never the optimizer step.
        extra = out["outside"] - out["ref_outside"]
        assert 0 <= extra <= 3 * 2 * out["shard"] and extra < out["adam_flops"]
        assert not out["profiling_after"]
    saved = json.loads((tmp_path / "flops-0.json").read_text())  # output_file ending .json: the JSON profile
    assert saved["totals"]["params"] == 247 and saved["totals"]["forward"]["macs"] == outs[0]["fwd"][0]
    assert not (tmp_path / "flops-1.json").exists()  # rank 0 only
    printed = results[0][1]
    assert printed.count("zero flops profiler - step 2") == 1
    assert "Top 2 module(s) per depth" in printed
    assert results[1][1] == ""


# --- memory_breakdown ------------------------------------------------------------------------------------------
def memory_body() -> tuple[dict, str]:
    return _printed(_memory)


def _memory() -> dict:
    engine, _, _, _ = zero.initialize(model=_net(), config=_cfg(2, memory_breakdown=True, steps_per_print=2))
    _train_step(engine, 1)
    first = engine.observer.last_memory
    _train_step(engine, 2)
    rep = engine.observer.last_memory.to_dict()
    shard = sum(g.shard_numel for g in engine.runtime.flat_groups if g.group_index is not None)
    return {"first": first, "rep": rep, "core": engine.runtime.model_state_bytes(), "shard": shard}


def test_memory_breakdown_reports_runtime_bytes_every_steps_per_print():
    for rank, (out, printed) in enumerate(run_ranks(memory_body, 2, timeout=60)):
        assert out["first"] is None  # step 1 is not a multiple of steps_per_print
        rep, core = out["rep"], out["core"]
        assert out["shard"] == 124  # 247 elements in one padded bucket: 124 per rank
        # fp32: the master shard is this rank's range of the parameter buffer, so it is counted once, as parameters.
        assert rep["master_weights"] == core["master"] == 0
        assert rep["optimizer_state"] == core["optimizer"] == 2 * 4 * 124  # AdamW exp_avg, exp_avg_sq on the shard
        assert rep["parameters"] == core["params"] and rep["gradients"] == core["grads"]
        assert rep["peak_rss"] > 0
        assert printed.count(f"rank {rank} step 2:") == 1  # every rank prints its own, at steps_per_print only
