"""One decoding benchmark run on one rank (launched by torchrun with 1 or 2 ranks): the main job's Llama (``zero
train``'s default size, seeded weights, fp32) generating greedily from a fixed byte prompt. Writes this rank's
time to first token, decode tokens/s and peak RSS as JSON.

Modes: ``hf`` (transformers' generate, one process), ``autotp`` (zero's init_inference, AutoTP over the ranks),
``inject`` (zero's init_inference with replace_with_kernel_inject: fused blocks, zero's own decode loop over a
static KV cache; ``--compile`` compiles its decode step), ``deepspeed`` (DeepSpeed 0.19.8's init_inference AutoTP,
gloo; ``--no-shm``: without its shared-memory all-reduce op; ``--local-size``: LOCAL_SIZE set as DeepSpeed's
launcher sets it), ``rollout`` (a ZeRO-3 hybrid engine's generate against GatheredParameters + transformers'
generate on the same engine, 2 ranks), ``matmul`` (the ceiling: only the weight products of a decode step, the fused
blocks' weights, in a Python loop), ``ab`` (in one process, interleaved: transformers' generate, the fused blocks
eager, compiled and compiled with inductor's freezing, and the matmul ceiling; the rates of every round), ``save``
(writes the seeded model as transformers' safetensors folder, several shards, to ``--checkpoint``). ``--dtype bf16``
runs the model (and the products) in bfloat16. ``--checkpoint DIR`` with ``autotp``/``inject``: the model is built
on the meta device and its weights read from DIR, each rank reading its shards.

Time to first token: the median over ``--reps`` of ``generate(max_new_tokens=1)``. Decode: the median of
(``new - 1``) / (time of ``generate(max_new_tokens=new)`` - that time to first token). Memory: the process's peak
RSS, and the peak RSS gained from just before the model is built until ``init_inference`` returns (Linux: the
high-water mark reset through ``/proc/self/clear_refs``). The greedy tokens are written too (compared with
transformers' by bench_decode.py). A ``--cap`` second timer dumps every thread's stack (faulthandler) and exits when
a run hangs.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(size: str, seq: int, dtype: torch.dtype = torch.float32):
    from zero.train.model import build_model

    return build_model(size, seq, seed=0).eval().to(dtype)


def build_meta(size: str, seq: int):
    """The same architecture on the meta device (no storage): its weights come from a checkpoint."""
    from transformers import LlamaForCausalLM

    from zero.train.model import llama_config

    with torch.device("meta"):
        return LlamaForCausalLM(llama_config(size, seq)).eval()


def rss_field(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process in bytes (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def reset_peak_rss() -> int:
    """Reset the peak-RSS mark to the current RSS (Linux's clear_refs "5"); returns the current RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_field("VmRSS")


def matmul_step(model, dtype: torch.dtype):
    """``generate``-shaped callable running only a decode step's weight products per token (the ceiling)."""
    from zero_inference import init_inference
    from zero_inference.projection import project

    engine = init_inference(model, dtype=dtype, replace_with_kernel_inject=True)
    blocks = engine.module.model.layers
    weights = [(w, t) for b in blocks for w, t in ((b.qkv_weight, b.qkv_transposed), (b.o_weight, b.o_transposed),
               (b.gate_up_weight, b.gate_up_transposed), (b.down_weight, b.down_transposed))]  # fmt: skip
    weights.append((engine.module.lm_head.weight, False))
    inputs = [torch.randn(1, 1, w.shape[0] if t else w.shape[1], dtype=dtype) for w, t in weights]

    def generate(input_ids, max_new_tokens, **_):
        for _ in range(max_new_tokens):
            for (w, t), x in zip(weights, inputs):
                project(x, w, t)
        return input_ids

    return generate


def prompt(length: int, batch: int) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(3))


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        if dist.is_initialized():
            dist.barrier()
        t = time.perf_counter()
        with torch.no_grad():
            fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(generate, ids: torch.Tensor, new: int, reps: int) -> dict:
    kw = {"attention_mask": torch.ones_like(ids), "do_sample": False, "pad_token_id": 258, "eos_token_id": None}
    with torch.no_grad():
        tokens = generate(input_ids=ids, max_new_tokens=new, **kw)  # warm-up (and the compile, if any)
    first = timed(lambda: generate(input_ids=ids, max_new_tokens=1, **kw), reps)
    full = timed(lambda: generate(input_ids=ids, max_new_tokens=new, **kw), reps)
    return {"ttft_s": first, "decode_tok_s": ids.shape[0] * (new - 1) / max(full - first, 1e-9), "full_s": full,
            "tokens": tokens.tolist()}  # fmt: skip


AB_VARIANTS = {"eager": None, "compiled": {}, "freezing": {"options": {"freezing": True}}}
"""The fused-block variants of ``--mode ab``: None uncompiled, else ``engine.compile``'s ``compile_kwargs``."""


def ab(args, ids) -> dict:
    """In one process: transformers' generate, the fused blocks as :data:`AB_VARIANTS` and the matmul ceiling,
    ``--reps`` interleaved rounds (every second reversed) of one ``max_new_tokens=1`` and one ``new`` call each;
    per variant the decode tokens/s of every round and whether its warm-up tokens equal transformers'."""
    from zero_inference import init_inference

    dtype = DTYPES[args.dtype]
    kw = {"attention_mask": torch.ones_like(ids), "do_sample": False, "pad_token_id": 258, "eos_token_id": None}
    generates = {"transformers": build(args.size, args.seq, dtype).generate}
    with torch.no_grad():
        reference = generates["transformers"](input_ids=ids, max_new_tokens=args.new, **kw)
        same = {}
        for name, compile_kwargs in AB_VARIANTS.items():
            engine = init_inference(build(args.size, args.seq), dtype=dtype, replace_with_kernel_inject=True)
            if compile_kwargs is not None:
                engine.compile(compile_kwargs=compile_kwargs)
            same[name] = torch.equal(engine.generate(input_ids=ids, max_new_tokens=args.new, **kw), reference)
            generates[name] = engine.generate
        generates["matmul ceiling"] = matmul_step(build(args.size, args.seq), dtype)
        rates: dict = {name: [] for name in generates}
        for rnd in range(args.reps):
            for name in list(generates) if rnd % 2 == 0 else list(generates)[::-1]:
                first = timed(lambda g=generates[name]: g(input_ids=ids, max_new_tokens=1, **kw), 1)
                full = timed(lambda g=generates[name]: g(input_ids=ids, max_new_tokens=args.new, **kw), 1)
                rates[name].append((args.new - 1) / max(full - first, 1e-9))
    return {"rates": rates, "same_tokens": same}


def rollout(args, ids) -> dict:
    import zero

    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "hybrid_engine": {"enabled": True}}  # fmt: skip
    engine, *_ = zero.initialize(model=build(args.size, args.seq), config=cfg)
    kw = {"attention_mask": torch.ones_like(ids), "do_sample": False, "pad_token_id": 258, "eos_token_id": None,
          "max_new_tokens": args.new}  # fmt: skip

    def gathered():
        with zero.zero.GatheredParameters(list(engine.module.parameters())):
            return engine.module.generate(input_ids=ids, **kw)

    hybrid = lambda: engine.generate(input_ids=ids, **kw)  # noqa: E731
    with torch.no_grad():
        same = torch.equal(hybrid(), gathered())
    out = {"hybrid_s": [], "gathered_s": [], "same_tokens": same}
    for rnd in range(args.reps):  # interleaved, every second round reversed
        pair = [("hybrid_s", hybrid), ("gathered_s", gathered)]
        for name, fn in pair if rnd % 2 == 0 else pair[::-1]:
            out[name].append(timed(fn, 1))
    return {k: statistics.median(v) if isinstance(v, list) else v for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    modes = ["hf", "autotp", "inject", "deepspeed", "rollout", "matmul", "save", "ab"]
    ap.add_argument("--mode", required=True, choices=modes)
    ap.add_argument("--size", default="20m")
    ap.add_argument("--seq", type=int, default=256, help="the model's context (max_position_embeddings)")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--checkpoint", default=None, help="a safetensors folder: save writes it, autotp/inject read it")
    ap.add_argument("--no-shm", action="store_true", help="deepspeed: all-reduce with gloo, not its shm C++ op")
    ap.add_argument("--local-size", action="store_true", help="deepspeed: set LOCAL_SIZE as its launcher does")
    ap.add_argument("--cap", type=float, default=240.0, help="seconds before the stacks are dumped and it exits")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    stacks = open(out / f"stacks{rank}.txt", "w")  # noqa: SIM115 (open for the whole run: faulthandler writes to it)
    faulthandler.enable(file=stacks)  # a crash (SIGSEGV ...) writes where it happened too
    faulthandler.dump_traceback_later(args.cap, exit=True, file=stacks)
    stamps = {"start": time.time()}
    ids = prompt(args.prompt, args.batch)
    if args.mode == "deepspeed":
        import deepspeed
        import deepspeed.comm.torch  # noqa: F401  (deepspeed.comm's `torch` attribute is torch itself: use sys.modules)

        if args.local_size:  # the shm op maps its shared workspace only when LOCAL_SIZE equals the world size
            os.environ["LOCAL_SIZE"] = str(world)
        if args.no_shm:  # DeepSpeed then all-reduces through torch.distributed (gloo) in inference_all_reduce
            sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
        deepspeed.init_distributed(dist_backend="gloo")
        engine = deepspeed.init_inference(build(args.size, args.seq), tensor_parallel={"tp_size": world},
                                          dtype=torch.float32, replace_with_kernel_inject=False)  # fmt: skip
        stamps["autotp_applied"] = time.time()
        print(f"rank {rank}: DeepSpeed AutoTP applied", file=sys.stderr, flush=True)
        result = measure(engine.generate, ids, args.new, args.reps)
    elif args.mode == "rollout":
        import zero

        zero.init_distributed(dist_backend="gloo")
        result = rollout(args, ids)
    elif args.mode == "ab":
        torch.set_num_threads(1)
        result = ab(args, ids)
    elif args.mode == "save":
        build(args.size, args.seq).save_pretrained(args.checkpoint, max_shard_size="8MB")
        result = {}
    else:
        from zero_inference import init_inference

        if world > 1:
            dist.init_process_group("gloo")
        dtype = DTYPES[args.dtype]
        from safetensors import safe_open  # noqa: F401  (imported before the memory mark, as the model's classes)
        from transformers.models.llama.modeling_llama import LlamaForCausalLM  # noqa: F401

        import zero.train.model  # noqa: F401

        before = reset_peak_rss()
        model = build_meta(args.size, args.seq) if args.checkpoint else build(args.size, args.seq, dtype)
        if args.mode == "hf":
            generate = model.generate
        elif args.mode == "matmul":
            generate = matmul_step(model, dtype)
        else:
            engine = init_inference(model, tensor_parallel={"tp_size": world}, dtype=dtype, checkpoint=args.checkpoint,
                                    replace_with_kernel_inject=args.mode == "inject")  # fmt: skip
            generate = engine.generate
        load_rss = rss_field("VmHWM") - before
        if args.compile and args.mode in ("autotp", "inject"):  # after the memory mark: compile imports the compiler
            engine.compile()
            generate = engine.generate
        result = measure(generate, ids, args.new, args.reps)
        result["load_rss_bytes"] = load_rss
    faulthandler.cancel_dump_traceback_later()
    result.update(rank=rank, world=world, stamps=stamps,
                  peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # fmt: skip
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():  # gloo aborts a process that exits with its group alive
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
