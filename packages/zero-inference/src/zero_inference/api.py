"""``init_inference(model, config=None, **kwargs)``: DeepSpeed 0.19.8's entry point to inference.

``config`` is a dict or the path of a JSON file; keyword arguments are merged into it, a key given in both with
different values refused (DeepSpeed: "Conflicting argument"). The merged dict becomes a
:class:`~zero_inference.config.DeepSpeedInferenceConfig` and the model an
:class:`~zero_inference.engine.InferenceEngine`.
"""

from __future__ import annotations

import json
import os

import torch

from zero_inference.config import DeepSpeedInferenceConfig
from zero_inference.engine import InferenceEngine


def init_inference(model: torch.nn.Module, config: dict | str | os.PathLike | None = None, **kwargs) -> InferenceEngine:
    """Wrap ``model`` for inference: convert its dtype, split it over ``tensor_parallel.tp_size`` ranks (AutoTP).

    Args:
        model: an ``nn.Module`` (a transformers model for ``generate`` and the head-count checks), the same on every
            rank of the tensor-parallel group (the group's first rank's weights are used).
        config: DeepSpeed's inference config: a dict, a JSON file path, or None.
        **kwargs: config keys (``dtype=torch.float32``, ``tensor_parallel={"tp_size": 2}``, ``mp_size=2`` ...).

    Returns:
        The :class:`InferenceEngine` (``engine(...)`` is the model's forward, ``engine.generate(...)`` its
        ``generate``, ``engine.module`` the model).

    Raises:
        ValueError: ``config`` is neither a dict nor a path; a key in ``config`` and ``kwargs`` with different
            values; the engine's errors (:class:`InferenceEngine`); InferenceConfigError for a bad key.
    """
    if config is None:
        config = {}
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    elif not isinstance(config, dict):
        raise ValueError(f"init_inference: config must be a dict or a JSON file path, not {type(config).__name__}")
    merged = dict(config)
    for key, value in kwargs.items():
        if key in merged and merged[key] != value:
            raise ValueError(f"init_inference: conflicting argument {key!r}: {merged[key]!r} in config and "
                             f"{value!r} as a keyword")  # fmt: skip
        merged[key] = value
    return InferenceEngine(model, DeepSpeedInferenceConfig(**merged))
