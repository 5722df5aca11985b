"""``zero train``: pretrain a Llama model on byte-level text over N ranks (it launches them through torchrun).

Everything the ranks need is checked first: ``--nproc-per-node``, ``--model-size``, the config (typos, batch
triple for this world size) and the data (missing/empty path, unreadable file, JSONL without the text field).
Only then is ``runs/<name>/`` created (settings, token files), so bad input leaves nothing behind.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import time

from zero.commands.errors import UsageError

DEFAULT_STEPS = 120
DEFAULT_EVAL_EVERY = 10  # validation every 10 steps: ~12 points on the default run's loss plot, ~1 s each
DEFAULT_TIME_LIMIT_S = 210.0  # training seconds; keeps the default run (with start-up and evaluation) under 5 min
DEFAULT_CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
    "scheduler": {
        "type": "WarmupCosineLR",
        "params": {
            "total_num_steps": "auto",
            "warmup_num_steps": "auto",
            "warmup_type": "linear",
            "cos_min_ratio": 0.1,
        },
    },  # fmt: skip
    "gradient_clipping": 1.0,  # the main job's choice, stated (also DeepSpeed's and zero's default)
    "bf16": {"enabled": "auto"},
    # One stage-3 unit (one all-gather) per decoder layer rather than per Linear: 0.81x FSDP2's step time vs
    # 0.92x with 1M-element units on the 20m model (docs/benchmarks.md). Shared shards: ranks on one host copy a
    # unit from the peers' shards instead of all-gathering it ("auto": off with --offload, or across hosts).
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "stage3_unit_numel": 4_000_000,
        "stage3_shared_shards": "auto",
    },
    "steps_per_print": 10,
}


def add_arguments(parser) -> None:
    """The job's options (all optional: the defaults are the demo run)."""
    from zero.commands.offload_flag import add_offload_arguments
    from zero.train.model import DEFAULT_SIZE, SIZES

    parser.add_argument("--config", help="DeepSpeed-style JSON config (default: ZeRO-3, AdamW, cosine schedule)")
    parser.add_argument("--data", help="text file, folder of text files, or JSONL (default: Python's stdlib source)")
    parser.add_argument("--text-field", default="text", help="JSONL field holding the text (default: text)")
    parser.add_argument(
        "--model-size", default=DEFAULT_SIZE, help=f"one of {', '.join(SIZES)} (default {DEFAULT_SIZE})"
    )
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help=f"optimizer steps in total (default {DEFAULT_STEPS})"
    )
    parser.add_argument("--seq-len", type=int, default=128, help="tokens (bytes) per sequence (default 128)")
    parser.add_argument("--nproc-per-node", default="2", help="ranks to launch on this machine (default 2)")
    parser.add_argument("--sequence-parallel", type=int, default=1, metavar="N", help="Ulysses sequence "
                        "parallelism: groups of N ranks share each sequence, each rank 1/N of its positions; N "
                        "divides the ranks, --seq-len and the model's heads; the batch counts the ranks / N "
                        "data-parallel ranks (default 1: none)")  # fmt: skip
    parser.add_argument("--pipeline-parallel", type=int, default=1, metavar="N", help="pipeline parallelism: the "
                        "model cut into N stages (embedding, decoder layers, norm, head), 1F1B; N divides the ranks; "
                        "the batch counts the ranks / N data-parallel replicas; ZeRO stage 1 unless --config says "
                        "0-2 (default 1: none)")  # fmt: skip
    parser.add_argument("--name", help="run name: output goes to <runs-dir>/<name>/ (default: train-<time>)")
    parser.add_argument("--runs-dir", default="runs", help="folder of runs (default: ./runs)")
    parser.add_argument("--resume", nargs="?", const="latest", choices=("latest", "auto"),
                        help="continue <name> (default: the newest run) from its checkpoint; '--resume auto': "
                        "continue when a checkpoint exists, else start the run")  # fmt: skip
    parser.add_argument("--seed", type=int, default=1234, help="random seed of the run (default 1234)")
    add_offload_arguments(parser)
    parser.add_argument("--quantization", choices=("fp8", "int8"), default=None, help="subchannel quantized "
                        "training: the Linear layers' forward and gradient GEMMs on FP8 (e4m3) or INT8 operands "
                        "(the config's `quantization` section; default: as the config says)")  # fmt: skip
    parser.add_argument("--quantization-block-size", type=int, default=None, metavar="N", help="with "
                        "--quantization: elements per scale along each GEMM's reduction dimension (0: one per row; "
                        "default: the section's, 128)")  # fmt: skip
    parser.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S, help="stop training after this "
                        "many seconds (then evaluate and checkpoint as at the last step; "
                        f"default {DEFAULT_TIME_LIMIT_S:g})")  # fmt: skip
    parser.add_argument(
        "--val-windows", type=int, default=32, help="held-out sequences for validation loss (default 32)"
    )
    parser.add_argument("--eval-every", type=int, default=DEFAULT_EVAL_EVERY, help="validation loss every N "
                        f"optimizer steps, logged and plotted (default {DEFAULT_EVAL_EVERY}; 0: at start and "
                        "end only)")  # fmt: skip
    parser.add_argument(
        "--max-data-mb", type=float, default=None, help="read at most this many MB of text (default: all)"
    )
    parser.add_argument("--monitor", help="comma list of tensorboard, csv_monitor, wandb, comet: write DeepSpeed's "
                        "Train/Samples/* events under <run>/monitors (wandb: WANDB_MODE applies)")  # fmt: skip
    parser.add_argument("--torchrun-args", default="", help="extra torchrun options, e.g. '--nnodes 2 "
                        "--rdzv-endpoint host:29400' (one string)")  # fmt: skip
    parser.add_argument("--no-checkpoint", action="store_true", help="save no checkpoint (the big-model job: "
                        "one of NVMe-resident state needs as much disk again as its swap files)")  # fmt: skip
    parser.add_argument("--checkpoint-every-steps", type=int, default=None, help="also save a checkpoint every N "
                        "optimizer steps (a killed rank then costs at most N steps)")  # fmt: skip
    parser.add_argument("--checkpoint-every-minutes", type=float, default=None, help="also save a checkpoint every "
                        "M minutes of training (rank 0's clock)")  # fmt: skip
    parser.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts the ranks this many times "
                        "after a failure; they resume from the last checkpoint")  # fmt: skip
    parser.add_argument("--bind-cores-to-rank", action="store_true", help="pin each rank to its share of this "
                        "machine's cores (as zero run --bind_cores_to_rank)")  # fmt: skip


def _nproc(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"--nproc-per-node must be a positive integer, got {value!r}")
    return int(value)


def _user_config(path: str | None) -> dict:
    if path is None:
        return copy.deepcopy(DEFAULT_CONFIG)
    from zero.config.model import _read

    return _read(path)


def _apply_quantization(config: dict, fmt: str | None, block_size: int | None) -> dict:
    """``config`` with its `quantization` section enabled for ``fmt`` (unchanged for None); the section's other
    keys stay. Raises UsageError for a block size without a format."""
    if fmt is None:
        if block_size is not None:
            raise UsageError("--quantization-block-size needs --quantization fp8 or int8")
        return config
    section = {**(config.get("quantization") or {}), "enabled": True, "dtype": fmt}
    if block_size is not None:
        section["block_size"] = block_size
    return {**config, "quantization": section}


def _auto_values(steps: int) -> dict:
    import torch

    return {"scheduler.params.total_num_steps": steps, "scheduler.params.warmup_num_steps": max(2, steps // 10),
            "bf16.enabled": torch.cuda.is_available()}  # fmt: skip


def _newest_run(runs_dir: pathlib.Path) -> pathlib.Path:
    runs = [p for p in runs_dir.glob("*") if (p / "checkpoint" / "latest").is_file()] if runs_dir.is_dir() else []
    if not runs:
        raise UsageError(f"--resume: no run with a checkpoint under {str(runs_dir)!r}")
    return max(runs, key=lambda p: (p / "checkpoint" / "latest").stat().st_mtime)


def _resume_settings(args, runs_dir: pathlib.Path) -> tuple[pathlib.Path, dict]:
    run = runs_dir / args.name if args.name else _newest_run(runs_dir)
    if not (run / "checkpoint" / "latest").is_file() or not (run / "settings.json").is_file():
        raise UsageError(f"--resume: {str(run)!r} has no checkpoint to continue from")
    settings = json.loads((run / "settings.json").read_text())
    settings["resume"] = True
    settings["time_limit_s"] = args.time_limit
    settings["eval_every"] = args.eval_every
    if args.steps != DEFAULT_STEPS:
        settings["steps"] = args.steps
    return run, settings


def _checkpoint_intervals(args) -> dict:
    steps, minutes = args.checkpoint_every_steps, args.checkpoint_every_minutes
    if (steps is not None and steps < 1) or (minutes is not None and not minutes > 0) or args.max_restarts < 0:
        raise UsageError(f"--checkpoint-every-steps (>= 1), --checkpoint-every-minutes (> 0), --max-restarts (>= 0) "
                         f"got {steps}, {minutes}, {args.max_restarts}")  # fmt: skip
    return {"checkpoint_every_steps": steps, "checkpoint_every_minutes": minutes,
            "no_checkpoint": bool(getattr(args, "no_checkpoint", False))}  # fmt: skip


def _has_checkpoint(runs_dir: pathlib.Path, name: str | None) -> bool:
    """``--resume auto``: is there a run to continue (``name``'s, or any when no name is given)?"""
    if name is not None:
        return (runs_dir / name / "checkpoint" / "latest").is_file()
    return runs_dir.is_dir() and any((p / "checkpoint" / "latest").is_file() for p in runs_dir.glob("*"))


def _check_nvme(engine_config, args, nproc: int, run_dir: pathlib.Path) -> None:
    """NVMe offload's start-up checks, from the model size, before any rank starts (zero.commands.offload_flag)."""
    from zero.commands.offload_flag import check_nvme_before_launch
    from zero_offload.nvme_checks import NVMeConfigError
    from zero_offload.swap_folder import SwapFolderError

    try:
        line = check_nvme_before_launch(engine_config, args.model_size, args.seq_len, nproc, run_dir)
    except (SwapFolderError, NVMeConfigError) as e:
        raise UsageError(str(e)) from None
    if line:
        print(f"zero train: {line}", flush=True)


def prepare(args) -> tuple[pathlib.Path, dict]:
    """Validate every input and create the run folder; returns ``(run_dir, settings)``. Raises UsageError /
    ConfigError / DataError (one line each) before anything is written."""
    from zero.commands.offload_flag import apply_offload
    from zero.config import load_config
    from zero.train import pipeline, sequence_parallel
    from zero.train.data import build_corpus, save_tokens
    from zero.train.model import SIZES
    from zero.train.monitors import with_monitors

    nproc = _nproc(str(args.nproc_per_node))
    runs_dir = pathlib.Path(args.runs_dir)
    intervals = _checkpoint_intervals(args)
    if args.resume == "auto":
        args.resume = "latest" if _has_checkpoint(runs_dir, args.name) else None
    if args.resume:
        run, settings = _resume_settings(args, runs_dir)
        settings.update({k: v for k, v in intervals.items() if v is not None})
        load_config(settings["config"], nproc // settings.get("sequence_parallel", 1)
                    // settings.get("pipeline_parallel", 1), settings["auto_values"])  # fmt: skip
        tmp = run / ".settings.json.tmp"
        tmp.write_text(json.dumps(settings, indent=1))
        os.replace(tmp, run / "settings.json")  # the ranks read the updated settings (resume, steps)
        return run, settings
    if args.model_size not in SIZES:
        raise UsageError(f"--model-size {args.model_size!r} is not one of {', '.join(SIZES)}")
    if args.eval_every < 0:
        raise UsageError(f"--eval-every must be >= 0, got {args.eval_every}")
    if args.steps < 1 or args.seq_len < 8 or args.val_windows < 1:
        raise UsageError(f"--steps, --seq-len (>= 8), --val-windows must be positive; got {args.steps}, "
                         f"{args.seq_len}, {args.val_windows}")  # fmt: skip
    sp = args.sequence_parallel
    why = sequence_parallel.check(sp, nproc, args.seq_len, SIZES[args.model_size][2])
    if why:
        raise UsageError(why)
    config = _user_config(args.config)
    if sp > 1:
        config["sequence_parallel_size"] = sp  # zero.initialize checks it against the mpu the ranks build
    pp = getattr(args, "pipeline_parallel", 1)
    if pp > 1 and sp > 1:
        raise UsageError("--pipeline-parallel and --sequence-parallel cannot be combined yet; use one")
    stage = (config.get("zero_optimization") or {}).get("stage") if args.config else None
    why = pipeline.check(pp, nproc, SIZES[args.model_size][1], stage)
    if why:
        raise UsageError(why)
    if pp > 1 and args.config is None:
        config["zero_optimization"] = {"stage": pipeline.PIPELINE_STAGE}
    name = args.name or time.strftime("train-%Y%m%d-%H%M%S")
    try:
        config = apply_offload(config, getattr(args, "offload", None), getattr(args, "nvme_path", None),
                               runs_dir.resolve() / name)  # fmt: skip
    except ValueError as e:
        raise UsageError(str(e)) from None
    config = _apply_quantization(config, getattr(args, "quantization", None),
                                 getattr(args, "quantization_block_size", None))  # fmt: skip
    auto = _auto_values(args.steps)
    # typos, bad values, batch triple (over the data-parallel ranks): fail here, not in ranks
    engine_config = load_config(config, nproc // sp // pp, auto)
    run = runs_dir / name
    _check_nvme(engine_config, args, nproc, run.resolve())
    if run.exists():
        raise UsageError(f"run folder {str(run)!r} exists; pass --resume to continue it or another --name")
    config = with_monitors(config, getattr(args, "monitor", None), run)  # zero.train.monitors
    max_bytes = int(args.max_data_mb * 1e6) if args.max_data_mb else None
    corpus = build_corpus(args.data, args.text_field, max_bytes)  # a DataError is an InputError: the CLI prints it
    if min(len(corpus.train), len(corpus.val)) <= args.seq_len:
        raise UsageError(f"data {corpus.source!r} is too small: {len(corpus.train)} train / {len(corpus.val)} "
                         f"validation tokens for --seq-len {args.seq_len}")  # fmt: skip
    settings = {"model_size": args.model_size, "seq_len": args.seq_len, "steps": args.steps, "seed": args.seed,
                "val_windows": args.val_windows, "config": config, "auto_values": auto, "resume": False,
                "data": corpus.source, "time_limit_s": args.time_limit, "eval_every": args.eval_every,
                "sequence_parallel": sp, "pipeline_parallel": pp, **intervals}  # fmt: skip
    tmp = runs_dir / f".{name}.tmp"
    save_tokens(corpus, tmp / "data")
    (tmp / "settings.json").write_text(json.dumps(settings, indent=1))
    os.replace(tmp, run)  # the run folder appears complete or not at all
    return run, settings


def banner(settings: dict, nproc: int, run_dir: pathlib.Path, shared: str = "") -> str:
    """The line ``zero train`` prints before the ranks start: what will run (model, ranks, ZeRO stage, steps), that
    it resumes a checkpoint, and the time limit that may stop it before its last step."""
    stage = (settings["config"].get("zero_optimization") or {}).get("stage", 0)
    resume = f", resuming from the checkpoint in {run_dir / 'checkpoint'}" if settings.get("resume") else ""
    return (f"zero train: zero (ZeRO stage {stage}), {settings['model_size']} Llama, {nproc} ranks{shared}, "
            f"{settings['steps']} steps{resume}; stops at {settings['time_limit_s']:g} s if not done (evaluated and "
            f"checkpointed as at the last step); data {settings['data']}; output {run_dir}")  # fmt: skip


def run(args) -> int:
    """Prepare, then launch ``nproc`` ranks of ``zero.train.worker`` through torchrun; 0 on success."""
    import shlex

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from zero.commands.run import launch

    run_dir, settings = prepare(args)
    nproc = _nproc(str(args.nproc_per_node))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    sp = settings.get("sequence_parallel", 1)
    shared = f" (sequence parallel {sp}: each sequence shared by {sp} ranks)" if sp > 1 else ""
    pp = settings.get("pipeline_parallel", 1)
    if pp > 1:
        shared = f" (pipeline parallel {pp}: {pp} stages x {nproc // pp} data-parallel replicas)"
    print(banner(settings, nproc, run_dir, shared), flush=True)
    restarts = ["--max-restarts", str(args.max_restarts)] if args.max_restarts else []
    launcher = ["--nproc-per-node", str(nproc), *restarts, *shlex.split(args.torchrun_args), "-m", "zero.train.worker"]
    worker_args = [str(run_dir)]
    if args.bind_cores_to_rank:  # torchrun starts the pinning entry, which runs the worker module
        launcher[-1], worker_args = "zero.commands.pin_cores", ["--module", "zero.train.worker", *worker_args]
    try:
        launch(launcher, worker_args)
    except ChildFailedError as e:
        print(f"zero train: a rank failed: {e}", flush=True)
        return 1
    except SignalException as e:  # Ctrl-C: the ranks saved a checkpoint before exiting
        print(f"zero train: stopped by signal {e.sigval}; continue with: zero train --resume --name {run_dir.name} "
              f"--runs-dir {run_dir.parent}", flush=True)  # fmt: skip
        return 130
    return 0
