"""The autotuner's memory model: bytes per rank of a candidate before it is launched.

Model states follow the ZeRO paper's per-rank accounting (arXiv 1910.02054, section 5), in the form zero_core
measures it (``zero_core.model_state_bytes``; its tests check the same terms): with Ψ elements, N ranks and K
optimizer-state bytes per element (8 for Adam, measured by the profile run)

* stage 0: params Ψ·c, grads Ψ·a, master Ψ·4 unless the fp32 params are the master, optimizer K·Ψ
* stage 1: as stage 0, but master and optimizer only for this rank's Ψ/N
* stage 2: as stage 1, and gradients only Ψ/N
* stage 3: params Ψ/N·p plus the persistent parameters (at most ``stage3_param_persistence_threshold`` elements
  each) whole in the compute dtype, grads Ψ/N·a, master Ψ/N·4 unless the stored fp32 shard is it, optimizer K·Ψ/N

(p, c, a: bytes of the parameter-storage, compute and gradient-accumulation dtypes). Padding is ignored (under
one element per rank per bucket). Activations: the bytes autograd saved per sample in the profile step, times
:data:`PEAK_ACTIVATION_FACTOR` (at the peak, in backward, the gradients of those activations and transient buffers
come on top; measured on the main job's 6m Llama, 2 ranks: peak RSS grew by 70-75 MiB per sample for 37.5 MiB
saved), times the micro-batch; ``overhead`` is what the profile run held beyond model states and activations (the
framework itself, workspace), added to every candidate.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

PEAK_ACTIVATION_FACTOR = 2.0


@dataclass(frozen=True)
class ModelInfo:
    """What the one-step profile run measured (``model_info.json``).

    Attributes:
        num_params: Ψ, elements of all parameters (full, unsharded).
        param_numels: elements of each parameter (for the stage-3 persistence threshold).
        activation_bytes_per_sample: bytes per sample at the peak: saved for backward x PEAK_ACTIVATION_FACTOR.
        optimizer_bytes_per_element: K, optimizer-state bytes per parameter element (Adam: 8).
        overhead_bytes: peak bytes of the profile run minus its model states and activations (>= 0).
    """

    num_params: int
    param_numels: tuple[int, ...]
    activation_bytes_per_sample: float
    optimizer_bytes_per_element: float
    overhead_bytes: int

    @classmethod
    def from_profile(cls, info: dict) -> ModelInfo:
        """From the dict the engine's probe wrote for a stage-0 profile (see ``zero.engine.autotune_probe``).

        Raises: ValueError naming a missing field."""
        for key in ("num_params", "param_numels", "activation_bytes_per_sample", "optimizer_bytes",
                    "model_state_bytes", "peak_bytes", "activation_bytes"):  # fmt: skip
            if key not in info:
                raise ValueError(f"model profile: field {key!r} missing (got {sorted(info)})")
        psi = int(info["num_params"])
        activations = PEAK_ACTIVATION_FACTOR * float(info["activation_bytes"])
        overhead = int(int(info["peak_bytes"]) - int(info["model_state_bytes"]) - activations)
        per_sample = PEAK_ACTIVATION_FACTOR * float(info["activation_bytes_per_sample"])
        return cls(psi, tuple(int(n) for n in info["param_numels"]), per_sample,
                   float(info["optimizer_bytes"]) / max(1, psi), max(0, overhead))  # fmt: skip

    @classmethod
    def load(cls, path: str | os.PathLike) -> ModelInfo:
        """Read ``model_info.json``. Raises: FileNotFoundError, ValueError (bad field)."""
        with open(path) as f:
            return cls.from_profile(json.load(f))


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element of parameter storage (``param``), compute (``compute``), gradient accumulation
    (``accum``) and master weights (``master``), from zero_core's ``PrecisionPolicy``."""

    param: int = 4
    compute: int = 4
    accum: int = 4
    master: int = 4

    @classmethod
    def of(cls, policy) -> Dtypes:
        """From a ``zero_core.PrecisionPolicy`` (its ``param_dtype``, ``compute``, ``accum``, ``master_dtype``)."""
        size = lambda dt: torch.empty(0, dtype=dt).element_size()  # noqa: E731
        return cls(size(policy.param_dtype), size(policy.compute), size(policy.accum), size(policy.master_dtype))


def model_state_prediction(stage: int, psi: int, world: int, dtypes: Dtypes, k: float = 8.0,
                           persistent: int = 0, buckets: int = 1) -> dict[str, int]:  # fmt: skip
    """Predicted ``params``/``grads``/``master``/``optimizer``/``total`` bytes per rank (the module docstring's
    formula; the same keys as ``zero_core.model_state_bytes``).

    Args:
        stage: ZeRO stage 0-3. psi: parameter elements. world: ranks (N). k: optimizer-state bytes per element.
        persistent: stage 3 only, elements of parameters held whole on every rank.
        buckets: stages 1-2, gradient buckets (``reduce_bucket_size``). With more than one, a rank's chunks are
            not contiguous, so at stage 1 zero_core keeps a separate reduced-gradient shard; the fp32 master stays
            a view (one master tensor per bucket: zero_core's DeviceMaster; its README).
    Raises: ValueError for a stage outside 0-3 or world < 1.
    """
    if stage not in (0, 1, 2, 3) or world < 1:
        raise ValueError(f"model_state_prediction: stage must be 0-3 and world >= 1, got stage={stage} world={world}")
    fp32_master_is_param = dtypes.param == dtypes.compute == dtypes.master == 4
    shard = psi / world
    if stage == 0:
        out = dict(params=psi * dtypes.compute, grads=psi * dtypes.accum,
                   master=0 if fp32_master_is_param else psi * dtypes.master, optimizer=k * psi)  # fmt: skip
    elif stage < 3:
        grads = (
            psi * dtypes.accum + (0 if buckets == 1 else shard * dtypes.accum) if stage == 1 else shard * dtypes.accum
        )
        out = dict(params=psi * dtypes.compute, grads=grads,
                   master=0 if fp32_master_is_param else shard * dtypes.master, optimizer=k * shard)  # fmt: skip
    else:
        alias = dtypes.param == dtypes.master == 4
        out = dict(params=shard * dtypes.param + persistent * dtypes.compute, grads=shard * dtypes.accum,
                   master=0 if alias else shard * dtypes.master, optimizer=k * shard)  # fmt: skip
    out = {key: int(v) for key, v in out.items()}
    out["total"] = sum(out.values())
    return out


def persistent_elements(param_numels, threshold: int) -> int:
    """Elements of the parameters small enough (``numel <= threshold``) to stay whole at stage 3."""
    return sum(n for n in param_numels if n <= threshold)


@dataclass(frozen=True)
class Prediction:
    """Bytes per rank predicted for one candidate: ``model_states`` (formula), ``activations``, ``overhead``."""

    model_states: int
    activations: int
    overhead: int

    @property
    def total(self) -> int:
        return self.model_states + self.activations + self.overhead


class MemoryModel:
    """Predicts a candidate's bytes per rank and says whether it fits ``budget`` bytes.

    Args:
        info: the profile's :class:`ModelInfo`. world: ranks. dtypes: the config's precision.
        budget: bytes per rank a candidate may use (see :func:`memory_budget`).
    """

    def __init__(self, info: ModelInfo, world: int, dtypes: Dtypes, budget: int):
        self.info, self.world, self.dtypes, self.budget = info, world, dtypes, budget

    def predict(self, stage: int, micro_batch: int, persistence_threshold: int = 100_000,
                reduce_bucket_size: int = 500_000_000) -> Prediction:  # fmt: skip
        """Bytes per rank of ``stage`` at ``micro_batch`` samples per rank per micro-step."""
        persistent = persistent_elements(self.info.param_numels, persistence_threshold) if stage == 3 else 0
        buckets = -(-self.info.num_params // max(1, int(reduce_bucket_size)))
        k = self.info.optimizer_bytes_per_element
        states = model_state_prediction(stage, self.info.num_params, self.world, self.dtypes, k, persistent, buckets)[
            "total"
        ]
        return Prediction(states, int(self.info.activation_bytes_per_sample * micro_batch), self.info.overhead_bytes)

    def fits(self, stage: int, micro_batch: int, persistence_threshold: int = 100_000) -> bool:
        """True when the prediction is within the budget."""
        return self.predict(stage, micro_batch, persistence_threshold).total <= self.budget

    def largest_micro_batch(self, stage: int, lo: int, hi: int, persistence_threshold: int = 100_000) -> int | None:
        """The largest micro-batch in ``[lo, hi]`` that fits (activations grow linearly), or None."""
        if not self.fits(stage, lo, persistence_threshold):
            return None
        per_sample = max(self.info.activation_bytes_per_sample, 1e-9)
        fixed = self.predict(stage, 0, persistence_threshold).total
        return int(min(hi, max(lo, (self.budget - fixed) // per_sample)))


def memory_budget(world_local: int, configured: int | None = None) -> int:
    """Bytes per rank a candidate may use: ``configured`` when given; else the free accelerator memory (CUDA), or
    on CPU the host's ``MemAvailable`` (``/proc/meminfo``) divided by the ranks on this machine."""
    if configured:
        return int(configured)
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return int(free)
    available = _mem_available()
    return available // max(1, world_local)


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
