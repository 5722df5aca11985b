"""Config errors: one line each, naming the key, the value given and what is allowed."""

from __future__ import annotations

import difflib
import types
import typing

import pydantic

from zero.errors import InputError


class ConfigError(InputError, ValueError):
    """A DeepSpeed-style config is invalid. The message names the dotted key, the value given and what is allowed."""


class NotSupportedError(ConfigError):
    """The config asks for a DeepSpeed feature zero does not implement yet (named by its key)."""


def nearest(key: str, valid: typing.Iterable[str]) -> str:
    """'; did you mean 'x'?' for the closest valid key by difflib ratio, else the (at most 3) nearest valid keys:
    never the whole list (a section may have dozens of keys, and the message must stay one short line)."""
    valid = sorted(valid)
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if match:
        return f"; did you mean '{match[0]}'?"
    near = difflib.get_close_matches(key, valid, n=3, cutoff=0.0)
    if len(valid) <= 3:
        near = valid
    return f"; nearest valid keys: {', '.join(repr(k) for k in near)}" if near else ""


def _model_in(annotation: object) -> type[pydantic.BaseModel] | None:
    """The pydantic model class inside an annotation such as ``X | None`` (None when there is none)."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def field_names(cls: type[pydantic.BaseModel]) -> set[str]:
    """Every accepted spelling of the fields of ``cls`` (names and aliases)."""
    names = set()
    for name, info in cls.model_fields.items():
        names.add(name)
        if info.alias:
            names.add(info.alias)
    return names


def _model_at(root: type[pydantic.BaseModel], loc: tuple) -> type[pydantic.BaseModel] | None:
    cls = root
    for part in loc:
        if cls is None or not isinstance(part, str):
            return None
        info = cls.model_fields.get(part) or next((f for f in cls.model_fields.values() if f.alias == part), None)
        if info is None:
            return None
        cls = _model_in(info.annotation)
    return cls


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def format_validation_error(err: pydantic.ValidationError, root: type[pydantic.BaseModel], prefix: str = "") -> str:
    """Turn a pydantic error into one line per problem: key, value given, what is allowed (or nearest valid key)."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in ((prefix,) if prefix else ()) + loc)
        if e["type"] == "extra_forbidden":
            parent = _model_at(root, loc[:-1])
            hint = nearest(str(loc[-1]), field_names(parent)) if parent is not None else ""
            lines.append(f"unknown config key '{key}'{hint}")
        elif not key:
            lines.append("config: " + e["msg"].removeprefix("Value error, "))
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"config key '{key}': got {_short(e.get('input'))}; {msg}")
    return "; ".join(lines)
