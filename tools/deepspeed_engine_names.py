"""List the public names of DeepSpeed's engine and ZeRO-3 optimizer (the surface zero's engine mirrors).

Run under a real DeepSpeed 0.19.8 (not needed by CI; its output is the fixture
``packages/zero/tests/deepspeed_engine_names.txt``)::

    PYTHONPATH=/work/ds/site:/work/ds/deps DS_ACCELERATOR=cpu python tools/deepspeed_engine_names.py \
        packages/zero/tests/deepspeed_engine_names.txt

It builds one stage-3 engine (world 1, gloo, a tiny model, a torch optimizer) and writes, sorted, one line per
name: ``engine <name>`` for the public attributes of ``DeepSpeedEngine`` beyond ``torch.nn.Module``'s, and
``optimizer <name>`` for the attributes of its ZeRO optimizer that integrations read (:data:`OPTIMIZER_NAMES`,
each checked to exist on DeepSpeed's). DeepSpeed prints build messages on stdout, hence the output path.
"""

from __future__ import annotations

import os

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29517")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("LOCAL_RANK", "0")

import sys  # noqa: E402

import deepspeed  # noqa: E402
import torch  # noqa: E402

OPTIMIZER_NAMES = (
    "cur_scale",  # Accelerate, HF Trainer: the fp16 loss scale
    "dynamic_loss_scale",
    "loss_scale",
    "loss_scaler",
    "offload_states",  # OpenRLHF, ROLL: between rollouts
    "optimizer",  # the wrapped torch optimizer (its state)
    "overflow",  # Accelerate's step_was_skipped
    "param_groups",  # every scheduler and the lr readers
    "refresh_fp32_params",  # after editing the 16-bit weights
    "reload_states",
    "state",
)
"""The ZeRO optimizer's attributes read outside DeepSpeed (its other attributes are its own machinery)."""


def main() -> None:
    """Print the engine's and the optimizer's public names (see the module docstring)."""
    deepspeed.init_distributed(dist_backend="gloo")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    config = {
        "train_batch_size": 2,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
    }
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=config
    )
    lines = [
        f"# DeepSpeed {deepspeed.__version__}, stage 3, world 1: the engine's public names beyond nn.Module's, "
        "and its ZeRO optimizer's names integrations read (tools/deepspeed_engine_names.py)"
    ]
    lines += [f"engine {n}" for n in sorted(set(dir(engine)) - set(dir(torch.nn.Module))) if not n.startswith("_")]
    missing = [n for n in OPTIMIZER_NAMES if not hasattr(optimizer, n)]
    if missing:
        raise SystemExit(f"DeepSpeed's optimizer {type(optimizer).__name__} lacks {missing}")
    lines += [f"optimizer {n}" for n in OPTIMIZER_NAMES]
    with open(sys.argv[1], "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
