"""JWT verification (gateway/identity/jwt_verify.py, jwt_keys.py): every bad token is refused naming the
check that failed and never echoing the token; a good one maps its claims to an identity."""

from __future__ import annotations

import json
import time

import pytest

from gateway.config import ConfigError, parse_config
from gateway.identity import jwt_verify
from gateway.identity.jwt_keys import KeySetError, parse_key_set
from gateway.identity.jwt_verify import JwtRefusal, JwtVerifier, claim_at, looks_like_jwt
from tests.jwt_idp import SigningKey, claims, hmac_with_public_key, jwks, unsigned_token

BASE = 'clusters: [{name: a, endpoints: ["127.0.0.1:9001"]}]\nrouting: {overlay_file: o.json}\n'
ISS = "https://idp.example.com"
RSA = SigningKey("RS256", "r1")
EC = SigningKey("ES256", "e1")


def issuer_config(**overrides: object) -> str:
    entry = {"name": "okta", "issuer": ISS, "audience": ["gridgate"], "jwks_file": "keys.json",
             "algorithms": ["RS256", "ES256", "EdDSA", "PS256"], "tenant_claim": "org", **overrides}
    return BASE + "auth: {jwt: [" + json.dumps(entry) + "]}\n"


def verifier(*keys: SigningKey, **overrides: object) -> JwtVerifier:
    config = parse_config(issuer_config(**overrides))
    found = JwtVerifier(config.auth.jwt)
    found.set_keys("okta", parse_key_set(jwks(*(keys or (RSA, EC)))))
    return found


def refused(check: str, token: str | bytes, v: JwtVerifier | None = None, now: float | None = None) -> JwtRefusal:
    raw = token.encode() if isinstance(token, str) else token
    with pytest.raises(JwtRefusal) as info:
        (v or verifier()).grant(raw, time.time() if now is None else now)
    assert info.value.check == check, info.value.message
    assert raw.decode("latin-1")[:40] not in info.value.message  # the token is never echoed
    return info.value


def test_a_good_token_maps_its_claims_to_an_identity():
    for key in (RSA, EC, SigningKey("EdDSA", "d1"), SigningKey("PS256", "p1")):
        grant = verifier(key).grant(key.sign(claims(ISS)).encode(), time.time())
        assert (grant.identity.tenant, grant.identity.alias, grant.identity.via) == ("acme", "alice", "jwt:okta")
        assert grant.models is None and grant.allows_model("anything")


def test_alg_none_and_hmac_with_the_public_key_are_refused():
    body = claims(ISS)
    refused("alg", unsigned_token({"alg": "none", "typ": "JWT", "kid": "r1"}, body))
    refused("alg", unsigned_token({"alg": "None", "kid": "r1"}, body))
    refusal = refused("alg", hmac_with_public_key(RSA, body))
    assert "HS256" in refusal.message and "accepted" in refusal.message
    # Even an issuer that (wrongly) lists only RS256 never runs HMAC: the key is asymmetric.
    refused("alg", hmac_with_public_key(RSA, body), verifier(RSA, algorithms=["RS256"]))


def test_an_algorithm_that_does_not_fit_the_key_is_refused():
    # An EC-signed token claiming the RSA key's kid, and RS256 against a key that is PS256 only.
    refused("alg", EC.sign(claims(ISS), kid="r1"))
    ps_only = SigningKey("PS256", "p1")
    token = ps_only.sign(claims(ISS))
    refused("signature", token.rsplit(".", 1)[0] + "." + RSA.sign(claims(ISS)).rsplit(".", 1)[1], verifier(ps_only))


def test_unknown_kid_is_refused_and_asks_for_a_refetch():
    asked: list[str] = []
    v = verifier(RSA)
    v.on_unknown_kid = asked.append
    stranger = SigningKey("RS256", "r9")
    assert "r9" in refused("kid", stranger.sign(claims(ISS)), v).message
    assert asked == ["okta"]


def test_a_token_signed_by_another_key_with_a_known_kid_fails_the_signature():
    impostor = SigningKey("RS256", "r1")
    refused("signature", impostor.sign(claims(ISS)))


def test_oversized_malformed_and_wrong_shape_tokens():
    big = RSA.sign(claims(ISS, pad="x" * 9000))
    assert "8192" in refused("size", big).message
    refused("format", b"eyJ.not.base64!")
    refused("format", "eyJ" + "\xff".encode("latin-1").decode("latin-1") + ".a.b")


def test_wrong_issuer_and_audience():
    refused("iss", RSA.sign(claims("https://evil.example.com")))
    refused("aud", RSA.sign(claims(ISS, aud="someone-else")))
    body = claims(ISS)
    del body["aud"]
    refused("aud", RSA.sign(body))


def test_times_outside_the_leeway_are_refused_inside_accepted():
    now = time.time()
    v = verifier()
    refused("exp", RSA.sign(claims(ISS, exp=int(now) - 31)), v, now)
    v.grant(RSA.sign(claims(ISS, exp=int(now) - 29)).encode(), now)  # within the 30 s leeway
    refused("nbf", RSA.sign(claims(ISS, nbf=int(now) + 31)), v, now)
    refused("iat", RSA.sign(claims(ISS, iat=int(now) + 31, nbf=int(now))), v, now)
    body = claims(ISS)
    del body["exp"]
    refused("exp", RSA.sign(body), v, now)
    refused("exp", RSA.sign(claims(ISS, exp="tomorrow")), v, now)


def test_required_claims_and_the_identity_claims():
    v = verifier(required_claims={"scope": ["llm", "admin"], "email_verified": "yes"})
    refused("required_claims", RSA.sign(claims(ISS, scope="other", email_verified="yes")), v)
    refused("required_claims", RSA.sign(claims(ISS, scope="llm")), v)
    v.grant(RSA.sign(claims(ISS, scope=["x", "llm"], email_verified="yes")).encode(), time.time())
    refused("tenant_claim", RSA.sign(claims(ISS, org=None)))
    refused("tenant_claim", RSA.sign(claims(ISS, org=["a"])))
    refused("key_claim", RSA.sign(claims(ISS, sub=None)))


def test_dotted_claims_map_and_models():
    v = verifier(tenant_claim="realm.org", map={"acme-prod": "acme"}, models_claim="llm.models",
                 rule_claim="plan", key_claim="email")
    body = claims(ISS, realm={"org": "acme-prod"}, llm={"models": "gpt-4o* claude-*"}, plan="gold", email="a@x")
    grant = v.grant(RSA.sign(body).encode(), time.time())
    assert (grant.identity.tenant, grant.identity.alias, grant.identity.rule) == ("acme", "a@x", "gold")
    assert grant.allows_model("gpt-4o-mini") and not grant.allows_model("o1")
    refused("tenant_claim", RSA.sign({**body, "realm": {"org": "unmapped"}}), v)
    assert claim_at({"https://x.io/org": "lit", "a": {"b": 1}}, "https://x.io/org") == "lit"
    assert claim_at({"a": {"b": 1}}, "a.b") == 1 and claim_at({"a": 1}, "a.b") is None


def test_the_cache_serves_a_reused_token_until_exp_and_forgets_on_new_keys():
    v = verifier()
    now = time.time()
    token = RSA.sign(claims(ISS, lifetime=60)).encode()
    first = v.grant(token, now)
    assert v.grant(token, now + 1) is first  # cached: the same grant
    refused("exp", token, v, now + 60 + 31)  # past exp + leeway the cache no longer answers
    other = SigningKey("RS256", "r2")
    v.grant(token, now)
    v.set_keys("okta", parse_key_set(jwks(other)))  # r1 left the key set: its tokens stop at once
    refused("kid", token, v, now)


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(jwt_verify, "MAX_CACHED_TOKENS", 3)
    v = verifier()
    now = time.time()
    for index in range(5):
        v.grant(RSA.sign(claims(ISS, sub=f"s{index}")).encode(), now)
    assert len(v._cache) <= 3


def test_one_identity_object_per_subject():
    v = verifier()
    a = v.grant(RSA.sign(claims(ISS, jti="1")).encode(), time.time())
    b = v.grant(RSA.sign(claims(ISS, jti="2")).encode(), time.time())
    assert a is not b and a.identity is b.identity  # the quota's memo sees one key per subject


def test_looks_like_jwt_tells_tokens_from_api_keys():
    assert looks_like_jwt(RSA.sign(claims(ISS)).encode())
    assert not looks_like_jwt(b"sk-live-abc.def") and not looks_like_jwt(b"gg_abcdef")


def test_key_sets_keep_only_asymmetric_signing_keys():
    document = {"keys": [{"kty": "oct", "k": "c2VjcmV0", "kid": "hs"}, {**RSA.jwk(), "use": "enc"}, EC.jwk()]}
    keys = parse_key_set(json.dumps(document).encode())
    assert list(keys.by_kid) == ["e1"]
    for bad in (b"<html>", b"{}", b'{"keys": [{"kty": "oct", "k": "eA"}]}', b"x" * 300_000):
        with pytest.raises(KeySetError):
            parse_key_set(bad)
    unnamed = parse_key_set(json.dumps({"keys": [{k: v for k, v in RSA.jwk(with_alg=False).items() if k != "kid"}]}).encode())
    assert unnamed.candidates(None) and unnamed.candidates(None)[0].algorithms[0] == "RS256"


def config_problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    return info.value.problems


def test_config_names_each_bad_field():
    assert any("auth.jwt[0].algorithms" in p and "HS256" in p for p in config_problems(issuer_config(algorithms=["HS256"])))
    assert any("none" in p for p in config_problems(issuer_config(algorithms=["none"])))
    no_source = config_problems(issuer_config(jwks_file=None))
    assert any("no key source" in p for p in no_source), no_source
    assert any("tenant_claim: required" in p for p in config_problems(issuer_config(tenant_claim=None)))
    assert any("audience" in p for p in config_problems(issuer_config(audience=[])))
    assert any("one key source" in p for p in config_problems(issuer_config(jwks_url="https://x/jwks")))
    two = BASE + "auth: {jwt: [" + ", ".join(json.dumps({"name": "a", "issuer": ISS, "audience": ["g"],
                                                          "jwks_file": "k", "tenant": "t"}) for _ in range(2)) + "]}\n"
    assert any("duplicate name" in p for p in config_problems(two))
    assert any("needs the quota block" in p for p in config_problems(issuer_config(limits={"requests": [{"window": "1m", "count": 5}]})))


def test_gridgate_check_reads_the_key_file(tmp_path):
    from gateway.check import jwt_problems

    config = parse_config(issuer_config(rule_claim="plan"), base_dir=str(tmp_path))
    found = jwt_problems(config)
    assert any(p.startswith("auth.jwt[0].jwks_file: cannot read") for p in found)
    assert any(p.startswith("auth.jwt[0].rule_claim:") for p in found)
    (tmp_path / "keys.json").write_text('{"keys": []}')
    assert any("no usable signing key" in p for p in jwt_problems(config))
    (tmp_path / "keys.json").write_bytes(jwks(RSA))
    assert [p for p in jwt_problems(config) if "jwks_file" in p] == []


def test_a_subject_glob_matches_token_subjects_never_api_key_aliases():
    from gateway.identity.auth import KeyIdentity
    from gateway.quota.rules import QuotaRule, RuleSet

    limits = QuotaRule("svc", (), 0, max_in_flight=1, match_subject="svc-*")
    rules = RuleSet([limits, QuotaRule("all", (), 0, max_in_flight=9)])
    token_identity = KeyIdentity("acme", "svc-42", via="jwt:okta")
    assert rules.match("acme", "m", token_identity).name == "svc"
    assert rules.match("acme", "m", KeyIdentity("acme", "svc-42")).name == "all"  # a YAML key's alias
    assert rules.match("acme", "m", KeyIdentity("acme", "human", via="jwt:okta")).name == "all"
    named = RuleSet([limits, QuotaRule("gold", (), 0, max_in_flight=5, match_tenant="other")])
    assert named.match("acme", "m", KeyIdentity("acme", "x", via="jwt:okta", rule="gold")).name == "gold"
