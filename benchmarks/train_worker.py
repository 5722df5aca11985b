"""One benchmark run on one rank (launched by torchrun): train a Llama model for a few steps under one
implementation and write the measurements as JSON.

Implementations: ``zero`` (this project, stages 0-3), ``deepspeed`` (stages 1-3), ``fsdp2`` (``fully_shard`` on
every decoder layer and the root), ``ddp``. All see the same model (seeded construction, weights broadcast from
rank 0), the same byte-level batches of the same text, the same AdamW hyper-parameters, gradient clipping at 1.0
(``CLIP``, explicit for every peer) and fp32 compute, so the losses of the first steps must agree (checked by
bench_training.py).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist

LR, BETAS, WD = 3e-4, (0.9, 0.95), 0.01
CLIP = 1.0  # gradient norm clipping, set explicitly for every peer (DeepSpeed's default; DDP/FSDP2 call it)
UNIT_NUMEL = 4000000
PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's default stage3_param_persistence_threshold, used by both


def build_model(size: str):
    """The main job's Llama (``zero train --model-size``; transformers LlamaForCausalLM from config, no download)."""
    from zero.train.model import build_model as build

    return build(size, seq_len=512, seed=1234)


def batches(steps: int, micro: int, seq: int, rank: int, world: int):
    """The same global batches for every implementation: byte tokens of the stdlib's own source files."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    text = b"".join(f.read_bytes() for f in files[:200])
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - seq - 1, (micro * world,), generator=g)
        rows = torch.stack([data[s : s + seq] for s in starts.tolist()])
        out.append(rows[rank * micro : (rank + 1) * micro])
    return out


def zero_like_config(stage: int, micro: int, world: int) -> dict:
    return {
        "train_batch_size": micro * world,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        # Overlap bucket reductions with backward for both (DeepSpeed's own default is off below stage 3).
        "zero_optimization": {"stage": stage, "overlap_comm": True},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        # Keys whose defaults could differ between zero and DeepSpeed, explicit so both do the same work.
        "gradient_clipping": CLIP,
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
    }


MUON_LR, MUON_MOMENTUM = 0.02, 0.95


def optimizer_section(kind: str) -> dict:
    """The config's ``optimizer`` section for ``kind`` (``AdamW`` or ``Muon``), DeepSpeed's keys, the same for zero
    and DeepSpeed. ``torch_adam``: DeepSpeed's Adam (Muon's auxiliary one too) is then torch's AdamW rather than its
    JIT-built FusedAdam; zero's update is the same either way."""
    params = {"lr": LR, "betas": list(BETAS), "weight_decay": WD, "torch_adam": True}
    if kind == "Muon":
        params.update(muon_lr=MUON_LR, adam_lr=LR, momentum=MUON_MOMENTUM)
    elif kind != "AdamW":
        raise ValueError(f"--optimizer must be client, AdamW or Muon, got {kind!r}")
    return {"type": kind, "params": params}


def setup_phases(impl: str, stage: int, model, micro: int, world: int, shared_shards: str = "auto",
                 optimizer: str = "client", clip: float = CLIP):  # fmt: skip
    """Wrap ``model`` for ``impl``; returns (forward(batch) -> loss, backward(loss), step(), the engine or None,
    seconds spent wrapping the model). ``optimizer``: ``client`` passes a torch AdamW to initialize(); ``AdamW`` /
    ``Muon`` name it in the config instead. ``clip``: the gradient norm clipping of every peer (0: none)."""
    if impl in ("zero", "deepspeed"):
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
        engine_mod = __import__(impl)
        cfg = zero_like_config(stage, micro, world)
        cfg["gradient_clipping"] = clip
        if optimizer != "client":
            cfg["optimizer"], opt = optimizer_section(optimizer), None
        if impl == "zero" and stage == 3:
            # zero's own key: one all-gather per subtree of <= 4M elements (a whole decoder layer of the 6m and 20m
            # models), as FSDP2 wraps each layer, instead of one per module (DeepSpeed's granularity).
            cfg["zero_optimization"]["stage3_unit_numel"] = UNIT_NUMEL
            # zero's own key: the 2 ranks share a host, so a unit's gather copies the peer's shard from shared
            # memory (zero_comm.window) instead of all-gathering it over gloo's loopback TCP ("false": all-gather).
            cfg["zero_optimization"]["stage3_shared_shards"] = {"auto": "auto", "false": False}[shared_shards]
        t0 = time.perf_counter()
        engine, *_ = engine_mod.initialize(model=model, optimizer=opt, config=cfg)
        initialize_s = time.perf_counter() - t0

        def engine_forward(batch):
            return engine(input_ids=batch, labels=batch).loss

        return engine_forward, engine.backward, engine.step, engine, initialize_s
    t0 = time.perf_counter()
    if impl == "local":  # the compute floor: each rank trains its own copy, no collective, the whole AdamW
        wrapped = model
    elif impl == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
    elif impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        wrapped = model
    else:
        raise ValueError(f"unknown implementation {impl!r}")
    initialize_s = time.perf_counter() - t0
    # built after wrapping: DDP and FSDP2's parameters are what the optimizer must step
    opt = torch.optim.AdamW(wrapped.parameters(), lr=LR, betas=BETAS, weight_decay=WD)

    def step():
        if clip > 0:  # as gradient_clipping does for zero and DeepSpeed
            torch.nn.utils.clip_grad_norm_(wrapped.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def forward(batch):
        return wrapped(input_ids=batch, labels=batch).loss

    return forward, torch.Tensor.backward, step, None, initialize_s


def setup(impl: str, stage: int, model, micro: int, world: int, shared_shards: str = "auto",
          optimizer: str = "client", clip: float = CLIP):  # fmt: skip
    """Returns (train_step(batch) -> loss, the engine or None, seconds spent wrapping the model); the arguments
    as :func:`setup_phases`."""
    forward, backward, step, engine, initialize_s = setup_phases(
        impl, stage, model, micro, world, shared_shards, optimizer, clip
    )

    def train(batch):
        loss = forward(batch)
        backward(loss)
        step()
        return loss.item()

    return train, engine, initialize_s


def uses_muon(name: str, param: torch.Tensor) -> bool:
    """DeepSpeed's rule for which parameters step Muon (>= 2 dimensions, not an embedding or the output head)."""
    return param.dim() >= 2 and not any(k in name.lower() for k in ("embed", "lm_head"))


def optimizer_state_bytes(impl: str, engine) -> int | None:
    """Bytes of optimizer state this rank holds: zero's own accounting, or for DeepSpeed every tensor in its inner
    optimizer's ``state`` (counted once each), which is where ZeRO-1/2 keep the moments of the rank's partition."""
    if impl == "zero":
        return engine.runtime.model_state_bytes()["optimizer"]
    if impl != "deepspeed":
        return None
    inner = engine.optimizer.optimizer  # the basic optimizer inside DeepSpeed's ZeRO wrapper
    seen, total = set(), 0
    for st in inner.state.values():
        for t in st.values():
            if torch.is_tensor(t) and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def status_bytes(field: str) -> int | None:
    """A size field of this process's /proc/self/status (``VmRSS``, ``VmHWM``, ``RssShmem``), bytes; None where
    the file or the field is absent."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return None
    return next((int(ln.split()[1]) * 1024 for ln in lines if ln.startswith(field + ":")), None)


def rss_shmem_bytes() -> int:
    """Bytes of shared memory resident in this process (``RssShmem``; 0 where absent): zero stage 3's shared
    windows, each rank's own shard and the peers' it reads, counted in full by every rank's RSS."""
    return status_bytes("RssShmem") or 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", required=True)
    ap.add_argument("--stage", type=int, default=0)
    ap.add_argument("--size", default="20m")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shared-shards", default="auto", choices=["auto", "false"], help="zero stage 3 only")
    ap.add_argument("--clip", type=float, default=CLIP, help="gradient_clipping of every peer (0: none)")
    ap.add_argument("--optimizer", default="client", choices=["client", "AdamW", "Muon"], help="zero/deepspeed only")
    args = ap.parse_args()

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    if args.impl == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args.size)
    n_params = sum(p.numel() for p in model.parameters())
    # Stage 3 keeps parameters at or below the persistence threshold whole on every rank (DeepSpeed does too).
    persistent = sum(p.numel() for p in model.parameters() if p.numel() <= PERSISTENCE_THRESHOLD)
    data = batches(args.steps, args.micro, args.seq, rank, world)

    comm_log = None
    if args.impl == "zero":
        from zero_comm import CommsLogger

        comm_log = CommsLogger()
    train, engine, initialize_s = setup(
        args.impl, args.stage, model, args.micro, world, args.shared_shards, args.optimizer, args.clip
    )
    dist.barrier()
    init_s = time.perf_counter() - t0

    losses, times, calls, comm_bytes, ring_bytes = [], [], [], [], None
    for i, batch in enumerate(data):
        dist.barrier()
        if comm_log is not None and i == len(data) - 1:
            comm_log.__enter__()
        start = time.perf_counter()
        losses.append(train(batch))
        times.append(time.perf_counter() - start)
    if comm_log is not None:
        comm_log.__exit__(None, None, None)
        calls.append(comm_log.count())
        comm_bytes.append(sum(r.wire_bytes for r in comm_log.records))
        # What a ring algorithm sends per rank (nccl-tests' S x busbw factor): the ZeRO paper's accounting.
        ring_bytes = sum(r.logical_bytes * r.busbw_factor for r in comm_log.records)
    state_bytes = None
    if args.impl == "zero":
        state_bytes = engine.runtime.model_state_bytes()
    opt_state_bytes = optimizer_state_bytes(args.impl, engine)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = dict(
        impl=args.impl, stage=args.stage, size=args.size, rank=rank, world=world, params=n_params, init_s=init_s,
        initialize_s=initialize_s,
        persistent_params=persistent,
        step_s=times, losses=losses, peak_rss_bytes=peak_rss, rss_shmem_bytes=rss_shmem_bytes(),
        model_state_bytes=state_bytes,
        collective_calls_last_step=calls[0] if calls else None,
        wire_bytes_last_step=comm_bytes[0] if comm_bytes else None,
        ring_bytes_last_step=ring_bytes, optimizer=args.optimizer, optimizer_state_bytes=opt_state_bytes,
        muon_params=sum(p.numel() for n, p in model.named_parameters() if uses_muon(n, p)),
    )  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(result, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
