"""The ``models`` block of the gateway configuration: aliases and fallback chains (docs/models.md).

Split from :mod:`gateway.config` (which re-exports it) so each schema module stays small. What can be
judged from the file alone is judged here (an alias of an alias, a chain that names its own model or one
model twice, an unknown reason, ``max_hops`` out of range); what needs the overlay (a chain naming a model
the overlay does not serve, an alias shadowing a served model) is judged by ``gridgate check``
(gateway/check.py, ``model_problems``).
"""

from __future__ import annotations

import json
from typing import ClassVar

import msgspec

from gateway.yaml_config import Range, StrictStruct, check_ranges

# Why a request may move to the next model of its chain (docs/models.md, "Reasons"). The first four
# apply when every provider of the current model failed for them; the last two move at once.
PROVIDER_REASONS = ("rate_limited", "unavailable", "timeout", "first_byte_timeout")
IMMEDIATE_REASONS = ("context_length_exceeded", "content_filter")
FALLBACK_REASONS = PROVIDER_REASONS + IMMEDIATE_REASONS
MAX_CHAIN = 16  # models in one chain
MAX_NAME = 256  # bytes of a model name, as a request may send it (gateway/request/capability.py)


class Alias(StrictStruct):
    """The long form of an alias: its target and whether ``GET /v1/models`` lists it."""

    target: str
    hidden: bool = False


class Fallback(StrictStruct):
    """The chain a request for one model walks when that model cannot serve it."""

    chain: list[str]
    on: list[str] = msgspec.field(default_factory=lambda: list(FALLBACK_REASONS))
    max_hops: int | None = None  # None: the whole chain

    _RANGES: ClassVar[dict[str, Range]] = {"max_hops": (1, MAX_CHAIN)}

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)
        if not self.chain:
            raise ValueError("chain: list at least one model")
        if len(self.chain) > MAX_CHAIN:
            raise ValueError(f"chain: at most {MAX_CHAIN} models")
        for index, model in enumerate(self.chain):
            problem = name_problem(model)
            if problem is not None:
                raise ValueError(f"chain[{index}]: {problem}")
        if not self.on:
            raise ValueError("on: list at least one reason (or remove the chain)")
        for index, reason in enumerate(self.on):
            if reason not in FALLBACK_REASONS:
                raise ValueError(f"on[{index}]: unknown reason {reason!r} (one of {', '.join(FALLBACK_REASONS)})")

    @property
    def hops(self) -> int:
        """The most models after the first a request may move to."""
        return len(self.chain) if self.max_hops is None else min(self.max_hops, len(self.chain))


class Models(StrictStruct):
    """Aliases (stable names an operator repoints) and fallback chains across models."""

    aliases: dict[str, str | Alias] = {}
    fallbacks: dict[str, Fallback] = {}

    def __post_init__(self) -> None:
        for name, alias in self.aliases.items():
            target = alias if isinstance(alias, str) else alias.target
            field = f"aliases[{json.dumps(name)}]"
            problem = name_problem(name)
            if problem is not None:
                raise ValueError(f"{field}: {problem}")
            problem = name_problem(target)
            if problem is not None:
                raise ValueError(f"{field}: target {problem}")
            if target == name:
                raise ValueError(f"{field}: an alias cannot name itself")
            if target in self.aliases:
                raise ValueError(f"{field}: {target!r} is an alias too; point {name!r} at a model (an alias of "
                                 "an alias is not resolved)")
        for model, fallback in self.fallbacks.items():
            field = f"fallbacks[{json.dumps(model)}].chain"
            problem = name_problem(model)
            if problem is not None:
                raise ValueError(f"fallbacks[{json.dumps(model)}]: {problem}")
            resolved_model = self.target(model)
            seen = {resolved_model}
            for index, entry in enumerate(fallback.chain):
                resolved = self.target(entry)
                if resolved in seen:
                    what = "its own model" if resolved == resolved_model else "a model twice"
                    raise ValueError(f"{field}[{index}]: {entry!r} makes a cycle: the chain names {what}")
                seen.add(resolved)

    def target(self, name: str) -> str:
        """The model ``name`` resolves to (itself when it is no alias)."""
        alias = self.aliases.get(name)
        if alias is None:
            return name
        return alias if isinstance(alias, str) else alias.target

    def hidden(self, name: str) -> bool:
        alias = self.aliases.get(name)
        return isinstance(alias, Alias) and alias.hidden


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a model a request names (None: it can)."""
    if not name.strip():
        return "a model name must not be blank"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME:
        return f"a model name must be at most {MAX_NAME} bytes"
    return None


def restore_on_keys(raw: dict) -> None:
    """YAML 1.1 (PyYAML) reads the key ``on`` as the boolean ``true``: give each fallback its ``on`` back
    before the schema sees the mapping (``convert_yaml``'s ``prepare``)."""
    models = raw.get("models")
    fallbacks = models.get("fallbacks") if isinstance(models, dict) else None
    if not isinstance(fallbacks, dict):
        return
    for entry in fallbacks.values():
        if isinstance(entry, dict) and True in entry and "on" not in entry:
            entry["on"] = entry.pop(True)
