"""Whether a request's identity may use a model: the one place the request path, the fallback chain and
the model list ask.

Two rules apply, both must allow: the tenant's ``allowed_capabilities`` (``gateway.routing.tenants.Policy``,
globs memoised per tenant) and, for a managed key, the key's own ``models`` globs
(``gateway.keys.view.KeyEntry``; a YAML key has none). A refusal is 403 ``model_not_allowed`` naming the
rule that refused: the tenant's, or the key's by its kid (docs/keys.md, docs/routing.md).
"""

from __future__ import annotations

from gateway.http.errors import ErrorReply
from gateway.identity.key_status import MODEL_NOT_ALLOWED
from gateway.keys.view import KeyEntry
from gateway.routing.tenants import Policy

_SHOWN_CHARS = 200  # of a client-chosen model name in a message


def may_use(policy: Policy, managed: KeyEntry | None, model: str) -> bool:
    """True when both the tenant's policy and the key (if it is a managed key) allow ``model``."""
    return policy.allows(model) and (managed is None or managed.allows_model(model))


def model_refusal(tenant: str, policy: Policy, managed: KeyEntry | None, model: str) -> ErrorReply | None:
    """The 403 for a model the tenant or the key may not use, or None."""
    if not policy.allows(model):
        return ErrorReply(403, MODEL_NOT_ALLOWED, f"The API key of tenant {tenant!r} may not use {model!r}.")
    if managed is not None and not managed.allows_model(model):
        shown = model if len(model) <= _SHOWN_CHARS else model[:_SHOWN_CHARS] + "..."
        who = f"API key {managed.kid}" if managed.kid is not None else managed.who  # else a JWT's grant
        return ErrorReply(403, MODEL_NOT_ALLOWED, f"{who} may not use model {shown!r}")
    return None
