"""The cost of a served request, on its record: a stand-in until the ledger's settlement prices it.

``price_record`` fills ``RequestRecord.cost_nusd``, ``tokens_cached`` and ``tokens_reasoning`` from
the usage of the attempt that served, priced as the model that served (``record.served``) by the
worker's ``PriceBook`` (docs/pricing.md). ``Outcomes.close`` calls it before the access line and the
spend counters read those fields. Kept apart so that it can be replaced by the settlement's own
computation (the quota ledger charges the same cost) without touching what reads the fields.
"""

from __future__ import annotations

from gateway.pricing.book import PriceBook
from gateway.request.attempts import AttemptResult
from workers.request_record import RequestRecord


def price_record(record: RequestRecord, result: AttemptResult | None, book: PriceBook) -> None:
    """Price the usage that served ``record`` (nothing when no usage was read: not metered, or none came)."""
    if record.cost_nusd is not None:  # already priced (by the settlement)
        return
    usage = None if result is None else result.usage
    model = record.served
    if usage is None or model is None:
        return
    if usage.prompt_tokens is None and usage.completion_tokens is None and usage.total_tokens is None:
        return  # the provider reported no usage
    record.tokens_cached = usage.cached_tokens
    record.tokens_reasoning = usage.reasoning_tokens
    record.cost_nusd = book.cost(model, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens,
                                 usage.cache_write_tokens, usage.reasoning_tokens, usage.total_tokens)
