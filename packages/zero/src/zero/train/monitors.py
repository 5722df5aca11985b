"""``zero train --monitor tensorboard,csv_monitor,wandb,comet``: the monitor sections added to the job's config."""

from __future__ import annotations

import importlib.util
import pathlib

from zero.commands.errors import UsageError

# monitor -> (the package it needs, the extra that installs it)
NEEDS = {"tensorboard": ("tensorboard", "tensorboard"), "csv_monitor": (None, None), "wandb": ("wandb", "wandb"),
         "comet": ("comet_ml", "comet")}  # fmt: skip
ALIASES = {"csv": "csv_monitor", "tb": "tensorboard"}


def with_monitors(config: dict, names: str | None, run_dir: pathlib.Path) -> dict:
    """``config`` with each monitor in the comma list ``names`` enabled, writing under ``run_dir/monitors``
    (wandb: project ``zero-train``, run named after the folder). Raises UsageError for an unknown name or a
    missing library (naming the extra to install), before any rank starts."""
    if not names:
        return config
    config = dict(config)
    for raw in names.split(","):
        name = ALIASES.get(raw.strip(), raw.strip())
        if name not in NEEDS:
            raise UsageError(f"--monitor: {raw!r} is not one of {', '.join(NEEDS)}")
        module, extra = NEEDS[name]
        if module is not None and importlib.util.find_spec(module) is None:
            raise UsageError(f"--monitor {name}: the {module!r} package is not installed; pip install 'zero[{extra}]'")
        section = {"enabled": True}
        if name in ("tensorboard", "csv_monitor"):
            section.update(output_path=str(run_dir / "monitors"), job_name=name)
        elif name == "wandb":
            section["project"] = "zero-train"
        elif name == "comet":
            section["experiment_name"] = run_dir.name
        config[name] = section
    return config
