"""Typed configuration from YAML: dataclasses, strict keys, ``--set a.b=c`` overrides.

Unknown keys are errors that list the valid ones, so a typo never silently falls back to a
default. Lists of dataclasses (a recipe's stages) are addressed by index: ``stages.0.tokens=2e5``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from attn2ssm.errors import ConfigError


def parse_value(text: str) -> Any:
    """A ``--set`` value as YAML would read it (numbers, bools, lists, null), ``1e5`` as a number."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"value {text!r} is not valid YAML ({_yaml_problem(exc)})",
            "write a number, true/false, null, a [list] or plain text (quote text with YAML syntax in it)",
        ) from None
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            return value
    return value


def apply_overrides(raw: dict, overrides: list[str] | None) -> dict:
    """Apply ``a.b.c=value`` strings to a nested dict/list structure (in place; returns it)."""
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(
                f"override '{item}' has no '='", "write it as key.path=value, e.g. data.block_len=256"
            )
        path, value = item.split("=", 1)
        keys = path.strip().split(".")
        node = raw
        for i, key in enumerate(keys):
            last = i == len(keys) - 1
            if isinstance(node, list):
                if not key.isdigit() or int(key) >= len(node):
                    raise ConfigError(
                        f"override '{path}': '{key}' is not an index of a list of {len(node)}",
                        "use a valid index, e.g. stages.0.tokens=1000",
                    )
                key = int(key)
            if last:
                node[key] = parse_value(value)
            else:
                if isinstance(node, dict) and key not in node:
                    node[key] = {}
                node = node[key]
    return raw


def _unwrap_optional(tp):
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _convert(tp, value, where: str):
    tp = _unwrap_optional(tp)
    if value is None:
        return None
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(
                f"{where} must be a mapping, got {type(value).__name__}",
                "see the recipe reference in the README",
            )
        return from_dict(tp, value, where)
    origin = typing.get_origin(tp)
    if origin is list:
        (item_tp,) = typing.get_args(tp) or (Any,)
        if not isinstance(value, list):
            value = [value]
        return [_convert(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if tp in (int, float, str, bool) and not isinstance(value, tp):
        article = "an" if tp.__name__[0] in "aeiou" else "a"
        raise ConfigError(
            f"{where} must be {tp.__name__}, got {value!r}", f"set {where} to {article} {tp.__name__}"
        )
    return value


def from_dict(cls, data: dict, where: str = "config"):
    """Build dataclass ``cls`` from ``data``; unknown keys raise ConfigError listing valid ones."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(repr(k) for k in unknown)} in {where}",
            f"valid keys: {', '.join(fields)}",
        )
    hints = typing.get_type_hints(cls)
    kwargs = {name: _convert(hints[name], value, f"{where}.{name}") for name, value in data.items()}
    return cls(**kwargs)


def to_dict(obj) -> dict:
    return dataclasses.asdict(obj)


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"config file not found: {path}",
            "check the path or run 'attn2ssm recipes' to list built-in recipes",
        )
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        problem = (
            f"not UTF-8 text ({exc.reason})"
            if isinstance(exc, UnicodeDecodeError)
            else f"not valid YAML: {_yaml_problem(exc)}"
        )
        raise ConfigError(
            f"{path} is {problem}", "fix the file (run 'attn2ssm recipes quickstart' to see a valid recipe)"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path} must hold a mapping at the top level", "see recipes/quickstart.yaml for the layout"
        )
    return data


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What PyYAML found wrong and where (line and column, 1-based), on one line."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem
