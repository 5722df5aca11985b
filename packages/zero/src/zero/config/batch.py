"""The batch-size triple: global batch = micro-batch per rank x gradient accumulation steps x world size."""

from __future__ import annotations

from dataclasses import dataclass

from zero.config.errors import ConfigError

TRAIN = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"


@dataclass(frozen=True)
class BatchSizes:
    """Resolved batch sizes (samples). Invariant: ``train_batch_size == micro x gas x world_size``."""

    train_batch_size: int
    micro_batch_per_gpu: int
    gradient_accumulation_steps: int
    world_size: int


def _positive(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"config key '{name}': got {value!r}; must be a positive integer (samples)")
    return value


ONE_PROCESS_HINT = (
    "; {TRAIN} = {MICRO} x {GAS} x 1, so the config was filled for one process: transformers' Trainer and "
    "Accelerate do that on a machine without CUDA, where they find no distributed backend for DeepSpeed. Trainer: "
    "pass use_cpu=True to TrainingArguments (with the DeepSpeed config; it then runs the {world} ranks on gloo). "
    'Accelerate: create accelerate.PartialState(backend="gloo") before the Accelerator (Trainer: and '
    'accelerator_config={{"use_configured_state": True}})'
)
"""Added to the mismatch error when the global batch was computed for a world of one process."""


def _mismatch(train: int, micro: int, gas: int, world_size: int) -> ConfigError:
    hint = ""
    if world_size > 1 and train == micro * gas:
        hint = ONE_PROCESS_HINT.format(TRAIN=TRAIN, MICRO=MICRO, GAS=GAS, world=world_size)
    return ConfigError(
        f"batch sizes do not multiply out: {TRAIN}={train} must equal {MICRO}={micro} x {GAS}={gas} x "
        f"world size {world_size} (= {micro * gas * world_size}){hint}"
    )


def resolve_batch(train: object, micro: object, gas: object, world_size: int) -> BatchSizes:
    """Fill the missing members of the batch triple the way DeepSpeed does, then check the invariant.

    Mirrors ``DeepSpeedConfig._set_batch_related_parameters``: all three given -> checked; global + micro -> gas
    derived; global + gas -> micro derived; micro + gas -> global derived; only global -> gas 1 and micro =
    global / world size; only micro -> gas 1 and global = micro x world size. Unlike older DeepSpeed, a derivation
    that does not divide evenly is an error, never a silent floor.

    Args: the three config values (``None`` when absent) and the data-parallel world size.
    Raises: ConfigError naming the key for zero/negative/non-integer values, none given, or a mismatch (the message
    holds the three numbers and the world size).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        raise ConfigError(f"world size must be a positive integer, got {world_size!r}")
    t, m, g = _positive(TRAIN, train), _positive(MICRO, micro), _positive(GAS, gas)
    ws = world_size
    if t is None and m is None:
        raise ConfigError(f"config needs '{TRAIN}' or '{MICRO}' (neither was given)")
    if t is not None and m is not None and g is None:
        if t % (m * ws):
            raise ConfigError(f"{TRAIN}={t} is not divisible by {MICRO}={m} x world size {ws}; cannot derive {GAS}")
        g = t // (m * ws)
    elif t is not None and m is None:
        g = g if g is not None else 1
        if t % (g * ws):
            raise ConfigError(f"{TRAIN}={t} is not divisible by {GAS}={g} x world size {ws}; cannot derive {MICRO}")
        m = t // (g * ws)
    elif t is None:
        g = g if g is not None else 1
        t = m * g * ws
    if t != m * g * ws:
        raise _mismatch(t, m, g, ws)
    return BatchSizes(t, m, g, ws)
