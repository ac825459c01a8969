"""docs/configuration.md cannot drift from the schema (gateway.config.Config).

Key paths are written as in the doc: ``routing.retry.attempts``; ``[]`` steps into every item of a
list (``clusters[].name``), ``*`` into any key of a mapping
(``clusters[].load_balancer_strategy.*.header``).

- every key the schema accepts is documented (a new key without docs fails here);
- every key documented in a table exists (a renamed or removed key fails here);
- each table row's default is the schema's default;
- the complete example in the doc parses with the real loader.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as schema
import pytest

from gateway.config import Config, parse_config
from gateway.yaml_config import Seconds, parse_duration

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
LOADER_FIELDS = {"base_dir"}  # set by the loader, never written in a file
_ROW = re.compile(r"^\|\s*`(?P<path>[^`]+)`\s*\|(?P<default>[^|]*)\|")


def schema_keys() -> dict[str, schema.Field]:
    keys: dict[str, schema.Field] = {}
    for path, field in _walk(schema.type_info(Config), ""):
        keys.setdefault(path, field)
    return keys


def _walk(kind: schema.Type, prefix: str) -> Iterator[tuple[str, schema.Field]]:
    """(path, field) for every field of every Struct reachable from ``kind``."""
    if isinstance(kind, schema.StructType):
        for field in kind.fields:
            if not prefix and field.name in LOADER_FIELDS:
                continue
            path = f"{prefix}.{field.encode_name}" if prefix else field.encode_name
            yield path, field
            yield from _walk(field.type, path)
    elif isinstance(kind, schema.UnionType):
        for member in kind.types:
            yield from _walk(member, prefix)
    elif isinstance(kind, schema.ListType):
        yield from _walk(kind.item_type, prefix + "[]")
    elif isinstance(kind, schema.DictType):
        yield from _walk(kind.value_type, prefix + ".*")


def render_default(field: schema.Field) -> str | None:
    """The default as the doc writes it (inside backticks); None when a table need not show one."""
    if field.required:
        return "required"
    value: Any = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
    if isinstance(value, msgspec.Struct):
        return None  # a block: its keys carry the defaults
    return _yaml(value)


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Seconds):
        return _duration(value)
    if isinstance(value, list):
        return "[" + ", ".join(_yaml(item) for item in value) + "]"
    return str(value)


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{round(seconds * 1000)}ms"


def doc_rows() -> dict[str, str]:
    rows: dict[str, str] = {}
    for line in DOC.read_text().splitlines():
        match = _ROW.match(line)
        if match:
            assert match.group("path") not in rows, f"{match.group('path')} has two rows"
            rows[match.group("path")] = match.group("default").strip()
    return rows


def test_the_walk_sees_nested_keys():
    keys = schema_keys()
    for path in ("listen", "routing.retry.backoff.base", "clusters[].endpoints[].weight",
                 "clusters[].load_balancer_strategy.*.header", "tenants[].allowed_regions", "quota.rules[].budgets[].window"):
        assert path in keys
    assert "base_dir" not in keys


def test_every_schema_key_is_documented():
    text = DOC.read_text()
    missing = [path for path in schema_keys() if f"`{path}`" not in text]
    assert not missing, f"add these keys to {DOC.name}: {missing}"


def test_every_documented_key_exists():
    keys = schema_keys()
    stale = [path for path in doc_rows() if path not in keys]
    assert not stale, f"{DOC.name} documents keys the schema does not have: {stale}"


def _shows(cell: str, field: schema.Field, expected: str) -> bool:
    if f"`{expected}`" in cell:
        return True
    if isinstance(field.default, Seconds):  # 300s and 5m are the same default
        return any(_seconds(token) == field.default for token in re.findall(r"`([^`]+)`", cell))
    return False


def _seconds(text: str) -> float | None:
    try:
        return parse_duration(text)
    except ValueError:
        return None


def test_documented_defaults_are_the_schema_defaults():
    keys, wrong = schema_keys(), []
    for path, cell in doc_rows().items():
        expected = render_default(keys[path]) if path in keys else None
        if expected == "required" and "required" not in cell:
            wrong.append(f"{path}: say 'required', not {cell!r}")
        elif expected not in (None, "required") and not _shows(cell, keys[path], expected):
            wrong.append(f"{path}: default is `{expected}`, the doc says {cell!r}")
    assert not wrong, "\n".join(wrong)


def test_the_complete_example_parses():
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    complete = [block for block in blocks if block.startswith("# complete example")]
    assert len(complete) == 1
    config = parse_config(complete[0])
    assert config.routing.overlay_file is not None


@pytest.mark.parametrize(("seconds", "text"), [(0.01, "10ms"), (0.5, "500ms"), (30, "30s"), (300, "5m"),
                                               (3600, "1h"), (86400, "1d"), (75, "75s")])
def test_durations_render_as_written(seconds, text):
    assert _duration(Seconds(seconds)) == text
