"""YAML text -> a validated msgspec Struct, with one plain ``field: message`` line per problem.

The one loader behind the gateway config and the control-plane spec. msgspec reports the type
it expected in its own terms (``Expected `int | str`, got `float```, ``Invalid enum value
'two'``). Users wrote YAML, not Python types, so such messages are rebuilt from the schema and
the value they wrote: ``workers: expected an integer or auto, got 'two'``. The schema is walked
along the error's path with :mod:`msgspec.inspect`, so every Struct gets this for free.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as schema
import yaml

T = TypeVar("T")


class ConfigError(Exception):
    """A configuration problem; ``problems`` holds one ``field: message`` line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


class StrictStruct(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The base of every schema read from YAML: an unknown key is an error naming it, values are frozen."""


class Seconds(float):
    """A duration in seconds, written in the file as ``500ms``, ``30s``, ``2m``, ``1h`` or ``1d``."""


MINUTE, HOUR, DAY = 60.0, 3600.0, 86400.0


_DURATION = re.compile(r"^\s*(\d+)\s*(ms|s|m|h|d)\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> Seconds:
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"invalid duration {text!r} (integer with unit ms, s, m, h or d)")
    return Seconds(int(match.group(1)) * _UNIT_SECONDS[match.group(2)])


def format_duration(seconds: float) -> str:
    """A duration as the file writes it: the largest unit that divides it (``100ms``, ``90s``, ``1h``)."""
    millis = round(seconds * 1000)
    if not millis:
        return "0s"
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if millis % size == 0:
            return f"{millis // size}{unit}"
    return f"{millis}ms"


Range = tuple[float, float]


def check_ranges(struct: Any, ranges: Mapping[str, Range]) -> None:
    """Raise ValueError (``name: must be >= 100ms``) for the first field of ``struct`` outside its
    inclusive range; an unset (None) optional field is skipped. For ``__post_init__`` methods: the
    loader turns the message into a line naming the field's whole path."""
    for name, (low, high) in ranges.items():
        value = getattr(struct, name)
        if value is None or low <= value <= high:
            continue
        key = _file_name(type(struct), name)
        show = format_duration if isinstance(value, Seconds) else _number
        raise ValueError(f"{key}: must be >= {show(low)}" if value < low else f"{key}: must be <= {show(high)}")


def _file_name(kind: type, attribute: str) -> str:
    """The key a field has in the file (``scoreBands``) for its attribute name (``score_bands``)."""
    fields: tuple[str, ...] = kind.__struct_fields__  # type: ignore[attr-defined]
    return kind.__struct_encode_fields__[fields.index(attribute)]  # type: ignore[attr-defined]


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def decode_hook(kind: type, value: Any) -> Any:
    if kind is Seconds:
        if isinstance(value, str):
            return parse_duration(value)
        raise ValueError(f"invalid duration {value!r} (integer with unit ms, s, m, h or d)")
    raise NotImplementedError


def read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError as exc:
        raise ConfigError([f"(file): cannot read {path}: {exc.strerror}"]) from None


def convert_yaml(text: str, kind: type[T], extra: dict[str, Any] | None = None, source: str | None = None,
                 prepare: Callable[[dict], None] | None = None) -> T:
    """YAML text -> a validated msgspec Struct of ``kind``; ConfigError naming the field otherwise.

    ``extra`` holds fields the loader sets (never the file); ``source`` (the file name) prefixes
    YAML syntax errors as ``file:line:column``, the form editors jump to. ``prepare`` may adjust the
    loaded mapping first (YAML 1.1 reads a key ``on`` as ``true``: gateway/config/models.py).
    """
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([_yaml_problem(exc, source)]) from None
    if not isinstance(raw, dict):
        raise ConfigError(["(top level): the file must be a mapping"])
    if prepare is not None:
        prepare(raw)
    for key in extra or {}:
        if key in raw:
            raise ConfigError([f"{key}: unknown key"])
    try:
        return msgspec.convert({**raw, **(extra or {})}, kind, dec_hook=decode_hook)
    except msgspec.ValidationError as exc:
        raise ConfigError([validation_problem(exc, kind, raw)]) from None


def _yaml_problem(exc: yaml.YAMLError, source: str | None) -> str:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    detail = f"{problem} ({context})" if context else problem
    if mark is None:
        return f"{source or '(file)'}: invalid YAML: {detail}"
    if source is None:
        return f"(line {mark.line + 1}, column {mark.column + 1}): invalid YAML: {detail}"
    return f"{source}:{mark.line + 1}:{mark.column + 1}: invalid YAML: {detail}"


# --------------------------------------------------------------------------- messages


_AT_PATH = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<field>[^`]+)`")
_MISSING = re.compile(r"Object missing required field `(?P<field>[^`]+)`")
# A __post_init__ check: ``name: ...``, ``list[3]: ...`` or ``mapping["key"].name: ...``.
_NAMED_FIELD = re.compile(r'^([A-Za-z_](?:[\w.]|\[\d+\]|\["(?:[^"\\]|\\.)*"\])*): (.*)$', re.S)
_WRONG_TYPE = re.compile(r"^(Expected `[^`]+`, got `[^`]+`|Invalid enum value .*)$", re.S)
_SEGMENT = re.compile(r"\.(?P<key>[^.\[]+)|\[(?P<index>\d+|\.\.\.)\]")


def validation_problem(error: msgspec.ValidationError, kind: type, raw: Any) -> str:
    """One line for ``error`` raised while converting ``raw`` into ``kind``."""
    match = _AT_PATH.match(str(error))
    assert match is not None
    message, path = match.group("msg"), match.group("path") or ""
    segments = [m.group("key") or m.group("index") for m in _SEGMENT.finditer(path)]
    if "..." in segments:
        path, segments = _name_mapping_keys(schema.type_info(kind), raw, segments)
    target, value = _walk(schema.type_info(kind), raw, segments)
    named = _NAMED_FIELD.match(message)
    if named:
        path, message = _join(path, named.group(1)), named.group(2)
    elif _WRONG_TYPE.match(message) and target is not None:
        message = f"expected {describe(target)}" + ("" if value is _ABSENT else f", got {_show(value)}")
    else:
        unknown, missing = _UNKNOWN.search(message), _MISSING.search(message)
        if unknown:
            path, message = _join(path, unknown.group("field")), "unknown key" + _suggestion(
                target, unknown.group("field")
            )
        elif missing:
            path, message = _join(path, missing.group("field")), "required key is missing"
    return f"{path.lstrip('.') or '(top level)'}: {message}"


def _name_mapping_keys(kind: schema.Type, raw: Any, segments: list[str]) -> tuple[str, list[str]]:
    """msgspec writes a mapping's key as ``[...]`` in its paths; put the key that failed in its place
    (the first whose value alone fails to convert), so ``pricing.overrides[...].input`` becomes
    ``pricing.overrides["gpt-4*"].input``. Returns the path and its segments, the keys filled in."""
    path, named = "", []
    for segment in segments:
        container = _member_for(kind, segment, raw)
        if segment == "..." and isinstance(container, schema.DictType) and isinstance(raw, dict):
            value_kind = container.value_type
            if isinstance(value_kind, schema.StructType):
                failing = (key for key, value in raw.items() if isinstance(key, str) and _fails(value, value_kind.cls))
                segment = next(failing, segment)
        if isinstance(container, schema.DictType):
            path += "[...]" if segment == "..." else f"[{json.dumps(segment)}]"
        elif isinstance(container, schema.ListType) and segment.isdigit():
            path += f"[{segment}]"
        else:
            path += f".{segment}"
        named.append(segment)
        kind, raw = _walk(kind, raw, [segment])
        if kind is None:
            break
    rest = "".join(f"[{step}]" if step.isdigit() else f".{step}" for step in segments[len(named):])
    return path + rest, named


def _fails(value: Any, cls: type) -> bool:
    try:
        msgspec.convert(value, cls, dec_hook=decode_hook)
    except msgspec.ValidationError:
        return True
    return False


def describe(kind: schema.Type) -> str:
    """A schema type in the words of a YAML writer: ``an integer or auto``."""
    if isinstance(kind, schema.UnionType):
        return _alternatives([describe(member) for member in kind.types])
    if isinstance(kind, schema.LiteralType):
        return _alternatives([str(value) for value in kind.values])
    if isinstance(kind, schema.CustomType) and kind.cls is Seconds:
        return "a duration such as 500ms, 30s, 2m, 1h or 1d"
    return _WORDS.get(type(kind), "a value of another type")


_WORDS: dict[type, str] = {
    schema.IntType: "an integer",
    schema.FloatType: "a number",
    schema.StrType: "a string",
    schema.BoolType: "true or false",
    schema.NoneType: "null",
    schema.StructType: "a mapping",
    schema.DictType: "a mapping",
    schema.ListType: "a list",
    schema.AnyType: "any value",
}

_ABSENT = object()


def _walk(kind: schema.Type, raw: Any, segments: list[str]) -> tuple[schema.Type | None, Any]:
    """Follow ``segments`` through the schema and the raw data; (type, value) at the end."""
    for segment in segments:
        kind = _member_for(kind, segment, raw)
        if isinstance(kind, schema.StructType):
            field = next((f for f in kind.fields if f.encode_name == segment), None)
            kind = field.type if field is not None else None
        elif isinstance(kind, schema.DictType):
            kind = kind.value_type
        elif isinstance(kind, schema.ListType):
            kind = kind.item_type
        else:
            return None, _ABSENT
        raw = _child(raw, segment)
    return kind, raw


def _member_for(kind: schema.Type, segment: str, raw: Any) -> schema.Type:
    """The union member the next path segment steps into (a mapping for keys, a list for indexes)."""
    if not isinstance(kind, schema.UnionType):
        return kind
    wanted = (schema.ListType,) if segment.isdigit() else (schema.StructType, schema.DictType)
    if segment == "...":
        wanted = (schema.DictType,)
    members = [m for m in kind.types if isinstance(m, wanted)]
    return members[0] if members else kind


def _child(raw: Any, segment: str) -> Any:
    if isinstance(raw, dict) and segment in raw:
        return raw[segment]
    if isinstance(raw, list) and segment.isdigit() and int(segment) < len(raw):
        return raw[int(segment)]
    return _ABSENT


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value)


def _alternatives(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _suggestion(kind: schema.Type | None, field: str) -> str:
    if isinstance(kind, schema.UnionType):
        kind = next((m for m in kind.types if isinstance(m, schema.StructType)), None)
    if not isinstance(kind, schema.StructType):
        return ""
    close = difflib.get_close_matches(field, [f.encode_name for f in kind.fields], n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _join(path: str, field: str) -> str:
    return f"{path}.{field}" if path else field
