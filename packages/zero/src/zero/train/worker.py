"""One rank of ``zero train`` (launched by torchrun): train, log, evaluate, checkpoint; ``python -m`` entry.

Rank 0 writes ``log.jsonl`` (one JSON object per step, zero_profiler's run-log schema; ``val_loss`` on every
``eval_every``-th step), ``summary.json``,
``loss.png`` and ``breakdown.png`` (seconds per phase and loss, as ``zero plot``); all ranks write the
checkpoint (sharded) at the end and on SIGINT/SIGTERM (Ctrl-C), after agreeing on it through one all-reduce.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import resource
import signal
import sys
import time

import torch
import torch.distributed as dist

import zero
from zero.config import load_config
from zero.engine.resume import CheckpointInterval
from zero.train import pipeline
from zero.train.data import load_tokens, sample_windows
from zero.train.model import build_deferred, build_model
from zero.train.sequence_parallel import SequenceShards
from zero_profiler import Timers

_stop = {"requested": False}


def _request_stop(signum, frame):  # first signal: stop at the next step and save; a second one aborts
    if _stop["requested"]:
        raise KeyboardInterrupt
    _stop["requested"] = True


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def _rss_now_mib() -> float:
    """Resident set size now in MiB (``/proc/self/statm``); the peak where ``/proc`` is absent."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return _rss_mib()


def _all_mean(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def step_record(step: int, loss: float | None, seconds: dict[str, float], **extra) -> dict:
    """One line of ``log.jsonl`` in zero_profiler's run-log schema (what ``zero plot`` / ``plot_run`` read):
    ``step`` (optimizer step, int), ``loss`` (mean over ranks, or None), ``seconds`` (phase -> seconds of this
    rank 0's step: data, forward, backward, step; ``Timers.end_step()``), then ``extra`` keys (lr, grad_norm,
    step_s, tokens_per_s, rss_mib_per_rank (peak so far, MiB per rank), rss_now_mib_per_rank (current, MiB per
    rank), time). Validated with ``parse_record`` so a bad field fails here, naming it, rather than in a later
    plot."""
    from zero_profiler import parse_record

    rec = {"step": step, "loss": loss, "seconds": dict(seconds), **extra}
    parse_record(rec, step)
    return rec


@torch.no_grad()
def evaluate(engine, val: torch.Tensor, batch: int) -> float:
    """Mean next-token loss over this rank's share of the fixed validation windows, averaged over ranks."""
    engine.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = val[rank::world]
    total, n = 0.0, 0
    for i in range(0, len(mine), batch):
        x = mine[i : i + batch]
        total += float(engine(input_ids=x, labels=x).loss) * len(x)
        n += len(x)
    engine.train()
    t = torch.tensor([total, float(n)], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t[0] / t[1])


def _evaluate(engine, val: torch.Tensor, batch: int, pp: int) -> float:
    return pipeline.evaluate(engine, val, batch) if pp > 1 else evaluate(engine, val, batch)


def deferred_build(config: dict) -> bool:
    """Stage 3 with ``offload_param``: the model is built on the meta device and materialised unit by unit."""
    zo = config.get("zero_optimization") or {}
    return zo.get("stage") == 3 and (zo.get("offload_param") or {}).get("device") in ("cpu", "nvme")


def main(run_dir: str) -> int:
    """Train as ``run_dir/settings.json`` says; returns 0 (also after a Ctrl-C that saved a checkpoint)."""
    run = pathlib.Path(run_dir)
    s = json.loads((run / "settings.json").read_text())
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    zero.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    signal.signal(signal.SIGINT, _request_stop)
    signal.signal(signal.SIGTERM, _request_stop)

    if deferred_build(s["config"]):  # the big-model job: never whole on any rank (zero_core.defer_init)
        model = build_deferred(s["model_size"], s["seq_len"], s["seed"])
    else:
        model = build_model(s["model_size"], s["seq_len"], s["seed"])
    sp, pp = s.get("sequence_parallel", 1), s.get("pipeline_parallel", 1)
    shards = mpu = None
    if pp > 1:  # this rank's stage (zero.train.pipeline)
        model = pipeline.split(model, pp)
    if sp > 1:  # Ulysses: each rank of a group of sp feeds its shard of every window (zero.train.sequence_parallel)
        micro = load_config(s["config"], world // sp, s["auto_values"]).batch.micro_batch_per_gpu
        shards, mpu = SequenceShards.register(model, sp, micro, s["seq_len"])
    engine, _, _, _ = zero.initialize(model=model, config=s["config"], auto_values=s["auto_values"], mpu=mpu)
    data_rank = rank if shards is None else shards.data_rank  # the ranks sharing a window draw the same one
    if pp > 1:  # a pipeline's stages of one replica draw its windows
        data_rank = engine.grid.get_data_parallel_id()
    ckpt = run / "checkpoint"
    # "auto": a rank restarted by torchrun (--max-restarts) continues from the last checkpoint of this run
    saving = not s.get("no_checkpoint", False)
    if saving:
        engine.resume_checkpoint(ckpt, mode="must" if s["resume"] else "auto")
    interval = CheckpointInterval(s.get("checkpoint_every_steps"), s.get("checkpoint_every_minutes"))
    train_tokens, val_tokens = load_tokens(run / "data")
    val = torch.from_numpy(sample_windows(val_tokens, s["val_windows"], s["seq_len"] - 1, seed=12345))
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    tokens_per_step = engine.train_batch_size() * s["seq_len"]

    log = open(run / "log.jsonl", "a") if rank == 0 else None
    summary = {"val_loss_start": None}
    if engine.global_steps == 0:
        summary["val_loss_start"] = _evaluate(engine, val, micro, pp)
    elif (run / "summary.json").is_file():
        summary = json.loads((run / "summary.json").read_text())
    timers = Timers(next(engine.module.parameters()).device)  # CUDA events on GPU, perf_counter on CPU
    bar = None
    if rank == 0:
        from tqdm import tqdm

        # redrawn at most every 30 s when stderr is a file or pipe, so a captured log gets a line per half minute
        bar = tqdm(total=s["steps"], initial=engine.global_steps, desc="zero train", unit="step", dynamic_ncols=True,
                   mininterval=0.1 if sys.stderr.isatty() else 30.0)  # fmt: skip
    t_start, steps_done, stop, timed_out = time.perf_counter(), 0, 0.0, False
    while engine.global_steps < s["steps"]:
        t0 = time.perf_counter()
        step_loss = 0.0
        windows = []
        for m in range(gas):
            seed = s["seed"] * 1_000_003 + engine.global_steps * 1009 + m * 31 + data_rank
            with timers("data"):
                x = torch.from_numpy(sample_windows(train_tokens, micro, s["seq_len"] - 1, seed))
            if pp > 1:
                windows.append(x)
                continue
            with timers("forward"):
                if shards is None:
                    loss = engine(input_ids=x, labels=x).loss
                else:
                    inputs = shards.inputs(x)
                    loss = shards.loss(engine(**inputs), inputs)
            with timers("backward"):
                engine.backward(loss)
            with timers("step"):
                engine.step()
            step_loss += loss.item() / gas
        if pp > 1:
            with timers("step"):
                step_loss = pipeline.train_step(engine, windows)
        seconds = timers.end_step()
        dt = time.perf_counter() - t0
        out_of_time = rank == 0 and time.perf_counter() - t_start > s["time_limit_s"]
        stats = [step_loss, float(_stop["requested"]), float(out_of_time)] + [0.0] * (2 * world)
        stats[3 + rank], stats[3 + world + rank] = _rss_mib(), _rss_now_mib()
        mean = _all_mean(stats)  # one collective: mean loss, stop requests, every rank's peak and current RSS
        loss_mean, stop = mean[0], mean[1]
        rss_all, rss_now = [v * world for v in mean[3 : 3 + world]], [v * world for v in mean[3 + world :]]
        timed_out = mean[2] > 0
        steps_done += 1
        val_extra = {}
        every = s.get("eval_every", 0)
        if every and engine.global_steps % every == 0 and engine.global_steps < s["steps"] and not (stop or timed_out):
            val_extra = {"val_loss": _evaluate(engine, val, micro, pp)}  # every rank: it is collective
        if rank == 0:
            grad_norm = engine.get_global_grad_norm()
            rec = step_record(engine.global_steps, loss_mean, seconds, lr=engine.get_lr()[0], grad_norm=grad_norm,
                              step_s=dt, tokens_per_s=tokens_per_step / dt,
                              rss_mib_per_rank=[round(v, 1) for v in rss_all],
                              rss_now_mib_per_rank=[round(v, 1) for v in rss_now], time=time.time(),
                              **val_extra)  # fmt: skip
            log.write(json.dumps(rec) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{loss_mean:.3f}", tok_s=f"{tokens_per_step / dt:.0f}", refresh=False,
                            mem="/".join(f"{v:.0f}M" for v in rss_now))  # fmt: skip
            if val_extra:
                bar.write(f"step {engine.global_steps}: validation loss {val_extra['val_loss']:.4f}")
            bar.update(1)
        if stop > 0 or timed_out:
            break
        if saving and engine.global_steps < s["steps"]:  # the last step's checkpoint is written below
            engine.save_checkpoint_if_due(ckpt, interval)
    if bar is not None:
        bar.close()
    interrupted = stop > 0
    if saving:
        engine.save_checkpoint(ckpt, client_state={"interrupted": interrupted})
    if interrupted:
        if rank == 0:
            saved = f"checkpoint saved to {ckpt}; continue with --resume" if saving else "no checkpoint saved"
            print(f"zero train: interrupted at step {engine.global_steps}; {saved}", file=sys.stderr)
        _shutdown()
        return 0
    val_loss = _evaluate(engine, val, micro, pp)
    if rank == 0:
        summary.update(val_loss_end=val_loss, val_perplexity_end=math.exp(val_loss), steps=engine.global_steps,
                       train_seconds_this_launch=time.perf_counter() - t_start, steps_this_launch=steps_done,
                       stopped_by_time_limit=engine.global_steps < s["steps"], world_size=world,
                       checkpoint=str(ckpt))  # fmt: skip
        if summary.get("val_loss_start") is not None:
            summary["val_perplexity_start"] = math.exp(summary["val_loss_start"])
        (run / "summary.json").write_text(json.dumps(summary, indent=1))
        from zero.train.plot import plot_loss

        plot_loss(run / "log.jsonl", run / "loss.png", summary)
        from zero_profiler import plot_run

        plot_run(run / "log.jsonl", run / "breakdown.png", title=f"zero train {run.name}")  # = `zero plot`
        start = summary.get("val_loss_start")
        start_text = "n/a" if start is None else f"{start:.4f}"
        if summary["stopped_by_time_limit"]:
            print(f"zero train: stopped by --time-limit ({s['time_limit_s']:g} s of training) after "
                  f"{engine.global_steps} of {s['steps']} steps; raise it to train them all")  # fmt: skip
        print(f"zero train: validation loss {start_text} -> {val_loss:.4f} "
              f"(perplexity {math.exp(val_loss):.2f}); run folder {run}")  # fmt: skip
    _shutdown()
    return 0


def _shutdown() -> None:
    """Tear the process group down together: a rank that destroyed its gloo group while a peer still held open
    connections was seen to abort ("terminate called without an active exception") at the end of a run."""
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
