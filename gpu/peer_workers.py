"""One peer's training process for gpu/peers.py and gpu/capacity.py: the model every peer gets, each peer wrapped
for a configuration (zero, DeepSpeed, FSDP2), and the worker loop gpu/peers.py drives over a pipe.

Every peer gets the same model: transformers ``LlamaForCausalLM`` of a :class:`peer_configs.Shape`, built from one
seed on the device with its weights rounded to bf16 values (DeepSpeed derives its fp32 master weights from the
bf16 copy; rounded, zero's and FSDP2's fp32 masters start from the same values), and the same batches: byte tokens
of the stdlib's source files (benchmarks/train_worker.py's ``batches``).

The worker (:func:`serve`) answers messages ``("setup", name)`` (wrap a fresh model for the configuration),
``("steps", first, count)`` (train on batches ``first..first+count-1``; each step timed between two device
synchronisations), ``("close",)`` (drop the configuration; say how much device memory it left held) and
``("exit",)`` with ``("ok", dict)`` or ``("error", traceback)``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
import traceback
from pathlib import Path

import peer_configs as pc

ROOT = Path(__file__).resolve().parents[1]
SEED = 1234


def build_model(shape: pc.Shape, seq: int, device: str, dtype=None, round_to_bf16: bool = True):
    """``LlamaForCausalLM`` of ``shape`` for sequences of ``seq`` tokens, built on ``device`` from :data:`SEED`
    (sdpa attention). ``dtype``: the parameters' dtype, set while the model is built (None: fp32; bf16 builds a
    large model without an fp32 copy). ``round_to_bf16``: fp32 weights rounded to bf16 values (see the module
    docstring)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=pc.VOCAB, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.heads, max_position_embeddings=seq, bos_token_id=256,
                      eos_token_id=257, pad_token_id=258, tie_word_embeddings=False,
                      attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(SEED)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype or torch.float32)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    if round_to_bf16 and dtype in (None, torch.float32):
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16))
    return model


def batches(count: int, micro: int, seq: int, device: str) -> list:
    """``count`` batches of ``micro`` x ``seq`` token ids on ``device``, the same in every process."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from train_worker import batches as text_batches

    return [b.to(device) for b in text_batches(count, micro, seq, 0, 1)]


class EnginePeer:
    """zero or DeepSpeed: ``initialize`` with :func:`peer_configs.engine_config` (the same dict for both), then
    ``engine.compile()`` for the compiled configuration (DeepSpeed compiles DeepCompile's graphs there; zero keeps
    what ``initialize`` built)."""

    def __init__(self, name: str, setup: pc.Setup, model, micro: int, pin_memory: bool):
        module = __import__("deepspeed" if name == "deepspeed" else "zero")
        cfg = pc.engine_config(setup, micro, pin_memory)
        self.engine, *_ = module.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        if setup.compiled:
            self.engine.compile(backend="inductor")

    def step(self, batch):
        loss = self.engine(input_ids=batch, labels=batch).loss
        self.engine.backward(loss)
        self.engine.step()
        return loss

    def close(self) -> None:
        self.engine.destroy()
        self.engine = None  # the engine holds the model and its states: dropped so they can be freed


class Fsdp2Peer:
    """PyTorch FSDP2: ``fully_shard`` on each decoder layer and the root as :func:`peer_configs.fsdp2_plan` says
    (bf16 parameters and reductions, fp32 sharded masters), torch's fused AdamW (on the host with
    ``CPUOffloadPolicy``), ``clip_grad_norm_`` at :data:`peer_configs.CLIP`."""

    def __init__(self, setup: pc.Setup, model, pin_memory: bool):
        import torch
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        plan = pc.fsdp2_plan(setup)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        offload = CPUOffloadPolicy(pin_memory=pin_memory) if plan["cpu_offload"] else OffloadPolicy()
        for layer in model.model.layers:
            if plan["compile"]:
                layer.compile(backend="inductor")
            fully_shard(layer, reshard_after_forward=plan["reshard_after_forward"], mp_policy=mp,
                        offload_policy=offload)  # fmt: skip
        fully_shard(model, reshard_after_forward=plan["reshard_after_forward"], mp_policy=mp, offload_policy=offload)
        self.model = model
        self.optimizer = fsdp2_optimizer(model.parameters())

    def step(self, batch):
        import torch

        loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), pc.CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def close(self) -> None:
        self.model = self.optimizer = None  # dropped so the parameters and the states can be freed


def fsdp2_optimizer(params):
    """FSDP2's optimizer: torch's fused AdamW with :func:`peer_configs.optimizer_params` (what zero and DeepSpeed
    read from the config's ``optimizer`` section)."""
    import torch

    hyper = pc.optimizer_params()
    hyper["betas"] = tuple(hyper["betas"])
    return torch.optim.AdamW(params, fused=True, **hyper)


def wrap(peer: str, setup: pc.Setup, model, micro: int, device: str):
    """``peer`` ("zero", "deepspeed", "fsdp2") wrapping ``model`` for ``setup``: an object with ``step(batch) ->
    loss`` and ``close()``."""
    pin = device == "cuda"  # a CPU-only torch cannot pin
    if peer == "fsdp2":
        return Fsdp2Peer(setup, model, pin)
    return EnginePeer(peer, setup, model, micro, pin)


def start_process_group(peer: str, device: str) -> None:
    """World size 1 from the environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT set by the caller): NCCL on a GPU,
    gloo on the CPU; DeepSpeed through its own ``init_distributed`` (it then knows the group)."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(0)
    if peer == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend, verbose=False)
    else:
        dist.init_process_group(backend)


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def peak_device_bytes(device: str) -> int | None:
    if device != "cuda":
        return None
    import torch

    return torch.cuda.max_memory_allocated()


def device_bytes(device: str) -> int:
    """Bytes of device memory this process's tensors hold now (0 on the CPU)."""
    if device != "cuda":
        return 0
    import torch

    return torch.cuda.memory_allocated()


def free(device: str) -> None:
    """Collect what a closed peer left and return the device's cached blocks."""
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


class Worker:
    """The state of one peer's process between messages: the batches, the wrapped model of the configuration now
    set up (None between configurations)."""

    def __init__(self, peer: str, device: str, shape: pc.Shape, micro: int, seq: int, count: int):
        self.peer = peer
        self.device = device
        self.shape = shape
        self.micro = micro
        self.seq = seq
        self.data = batches(count, micro, seq, device)
        self.wrapped = None  # the peer around this configuration's model, from "setup" to "close"
        # DeepSpeed's SuperOffload narrows this process's CPU affinity to a fifth of the cores and leaves it so:
        # restored after each configuration, so the next one's host step has every core
        self.cores = os.sched_getaffinity(0)

    def setup(self, name: str) -> dict:
        t0 = time.perf_counter()
        setup = pc.setup_named(name)
        model = build_model(self.shape, self.seq, self.device)
        params = sum(p.numel() for p in model.parameters())
        self.wrapped = wrap(self.peer, setup, model, self.micro, self.device)
        sync(self.device)
        return {"setup_s": time.perf_counter() - t0, "params": params}

    def steps(self, first: int, count: int) -> dict:
        times, losses = [], []
        for batch in self.data[first : first + count]:
            sync(self.device)
            t0 = time.perf_counter()
            loss = self.wrapped.step(batch)
            sync(self.device)
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach().float()))
        return {"times": times, "losses": losses}

    def close(self) -> dict:
        peak = peak_device_bytes(self.device)
        if self.wrapped is not None:
            self.wrapped.close()
        self.wrapped = None
        free(self.device)
        os.sched_setaffinity(0, self.cores)
        return {"peak_device_bytes": peak, "left_device_bytes": device_bytes(self.device)}


def serve(conn, peer: str, device: str, shape: pc.Shape, micro: int, seq: int, count: int, env: dict) -> None:
    """The worker process's main loop (a ``multiprocessing`` spawn target): see the module docstring. ``env`` is
    put in ``os.environ`` before torch or the peer's library is imported (rank, port, DS_ACCELERATOR)."""
    os.environ.update(env)
    try:
        t0 = time.perf_counter()
        start_process_group(peer, device)
        import peer_ops

        ops = peer_ops.preload(peer, device)  # JIT op builds (or cache loads), timed apart from every step
        worker = Worker(peer, device, shape, micro, seq, count)
        conn.send(("ok", {"start_s": time.perf_counter() - t0, "ops": ops}))
    except BaseException:  # noqa: BLE001 - reported to the parent, which records it
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        msg = conn.recv()
        if msg[0] == "exit":
            with contextlib.suppress(Exception):
                import torch.distributed as dist

                dist.destroy_process_group()
            conn.send(("ok", {}))
            return
        try:
            handler = {"setup": worker.setup, "steps": worker.steps, "close": worker.close}[msg[0]]
            conn.send(("ok", handler(*msg[1:])))
        except BaseException:  # noqa: BLE001 - reported to the parent, which records it and replaces the worker
            conn.send(("error", traceback.format_exc()))
