"""The console's security model over a real gateway (docs/console.md#security), without a browser: off
without admin.tokens, the headers on every answer, the session cookie's flags, CSRF and same-origin
refusals, the sign-in brake, no secret or digest in a page, and the providers page's data."""

from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import urlencode

from gateway.identity.auth import hash_api_key
from tests.harness import candidate, envelope, wait_until

OPS, VIEWER = "ops-console-token", "viewer-console-token"
TOKENS = [{"name": "ops", "key": hash_api_key(OPS), "scopes": ["keys:read", "keys:write", "spend:read", "quota:read"]},
          {"name": "viewer", "key": hash_api_key(VIEWER), "scopes": []}]
FORM = {"Content-Type": "application/x-www-form-urlencoded"}


class Answer:
    def __init__(self, response: http.client.HTTPResponse) -> None:
        self.status = response.status
        self.headers = {name.lower(): value for name, value in response.getheaders()}
        self.cookies = [value for name, value in response.getheaders() if name.lower() == "set-cookie"]
        self.body = response.read()

    def json(self) -> Any:
        return json.loads(self.body)


def call(port: int, method: str, path: str, body: bytes | str = b"", headers: dict[str, str] | None = None) -> Answer:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(method, path, body, headers or {})
        return Answer(connection.getresponse())
    finally:
        connection.close()


def sign_in(port: int, token: str = OPS, headers: dict[str, str] | None = None) -> Answer:
    return call(port, "POST", "/console/login", urlencode({"token": token}), {**FORM, **(headers or {})})


class Session:
    """A signed-in console session: its cookie and CSRF token."""

    def __init__(self, port: int, token: str = OPS) -> None:
        self.port = port
        answer = sign_in(port, token)
        assert answer.status == 303, answer.body
        self.cookie = answer.cookies[0].split(";")[0]
        page = self.get("/console").body.decode()
        self.csrf = page.split('name="csrf-token" content="')[1].split('"')[0]

    def get(self, path: str) -> Answer:
        return call(self.port, "GET", path, headers={"Cookie": self.cookie})

    def post(self, path: str, form: dict[str, str] | None = None, csrf: str | None = "session",
             headers: dict[str, str] | None = None) -> Answer:
        fields = dict(form or {})
        if csrf is not None:
            fields["csrf"] = self.csrf if csrf == "session" else csrf
        return call(self.port, "POST", path, urlencode(fields), {**FORM, "Cookie": self.cookie, **(headers or {})})


def console_gateway(gateway_factory, providers, tokens: list[dict[str, Any]] | None = TOKENS, **kwargs: Any):
    names = ("provider-a", "provider-b", "provider-c")
    overlay = envelope([candidate("m", "provider-a", 0), candidate("m", "provider-b", 0),
                        candidate("m", "provider-c", 1)])
    extra = {} if tokens is None else {"admin": {"tokens": tokens}}
    return gateway_factory({name: [providers[name].address] for name in names}, overlay,
                           extra={**extra, **kwargs.pop("extra", {})}, **kwargs)


def test_the_console_is_off_without_admin_tokens(gateway_factory, providers):
    gateway = console_gateway(gateway_factory, providers, tokens=None)
    for method, path in (("GET", "/console"), ("POST", "/console/login"), ("GET", "/console/static/console.js")):
        answer = call(gateway.admin_port, method, path)
        assert answer.status == 404 and answer.json()["error"]["code"] == "console_disabled"
        assert answer.headers["content-type"] == "application/json"
    assert call(gateway.admin_port, "GET", "/admin/endpoints").status == 200  # the admin API as before


def test_every_console_answer_carries_the_security_headers_and_no_cors(gateway_factory, providers):
    gateway = console_gateway(gateway_factory, providers)
    session = Session(gateway.admin_port)
    answers = [call(gateway.admin_port, "GET", "/console"), call(gateway.admin_port, "GET", "/console/static/console.js"),
               sign_in(gateway.admin_port, "wrong"), session.get("/console/providers"), session.get("/console/api/endpoints"),
               call(gateway.admin_port, "OPTIONS", "/console/api/providers",
                    headers={"Origin": "https://elsewhere.example", "Access-Control-Request-Method": "GET"})]
    for answer in answers:
        csp = answer.headers["content-security-policy"]
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp and "default-src 'none'" in csp
        assert answer.headers["x-frame-options"] == "DENY"
        assert answer.headers["x-content-type-options"] == "nosniff"
        assert answer.headers["cache-control"] == "no-store"
        assert not [name for name in answer.headers if name.startswith("access-control-")]
    assert answers[-1].status == 401  # a preflight is not a session: no CORS answer
    page = answers[3].body.decode()
    assert "<script>" not in page and "style=" not in page and " on" + "click=" not in page


def test_the_session_cookie_is_httponly_strict_expiring_and_secure_behind_https(gateway_factory, providers):
    gateway = console_gateway(gateway_factory, providers)
    plain = sign_in(gateway.admin_port)
    assert plain.status == 303 and plain.headers["location"] == "/console"
    flags = [flag.strip() for flag in plain.cookies[0].split(";")]
    assert flags[0].startswith("console_session=") and len(flags[0]) > 40
    assert {"HttpOnly", "SameSite=Strict", "Path=/console", "Max-Age=28800"} <= set(flags)
    assert "Secure" not in flags  # plain HTTP: a Secure cookie would never come back
    proxied = sign_in(gateway.admin_port, headers={"X-Forwarded-Proto": "https"})
    assert "Secure" in [flag.strip() for flag in proxied.cookies[0].split(";")]
    wrong = sign_in(gateway.admin_port, "not-a-token")
    assert wrong.status == 401 and not wrong.cookies and b"invalid admin token" in wrong.body


def test_a_change_needs_the_sessions_csrf_token_and_the_same_origin(gateway_factory, providers):
    gateway = console_gateway(gateway_factory, providers)
    session = Session(gateway.admin_port)
    for answer in (session.post("/console/logout", csrf=None), session.post("/console/logout", csrf="forged"),
                   session.post("/console/logout", headers={"Origin": "https://evil.example"}),
                   Session(gateway.admin_port).post("/console/logout", csrf=session.csrf)):  # another session's
        assert answer.status == 403 and answer.json()["error"]["code"] == "csrf_failed"
    assert session.get("/console/api/providers").status == 200  # none of them signed the session out
    origin = f"http://127.0.0.1:{gateway.admin_port}"
    out = session.post("/console/logout", headers={"Origin": origin})
    assert out.status == 303 and "Max-Age=0" in out.cookies[0]
    assert session.get("/console/api/providers").status == 401
    assert session.get("/console/providers").status == 303  # a page sends the browser to the sign-in form
    cross_site = sign_in(gateway.admin_port, headers={"Origin": "https://evil.example"})
    assert cross_site.status == 403 and not cross_site.cookies  # no login CSRF either


def test_a_flood_of_bad_sign_ins_is_slowed_like_the_admin_apis(gateway_factory, providers):
    gateway = console_gateway(gateway_factory, providers)
    statuses = [sign_in(gateway.admin_port, f"guess-{n}").status for n in range(10)]
    assert statuses == [401] * 10
    slowed = sign_in(gateway.admin_port, OPS)  # even the right token waits out the window
    assert slowed.status == 429 and int(slowed.headers["retry-after"]) > 0 and not slowed.cookies
    api = call(gateway.admin_port, "GET", "/admin/endpoints", headers={"Authorization": f"Bearer {OPS}"})
    assert api.status == 429  # one brake for the console and the admin API


def test_no_token_or_digest_appears_in_any_page(gateway_factory, providers):
    gateway = console_gateway(gateway_factory, providers)
    session = Session(gateway.admin_port)
    secrets = [OPS, VIEWER] + [token["key"] for token in TOKENS] + [token["key"][7:] for token in TOKENS]
    for path in ("/console", "/console/providers", "/console/endpoints", "/console/api/providers",
                 "/console/api/endpoints"):
        body = session.get(path).body.decode()
        assert not [secret for secret in secrets if secret in body], path


def test_the_providers_page_shows_groups_health_and_traffic_share(gateway_factory, providers, mock_provider):
    failing = mock_provider("provider-c")
    check = {"type": "http", "path": "/health", "interval": "200ms", "timeout": "1s", "healthy_threshold": 1,
             "unhealthy_threshold": 1}
    gateway = gateway_factory(
        {"provider-a": [providers["provider-a"].address], "provider-b": [providers["provider-b"].address],
         "provider-c": [failing.address]},
        envelope([candidate("m", "provider-a", 0), candidate("m", "provider-b", 0), candidate("m", "provider-c", 1)]),
        extra={"admin": {"tokens": TOKENS}}, cluster_options={"health_check": check})
    session = Session(gateway.admin_port, VIEWER)  # any token sees the providers

    def providers_by_cluster() -> dict[str, dict[str, Any]]:
        view = session.get("/console/api/providers").json()["view"]
        (capability,) = view["capabilities"]
        return {p["cluster"]: {**p, "group": g["number"], "serving": g["serving"]}
                for g in capability["groups"] for p in g["providers"]}

    shown = wait_until(lambda: (s := providers_by_cluster()) and all(p["health"] == "healthy" for p in s.values()) and s,
                       "three healthy providers")
    assert {name: (p["group"], p["serving"]) for name, p in shown.items()} == {
        "provider-a": (0, True), "provider-b": (0, True), "provider-c": (1, False)}
    for _ in range(20):
        call(gateway.port, "POST", "/v1/chat/completions", json.dumps({"model": "m", "messages": []}),
             {"Content-Type": "application/json"})
    shares = wait_until(lambda: (s := providers_by_cluster()) and s["provider-a"]["share_percent"] and s,
                        "a traffic share")
    assert shares["provider-a"]["share_percent"] == shares["provider-b"]["share_percent"] == 50.0
    call(failing.port, "POST", "/admin/health", json.dumps({"status": 503}), {"Content-Type": "application/json"})
    wait_until(lambda: providers_by_cluster()["provider-c"]["health"] == "unhealthy", "provider-c unhealthy", 5)
    page = session.get("/console/providers").body.decode()
    assert 'data-provider="provider-c"' in page and 'data-health="unhealthy"' in page


def test_a_token_taken_out_of_the_config_ends_its_sessions_at_the_reload(gateway_factory, providers):
    import signal

    gateway = console_gateway(gateway_factory, providers)
    ops, viewer = Session(gateway.admin_port, OPS), Session(gateway.admin_port, VIEWER)
    assert viewer.get("/console/api/providers").status == 200
    gateway.config["admin"]["tokens"] = [TOKENS[0]]  # the viewer's token is withdrawn
    gateway.write_config()
    gateway.signal(signal.SIGHUP)
    wait_until(lambda: viewer.get("/console/api/providers").status == 401, "the viewer's session to end", 10)
    assert ops.get("/console/api/providers").status == 200  # the other token's session goes on
    assert sign_in(gateway.admin_port, VIEWER).status == 401
