"""What the peer checks give each implementation (gpu/peers.py, gpu/capacity.py): the Llama shapes, the
configurations compared, the one config dict that zero and DeepSpeed both receive, FSDP2's equivalent, and the
optimizer hyper-parameters all three share. Pure data and dict building: no torch, so CPU tests read it cheaply.

A configuration is named as DeepSpeed names it:

* ``stage2`` / ``stage3``: ZeRO stage 2 / 3, everything on the GPU. FSDP2: ``fully_shard`` on every decoder layer
  and the root, ``reshard_after_forward`` False (stage 2's kept parameters) / True (stage 3's).
* ``zero-offload``: stage 2 with ``offload_optimizer`` cpu (ZeRO-Offload, Ren et al. 2021). FSDP2 has no
  optimizer-only offload (its ``CPUOffloadPolicy`` moves the parameters too): no FSDP2 row.
* ``superoffload``: stage 3 with ``offload_optimizer`` cpu and ``super_offload`` (DeepSpeed builds SuperOffload
  at stage 3 only). No FSDP2 row.
* ``param-offload``: stage 3 with ``offload_param`` and ``offload_optimizer`` on cpu (ZeRO-Infinity's CPU tier).
  FSDP2: ``CPUOffloadPolicy`` (sharded parameters, gradients and the optimizer step on the host).
* ``compiled-z3``: stage 3 compiled: ``compile.deepcompile`` for zero and DeepSpeed (``engine.compile()`` called
  for both); FSDP2: each decoder layer ``torch.compile``d (inductor) before ``fully_shard``.

Every run: bf16 parameters and gradients, fp32 master weights and AdamW moments, gradient clipping at ``CLIP``
(explicit: DeepSpeed clips at 1.0 when the key is absent; FSDP2 calls ``clip_grad_norm_``), ``overlap_comm`` on,
one micro-batch per step.
"""

from __future__ import annotations

import dataclasses
import math

LR, BETAS, EPS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 1e-8, 0.01
CLIP = 1.0  # gradient norm clipping, the same for every peer
VOCAB = 259  # the main job's byte vocabulary (zero.train.data): 256 bytes + BOS, EOS, PAD


@dataclasses.dataclass(frozen=True)
class Shape:
    """A Llama decoder (transformers ``LlamaForCausalLM``, untied embeddings, as many key/value heads as heads)."""

    hidden: int
    layers: int
    heads: int
    intermediate: int

    @classmethod
    def llama(cls, hidden: int, layers: int) -> Shape:
        """Llama's proportions: head dimension 128, MLP width 8/3 x hidden rounded up to a multiple of 256."""
        return cls(hidden, layers, max(1, hidden // 128), 256 * math.ceil(8 * hidden / 3 / 256))

    def params(self, vocab: int = VOCAB) -> int:
        """Parameter count: embedding and LM head (vocab x hidden each), per layer q/k/v/o (4 hidden^2), the gated
        MLP (3 hidden x intermediate) and two RMSNorm weights, and the final norm."""
        h = self.hidden
        return 2 * vocab * h + self.layers * (4 * h * h + 3 * h * self.intermediate + 2 * h) + h


# The peers' model: about 410M parameters, so that a step of MICRO x SEQ tokens is about 10 TFLOP of GPU work
# (tens of ms on an H100), as long as the host's per-step work of an eager ZeRO-3 step, instead of the main job's
# 20m Llama, whose step on an H200 was host time only (79 ms eager ZeRO-3 for about 60 GFLOP).
PEER_SHAPE = Shape.llama(2048, 8)
MICRO, SEQ = 4, 1024
# For --device cpu (the machinery checked where there is no GPU): the main job's "tiny" Llama.
CPU_SHAPE, CPU_MICRO, CPU_SEQ = Shape(64, 2, 4, 172), 2, 32


@dataclasses.dataclass(frozen=True)
class Setup:
    """One configuration compared: ZeRO stage, what is offloaded, whether compiled; ``fsdp2`` says why FSDP2 has no
    equivalent (None when it has one)."""

    name: str
    stage: int
    offload_optimizer: str = "none"  # "none", "cpu" or "super" (cpu with super_offload)
    offload_param: bool = False
    compiled: bool = False
    fsdp2_missing: str | None = None


SETUPS = (
    Setup("stage2", 2),
    Setup("stage3", 3),
    Setup("zero-offload", 2, offload_optimizer="cpu",
          fsdp2_missing="FSDP2 has no optimizer-only offload (CPUOffloadPolicy moves the parameters too)"),
    Setup("superoffload", 3, offload_optimizer="super", fsdp2_missing="FSDP2 has no SuperOffload"),
    Setup("param-offload", 3, offload_optimizer="cpu", offload_param=True),
    Setup("compiled-z3", 3, compiled=True),
)  # fmt: skip
SETUP_NAMES = tuple(s.name for s in SETUPS)
PEERS = ("zero", "deepspeed", "fsdp2")


def setup_named(name: str) -> Setup:
    """The Setup called ``name``. Raises KeyError naming the known ones."""
    for s in SETUPS:
        if s.name == name:
            return s
    raise KeyError(f"unknown configuration {name!r}; known: {', '.join(SETUP_NAMES)}")


def runs(setup: Setup, peer: str) -> bool:
    """Whether ``peer`` has an equivalent of ``setup``."""
    return not (peer == "fsdp2" and setup.fsdp2_missing)


def optimizer_params() -> dict:
    """AdamW's hyper-parameters, in DeepSpeed's config spelling (also torch.optim.AdamW's keyword arguments)."""
    return {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY}


def engine_config(setup: Setup, micro: int, pin_memory: bool = True) -> dict:
    """The config dict given to both ``zero.initialize`` and ``deepspeed.initialize`` (DeepSpeed's format, no key
    of zero's own): world size 1, ``micro`` sequences per step, AdamW named in the config (DeepSpeed then runs its
    FusedAdam, or DeepSpeedCPUAdam when the optimizer is offloaded; zero its own equivalents), every key whose
    default could differ between the two set explicitly. ``pin_memory``: the offload sections' (False on a CPU-only
    torch, where pinning raises)."""
    zo: dict = {"stage": setup.stage, "overlap_comm": True}
    if setup.offload_optimizer != "none":
        zo["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
        if setup.offload_optimizer == "super":
            zo["offload_optimizer"]["super_offload"] = True
    if setup.offload_param:
        zo["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    cfg = {
        "train_batch_size": micro,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": optimizer_params()},
        "gradient_clipping": CLIP,
        "bf16": {"enabled": True},
        "fp16": {"enabled": False},
        "zero_optimization": zo,
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if setup.compiled:
        cfg["compile"] = {"deepcompile": True}
    return cfg


def fsdp2_plan(setup: Setup) -> dict:
    """FSDP2's equivalent of ``setup``: ``reshard_after_forward`` (stage 3: True), ``cpu_offload``
    (``CPUOffloadPolicy``), ``compile`` (each decoder layer compiled before it is sharded). Raises ValueError where
    FSDP2 has none (``setup.fsdp2_missing``)."""
    if setup.fsdp2_missing:
        raise ValueError(f"{setup.name}: {setup.fsdp2_missing}")
    return {"reshard_after_forward": setup.stage == 3, "cpu_offload": setup.offload_param, "compile": setup.compiled}
