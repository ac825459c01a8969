"""An access-log line's shape (docs/operations.md, "Access log"): its fields in the documented key order, as
msgspec encodes them. workers/access_log.py fills and writes the lines."""

from __future__ import annotations

import msgspec

from gateway.routing.evidence import PickerInput, PrefixEvidence


class AccessLine(msgspec.Struct, omit_defaults=True, gc=False):
    """One line, in the documented key order; ``filtered`` (candidates the eligibility filters removed)
    and ``filtered_reasons`` (why: context_window, feature, region) only when there were any."""

    ts: str
    request_id: str | None
    tenant: str | None
    method: str | None
    path: str | None
    status: int
    capability: str | None
    provider: str | None
    stable_id: str | None
    selection_group: int | None
    selection_mode: str | None
    affinity: str | None
    attempts: int
    endpoint: str | None
    overlay_revision: str | None
    bytes_in: int
    bytes_out: int
    tokens_prompt: int | None
    tokens_completion: int | None
    overhead_ms: float | None
    first_byte_ms: float | None
    duration_ms: float | None
    error: str | None
    filtered: int = 0
    filtered_reasons: list[str] | None = None
    # The route evidence of a sampled request (access_log.evidence_sample; gateway/routing/evidence.py).
    site: str | None = None
    admission_state: str | None = None
    candidates: int | None = None
    excluded: dict[str, int] | None = None
    picker_inputs: list[PickerInput] | None = None
    prefix: PrefixEvidence | None = None  # prefix affinity's pick (docs/routing.md, "Prefix affinity")
    trace_id: str | None = None  # a traced request's trace (docs/tracing.md)
    shadow: tuple[str, ...] | None = None  # quota limits in shadow mode that would have refused it
    # An alias or a fallback chain (docs/models.md): the name asked for (when an alias), the model that
    # served (or was tried last), the moves along the chain and why, and chain models skipped.
    requested_model: str | None = None
    served_model: str | None = None
    fallback_hops: int = 0
    fallback_reasons: list[str] | None = None
    fallback_skipped: int = 0
    # Spend (docs/pricing.md): the request's cost in nano-USD at the served model's price, the cached
    # and reasoning parts of its usage, and a budget threshold it crossed; present when known.
    cost_nusd: int | None = None
    tokens_cached: int | None = None
    tokens_reasoning: int | None = None
    spend_alert: str | None = None
    # Who, beyond the tenant, for a request a JWT or a client certificate identified (docs/identity.md): the
    # identity (``jwt:<issuer>``, ``mtls``) and its subject (the key claim, the certificate's value).
    identity: str | None = None
    subject: str | None = None
    # The response cache (docs/cache.md): hit, miss or bypass; what a hit saved (its entry's usage and cost).
    cache: str | None = None
    saved_tokens: int | None = None
    saved_nusd: int | None = None


class TemplateLine(msgspec.Struct, gc=False):
    """A line of the common shape, as `AccessLog._fill` writes it: encoding it gives exactly the bytes of its
    ``AccessLine`` (tests/unit/test_access_log_lines.py holds the two equal). Its own values are fields; the
    values it shares with lines of its kind are runs of raw JSON, made once (``line_runs``): each run is the
    field named after the run's first key, its value the run's text from that key's value on (msgspec writes a
    ``Raw`` as it is). One struct and one C-level encode per line, where a ``%`` template with a dozen
    arguments, each number formatted on its own, cost twice as much. An UNSET field is left out, as the
    line leaves out a field at its default."""

    ts: str
    request_id: str
    tenant: str | None
    method: msgspec.Raw  # method, path
    status: int
    capability: msgspec.Raw  # capability .. affinity
    attempts: int
    endpoint: msgspec.Raw  # endpoint, overlay_revision
    bytes_in: int
    bytes_out: int
    tokens_prompt: int | None
    tokens_completion: int | None
    overhead_ms: float
    first_byte_ms: float
    duration_ms: float
    error: msgspec.Raw  # error, and served_model when the line has it
    cost_nusd: int | msgspec.UnsetType = msgspec.UNSET
    tokens_cached: int | msgspec.UnsetType = msgspec.UNSET
    tokens_reasoning: int | msgspec.UnsetType = msgspec.UNSET
    identity: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    subject: str | msgspec.UnsetType = msgspec.UNSET
    cache: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET  # a miss's or a bypass's (a hit's line has its own)


# The runs of a TemplateLine, by their fields in AccessLine (`line_runs`); a value left out when None.
_RUNS = (("method", "path"), ("capability", "provider", "stable_id", "selection_group", "selection_mode", "affinity"),
         ("endpoint", "overlay_revision"), ("error", "served_model"), ("identity",), ("cache",))
_LEFT_OUT_WHEN_NONE = frozenset(("served_model", "identity", "cache"))


def line_runs(line: AccessLine) -> tuple[msgspec.Raw | msgspec.UnsetType, ...]:
    """The shared runs of ``line`` (a line of the common shape: no rarer field, no savings) for its
    TemplateLine, in its order: each as msgspec encodes those keys, from the first key's value on (UNSET:
    a run whose first value is left out, and then the whole run is)."""
    runs: list[msgspec.Raw | msgspec.UnsetType] = []
    for names in _RUNS:
        pairs = {name: getattr(line, name) for name in names
                 if not (name in _LEFT_OUT_WHEN_NONE and getattr(line, name) is None)}
        if names[0] not in pairs:
            runs.append(msgspec.UNSET)
            continue
        text = msgspec.json.encode(pairs)
        runs.append(msgspec.Raw(text[len(names[0]) + 4:-1]))  # from after '{"<first>":' to before '}'
    return tuple(runs)
