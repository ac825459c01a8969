"""Managed-key records (gateway.keys): the key format, body checks naming the field, the request path's
answers (401 codes, the key report; the model globs: test_model_access.py)."""

from __future__ import annotations

import json
import re

import msgspec
import pytest

from gateway.identity.key_limits import KeyLimits, RequestRate, TokenBudget
from gateway.identity.keyformat import is_kid, key_digest, new_key, new_kid
from gateway.keys.answers import key_report, refusal
from gateway.keys.record import BodyProblem, CreateKey, PatchKey, Rotate, decode_body
from gateway.keys.view import KeyEntry, KeyView, decode_entry

# The documented key format (docs/keys.md): gg-<12 base62 kid>-<43 base62 secret>.
KEY_PATTERN = re.compile(r"gg-([0-9A-Za-z]{12})-([0-9A-Za-z]{43})")


def test_keys_have_the_documented_format_and_only_their_digest_is_kept():
    kid = new_kid()
    key = new_key(kid)
    assert is_kid(kid) and KEY_PATTERN.fullmatch(key)
    assert key.startswith(f"gg-{kid}-") and len(key) == 3 + 12 + 1 + 43
    assert len({new_key(kid) for _ in range(50)}) == 50
    assert len(key_digest(key)) == 32 and key_digest(key) == key_digest(key.encode())


@pytest.mark.parametrize(("body", "problem"), [
    (b"{not json", "body: malformed JSON"),
    (b"[1]", "body: must be a JSON object"),
    (b"{}", "tenant: required key is missing"),
    (b'{"tenant": "team a"}', "tenant: must be 1..64 characters"),
    (b'{"tenant": "' + b"t" * 65 + b'"}', "tenant: must be 1..64 characters"),
    (b'{"tenant": 7}', "tenant: expected a string, got 7"),
    (b'{"tenant": "t", "alias": "a/b"}', "alias: must be 1..64 characters"),
    (b'{"tenant": "t", "models": "gpt-*"}', "models: expected a list or null"),
    (b'{"tenant": "t", "limits": {"requests": [{"window": "1m", "count": "lots"}]}}',
     "limits.requests[0].count: expected an integer, got 'lots'"),
    (b'{"tenant": "t", "limits": {"requests": [{"window": "2d", "count": 1}]}}', "limits.requests[0].window: must be <= 1d"),
    (b'{"tenant": "t", "limits": {"budgets": [{"window": "1h", "tokens": 0}]}}', "limits.budgets[0].tokens: must be"),
    (b'{"tenant": "t", "limits": {"max_in_flight": 0}}', "limits.max_in_flight: must be >= 1"),
    (b'{"tenant": "t", "limits": {"requests": [{"window": "1m", "count": 5}, {"window": "60s", "count": 9}]}}',
     "limits.requests: two request limits with the same window"),
    (b'{"tenant": "t", "limits": {"spend": [{"usd": 5, "period": "1y"}]}}', "limits.spend[0].period"),
    (b'{"tenant": "t", "expires_at": "next week"}', "expires_at: must be an RFC 3339 time"),
    (b'{"tenant": "t", "expires_at": "2030-01-01T00:00:00"}', "expires_at: needs a time zone"),
    (b'{"tenant": "t", "allowed_origins": ["app.example.com"]}', "allowed_origins[0]: 'app.example.com' is not an origin"),
    (b'{"tenant": "t", "allowed_origins": ["regex:("]}', "allowed_origins[0]: 'regex:(': bad regular expression"),
    (b'{"tenant": "t", "key": "gg-whatever"}', "key: unknown key"),
])
def test_a_bad_create_body_is_refused_naming_the_field(body, problem):
    with pytest.raises(BodyProblem) as caught:
        decode_body(body, CreateKey)
    assert str(caught.value).startswith(problem)


def test_more_than_sixteen_metadata_pairs_are_refused():
    sixteen = {f"k{i}": "v" for i in range(16)}
    assert decode_body(json.dumps({"tenant": "t", "metadata": sixteen}).encode(), CreateKey).metadata == sixteen
    with pytest.raises(BodyProblem, match=r"^metadata: at most 16 pairs, got 17"):
        decode_body(json.dumps({"tenant": "t", "metadata": {**sixteen, "k16": "v"}}).encode(), CreateKey)


def test_durations_are_kept_in_their_normal_form():
    body = decode_body(b'{"tenant": "t", "limits": {"requests": [{"window": "60s", "count": 5}]}}', CreateKey)
    assert body.limits.requests[0].window == "1m"


def test_a_patch_names_only_what_it_changes_and_null_clears():
    patch = decode_body(b'{"alias": null, "expires_at": "2030-01-01T00:00:00Z"}', PatchKey)
    assert patch.changes() == {"alias": None, "expires_at": 1893456000}
    with pytest.raises(BodyProblem, match="^status: unknown key"):
        decode_body(b'{"status": "active"}', PatchKey)  # status changes only through block/unblock/revoke


def test_rotation_grace_is_a_bounded_duration():
    assert decode_body(b'{"grace": "24h"}', Rotate).seconds() == 86400
    assert decode_body(b"", Rotate).seconds() == 0
    with pytest.raises(BodyProblem, match="^grace: must be <= 30d"):
        decode_body(b'{"grace": "31d"}', Rotate)
    with pytest.raises(BodyProblem, match="^grace: invalid duration"):
        decode_body(b'{"grace": "soon"}', Rotate)


def entry(**fields):
    view = {"kid": "AbCdEfGhIjKl", "tenant": "team-a", "alias": "ci", "status": "active", "models": None,
            "limits": {}, "expires_at": None, "allowed_origins": None, **fields}
    view["limits"] = msgspec.convert(view["limits"], KeyLimits)
    blob = msgspec.msgpack.encode(KeyView(**view))
    return decode_entry(blob, slot=0)


def test_refusals_name_why_a_known_key_may_not_be_used():
    assert refusal(entry(), now=100) is None
    assert refusal(entry(status="blocked"), now=100)[0] == "key_blocked"
    assert refusal(entry(status="revoked", expires_at=50), now=100)[0] == "key_revoked"
    assert refusal(entry(expires_at=100), now=99) is None
    code, message = refusal(entry(expires_at=100), now=100)
    assert code == "key_expired" and "1970-01-01T00:01:40Z" in message


def test_the_key_report_holds_the_record_and_the_quota_parts_never_a_secret():
    report = key_report(entry(expires_at=1893456000, limits={"requests": [{"window": "1m", "count": 5}]}),
                        remaining={"requests": 4}, spend=None)
    assert report["kid"] == "AbCdEfGhIjKl" and report["expires_at"] == "2030-01-01T00:00:00Z"
    assert report["limits"]["requests"][0]["count"] == 5 and report["remaining"] == {"requests": 4}
    assert not {"key", "digest"} & set(report)


def test_a_keys_limits_reach_the_quota_as_its_identity_counts_them():
    limits = KeyLimits(requests=[RequestRate(window="1m", count=60)], budgets=[TokenBudget(window="1h", tokens=900,
                       shadow=True)], max_in_flight=3)
    converted = limits.counted()
    assert converted.max_in_flight == 3
    assert [(r.window_s, r.count, r.burst) for r in converted.requests] == [(60, 60, 60)]
    assert [(b.window_s, b.tokens, b.shadow) for b in converted.budgets] == [(3600, 900, True)]
    entry = KeyEntry(KeyView("AAAAAAAAAAAA", "team-a", "ci", "active", None, limits, None, None), 0)
    identity = entry.identity
    assert (identity.tenant, identity.kid, identity.alias, identity.name) == ("team-a", "AAAAAAAAAAAA", "ci", "AAAAAAAAAAAA")
    assert identity.limits == converted
    # nothing to count: the key's rule alone meters it
    assert KeyEntry(KeyView("AAAAAAAAAAAA", "team-a", "ci", "active", None, KeyLimits(), None, None), 0).identity.limits is None


# A record as the key store has kept it in Valkey, and one of its host-table entries (msgpack), byte for
# byte: a key's limits are one type now (gateway/identity/key_limits.py), stored exactly as before.
STORED_RECORD = (
    b'{"kid":"AAAAAAAAAAAA","tenant":"t","status":"active","digest":"' + b"ab" * 32 + b'","created_at":1,'
    b'"created_by":"ops","updated_at":2,"version":3,"alias":"ci","models":null,"limits":{"requests":['
    b'{"window":"1m","count":60,"burst":null,"shadow":false},{"window":"1d","count":5000,"burst":10,"shadow":true}],'
    b'"budgets":[{"window":"1h","tokens":900,"shadow":true}],"max_in_flight":3,"spend":['
    b'{"usd":5.1,"period":"1d","tz":null,"enforce":"hard","alert_at":[0.5,0.8,1.0]},'
    b'{"usd":20.0,"period":"1mo","tz":"Europe/Paris","enforce":"soft","alert_at":[0.9]}]},'
    b'"expires_at":null,"allowed_origins":null,"metadata":{},"previous":[]}')
TABLE_ENTRY = bytes.fromhex(
    "99ac414141414141414141414141a174a26369a6616374697665c084a872657175657374739284a677696e646f77a2316da5636f756e"
    "743ca56275727374c0a6736861646f77c284a677696e646f77a23164a5636f756e74cd1388a562757273740aa6736861646f77c3a762"
    "7564676574739183a677696e646f77a23168a6746f6b656e73cd0384a6736861646f77c3ad6d61785f696e5f666c6967687403a57370"
    "656e649285a3757364cb4014666666666666a6706572696f64a23164a2747ac0a7656e666f726365a468617264a8616c6572745f6174"
    "93cb3fe0000000000000cb3fe999999999999acb3ff000000000000085a3757364cb4034000000000000a6706572696f64a3316d6fa2"
    "747aac4575726f70652f5061726973a7656e666f726365a4736f6674a8616c6572745f617491cb3feccccccccccccdc0c004")
# Since the previous-secret mark: one more element (false for the current secret); the older blob decodes.
TABLE_ENTRY_BEFORE, TABLE_ENTRY = TABLE_ENTRY, b"\x9a" + TABLE_ENTRY[1:] + b"\xc2"


def test_a_stored_record_and_its_table_entry_keep_their_bytes():
    from gateway.keys.record import decode_record, encode_record
    from gateway.keys.view import views_of

    record = decode_record(STORED_RECORD)
    assert encode_record(record) == STORED_RECORD
    assert views_of(record, now=10, tenant_index=4) == {b"\xab" * 32: TABLE_ENTRY}
    assert decode_entry(TABLE_ENTRY_BEFORE, slot=0).identity.via is None  # a blob written before the mark
    limits = decode_entry(TABLE_ENTRY, slot=0).identity.limits
    assert [(r.window_s, r.count, r.burst, r.shadow) for r in limits.requests] == [(60, 60, 60, False),
                                                                                   (86400, 5000, 10, True)]
    assert [(b.window_s, b.tokens, b.shadow) for b in limits.budgets] == [(3600, 900, True)]
    assert [(s.nusd, s.tz, s.hard, s.alert_at) for s in limits.spend] == [(5_100_000_000, "UTC", True, (500, 800, 1000)),
                                                                          (20_000_000_000, "Europe/Paris", False, (900,))]
    assert limits.max_in_flight == 3


@pytest.mark.parametrize(("limits", "problem"), [
    ({"requests": [{"window": "1500ms", "count": 5}]}, "requests[0].window: must be whole seconds (1s..1d)"),
    ({"requests": [{"window": "1s", "count": 2000000}]},
     "requests[0].count: more than 1000000 requests per second cannot be metered"),
    ({"requests": [{"window": "1m", "count": 0}]}, "requests[0].count: must be >= 1"),
    ({"budgets": [{"window": "367d", "tokens": 5}]}, "budgets[0].window: must be <= 366d"),
    ({"max_in_flight": 0}, "max_in_flight: must be >= 1"),
    ({"budgets": [{"window": "1m", "tokens": 5}, {"window": "60s", "tokens": 9}]},
     "budgets: two budgets with the same window"),
    ({"spend": [{"usd": 1, "period": "1d"}, {"usd": 2, "period": "1d"}]},
     "spend: two spend limits with the same period (one budget per period)"),
])
def test_a_yaml_key_and_a_managed_key_refuse_the_same_limits_in_the_same_words(limits, problem):
    from gateway.config import ConfigError, parse_config

    with pytest.raises(BodyProblem) as managed:
        decode_body(json.dumps({"tenant": "t", "limits": limits}).encode(), CreateKey)
    assert str(managed.value) == f"limits.{problem}"
    with pytest.raises(ConfigError) as yaml_key:
        parse_config(json.dumps({
            "clusters": [{"name": "a", "endpoints": ["127.0.0.1:9001"]}], "routing": {"overlay_file": "o.json"},
            "auth": {"keys": [{"tenant": "t", "key": "sha256:" + "a" * 64, "alias": "ci", "limits": limits}]},
            "quota": {"rules": []}}))
    assert yaml_key.value.problems == [f"auth.keys[0].limits.{problem}"]
