"""Top-level keys spelled as dotted paths (``"zero_optimization.reduce_bucket_size": ...``), which TRL's
``prepare_deepspeed`` adds to the config of its reference and reward models at ZeRO-3.

DeepSpeed 0.19.8 reads its top-level config by name (``param_dict.get(...)``), so such a key is accepted there and
has no effect: the nested value, or the default, is what runs. zero does the same, and warns once per config
naming the keys and where to write them for them to count. A dotted key whose path names no field of zero's config
is still an error naming the key and its nearest valid names.
"""

from __future__ import annotations

import warnings

import pydantic

from zero.config.errors import ConfigError, _model_at, field_names, nearest


def drop_dotted_keys(raw: dict, root: type[pydantic.BaseModel]) -> dict:
    """``raw`` without its top-level dotted keys whose path names a field of ``root`` (a ``UserWarning`` lists
    them); other keys untouched.

    Raises:
        ConfigError: a dotted key whose path names no field (with the nearest names at the first wrong part).
    """
    dotted = [k for k in raw if isinstance(k, str) and "." in k]
    if not dotted:
        return raw
    for key in dotted:
        parts = key.split(".")
        for i, part in enumerate(parts):
            parent = _model_at(root, tuple(parts[:i]))
            if parent is None:  # below a free-form field (e.g. optimizer params): DeepSpeed ignores it too
                break
            if part not in field_names(parent):
                raise ConfigError(f"unknown config key '{key}': '{'.'.join(parts[: i + 1])}' is not a config key"
                                  f"{nearest(part, field_names(parent))}")  # fmt: skip
    warnings.warn(
        f"config keys {', '.join(repr(k) for k in dotted)} are written as dotted top-level keys, which DeepSpeed "
        "ignores and so does zero; to set them, nest them (e.g. {'zero_optimization': {'reduce_bucket_size': ...}})",
        UserWarning,
        stacklevel=3,
    )
    return {k: v for k, v in raw.items() if k not in dotted}
