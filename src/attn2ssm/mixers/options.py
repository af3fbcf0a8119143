"""A mixer's options, checked against the types its constructor declares.

Every keyword of a mixer's ``__init__`` after ``geometry`` and ``layer_idx`` is an option, and its
annotation is its type: ``bool``, ``int``, ``float``, ``str``, ``dict``, a ``tuple`` of numbers, any
of them ``| None``; ``Annotated`` with ``AtLeast`` adds a lower bound (``PositiveInt``,
``NonNegativeInt``, ``PositiveFloat``). A mixer whose ``__init__`` takes ``**options`` and hands
them to its base class (``linear_attention_heads``) has the base class's options too.
``check_options`` is the one check of both ``convert --option`` and a recipe's
``student.mixer_options``: an unknown name or a value of the wrong type is a one-line ConfigError
before anything is built, and a number YAML read as text (``1e-3``) becomes the number.
"""

from __future__ import annotations

import inspect
import math
import types
import typing
from typing import Annotated, NamedTuple

from attn2ssm.errors import ConfigError
from attn2ssm.mixers.ssm_common import AUTO

_NOT_OPTIONS = ("self", "geometry", "layer_idx")
# Options that may name a teacher setting, made concrete when the student is built (resolve_norm_eps).
_TEACHER_SETTINGS = {"norm_eps": AUTO}


class AtLeast(NamedTuple):
    """A lower bound on a numeric option (``strict``: the bound itself is out)."""

    low: float
    strict: bool = False


PositiveInt = Annotated[int, AtLeast(1)]
NonNegativeInt = Annotated[int, AtLeast(0)]
PositiveFloat = Annotated[float, AtLeast(0.0, strict=True)]


def option_types(cls) -> dict[str, tuple[object, object]]:
    """``{name: (declared type, default)}`` of mixer class ``cls``'s options, in signature order."""
    hints = typing.get_type_hints(cls.__init__, include_extras=True)
    params = inspect.signature(cls.__init__).parameters
    out = {
        name: (hints.get(name, typing.Any), p.default)
        for name, p in params.items()
        if name not in _NOT_OPTIONS and p.kind is not p.VAR_KEYWORD
    }
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):  # **options handed on: the base class's too
        base = next(b for b in cls.__mro__[1:] if "__init__" in b.__dict__)
        out.update({k: v for k, v in option_types(base).items() if k not in out})
    return out


def check_options(kind: str, cls, options: dict | None) -> dict:
    """``options`` for a ``kind`` mixer (class ``cls``) with every value checked against its
    declared type (numbers YAML read as text made numbers); a ConfigError names the first wrong one."""
    declared = option_types(cls)
    unknown = sorted(set(options or {}) - set(declared))
    if unknown:
        raise ConfigError(
            f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} for mixer '{kind}'",
            f"valid options: {', '.join(declared)}",
        )
    checked = {}
    for name, value in (options or {}).items():
        tp, default = declared[name]
        if _TEACHER_SETTINGS.get(name, object()) == value:
            checked[name] = value
            continue
        ok, value = _fits(tp, value)
        if not ok:
            what = describe(tp) + (f" or {_TEACHER_SETTINGS[name]}" if name in _TEACHER_SETTINGS else "")
            raise ConfigError(
                f"mixer '{kind}' option {name}={value!r} is not {what}",
                f"set {name} to {what} (its default is {_yaml(default)})",
            )
        checked[name] = value
    return checked


def _parts(tp) -> tuple[object, AtLeast | None, bool]:
    """(base type, bound, None allowed) of a declared option type."""
    optional = False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        optional = type(None) in args
        rest = [a for a in args if a is not type(None)]
        tp = rest[0] if len(rest) == 1 else typing.Any
    bound = None
    if typing.get_origin(tp) is Annotated:
        tp, *extras = typing.get_args(tp)
        bound = next((e for e in extras if isinstance(e, AtLeast)), None)
    return tp, bound, optional


def _fits(tp, value) -> tuple[bool, object]:
    """Whether ``value`` fits declared type ``tp``, and the value as the mixer takes it."""
    base, bound, optional = _parts(tp)
    if value is None:
        return optional or base is typing.Any, value
    if base is float and isinstance(value, str):
        try:  # YAML 1.1 reads 1e-3 (no dot) as text
            value = float(value)
        except ValueError:
            return False, value
    if base is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if base in (int, float):
        ok = _is_number(value) and (base is float or isinstance(value, int))
        if ok and bound is not None:
            ok = value > bound.low if bound.strict else value >= bound.low
        return ok, value
    if base in (bool, str, dict):
        return isinstance(value, base), value
    if typing.get_origin(base) is tuple:
        items = typing.get_args(base)
        ok = isinstance(value, (list, tuple)) and len(value) == len(items)
        return ok and all(_is_number(v) for v in value), value
    return True, value


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def describe(tp) -> str:
    """What a value of declared type ``tp`` is, in words: "a positive integer or null"."""
    base, bound, optional = _parts(tp)
    if base in (int, float):
        noun = "integer" if base is int else "number"
        if bound is None:
            text = f"an {noun}" if base is int else f"a {noun}"
        elif bound.low == 0 and bound.strict:
            text = f"a positive {noun}"
        elif bound.low == 1 and base is int:
            text = "a positive integer"
        else:
            text = f"an {noun} {'>' if bound.strict else '>='} {bound.low:g}"
    elif typing.get_origin(base) is tuple:
        text = f"a list of {len(typing.get_args(base))} numbers"
    else:
        text = {bool: "true or false", str: "a string", dict: "a mapping"}.get(base, "a value")
    return f"{text} or null" if optional else text


def _yaml(value) -> str:
    """A default as a recipe would write it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return f"[{', '.join(_yaml(v) for v in value)}]"
    return f"{value:g}" if isinstance(value, float) else str(value)
