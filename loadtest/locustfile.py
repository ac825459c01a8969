"""Locust users for `make bench` (loadtest/bench.py picks the classes and counts per scenario).

By hand:
    .venv/bin/locust -f loadtest/locustfile.py --headless -u 50 -r 25 -t 30s --host http://127.0.0.1:18080 ChatUser

User classes (each request is named after its class, so the report can tell them apart):
  ChatUser          uniform chat completions, a share of them streamed            ("chat", "chat stream")
  InteractiveUser   short chat completions with think time, tenant `steady`       ("interactive")
  BurstUser         tenant `noisy`: back-to-back requests inside the window, idle outside ("burst")
  LongStreamUser    long, slow streams, started inside the window                  ("long stream")

Environment knobs:
  GRIDGATE_MODEL              capability to ask for                                   (demo-model)
  GRIDGATE_STREAM_SHARE       ChatUser: share of requests with "stream": true         (0.25)
  GRIDGATE_MAX_TOKENS         max_tokens of each short request                        (32)
  GRIDGATE_WAIT_S             ChatUser think time between requests, seconds          (0)
  GRIDGATE_INTERACTIVE_WAIT_S InteractiveUser think time                             (0.5)
  GRIDGATE_LONG_TOKENS / GRIDGATE_LONG_TOKENS_PER_S  LongStreamUser stream length and pace (200 / 20)
  GRIDGATE_RUN_START          epoch seconds the run started (the window's clock)      (import time)
  GRIDGATE_WINDOW             "START,END" seconds after the run start                 (20,40)
  GRIDGATE_<CLASS>_USERS      fixed user count of a class (CHAT, INTERACTIVE, BURST, LONG_STREAM)
  GRIDGATE_TENANT_KEYS        "tenant=key,...": the API key each tenant's users send (none if unset)
  GRIDGATE_SAMPLES_DIR        where each locust process writes samples-<pid>.json: one row per request
                              [epoch s, name, ms, ok, first-token ms or -1, x-gridgate-overhead-ms or -1],
                              and failures by error
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from typing import Any

from locust import FastHttpUser, constant, events, task

MODEL = os.environ.get("GRIDGATE_MODEL", "demo-model")
STREAM_SHARE = float(os.environ.get("GRIDGATE_STREAM_SHARE", "0.25"))
MAX_TOKENS = int(os.environ.get("GRIDGATE_MAX_TOKENS", "32"))
WAIT_S = float(os.environ.get("GRIDGATE_WAIT_S", "0"))
INTERACTIVE_WAIT_S = float(os.environ.get("GRIDGATE_INTERACTIVE_WAIT_S", "0.5"))
LONG_TOKENS = int(os.environ.get("GRIDGATE_LONG_TOKENS", "200"))
LONG_TOKENS_PER_S = float(os.environ.get("GRIDGATE_LONG_TOKENS_PER_S", "20"))
RUN_START = float(os.environ.get("GRIDGATE_RUN_START", time.time()))
WINDOW_START, WINDOW_END = (float(v) for v in os.environ.get("GRIDGATE_WINDOW", "20,40").split(","))
SAMPLES_DIR = os.environ.get("GRIDGATE_SAMPLES_DIR")
CHAT = "/v1/chat/completions"
FIRST_CONTENT = re.compile(rb'"content":"[^"]')  # a non-empty content delta: the first token
PROMPTS = ("Say hello.", "Summarise the plot of Hamlet in one line.", "What is 17 * 23?",
           "Write a haiku about load balancers.")
# tenant -> API key, "steady=sk-1,noisy=sk-2" (bench.py configures the gateway with the same keys)
KEYS = dict(pair.split("=", 1) for pair in os.environ.get("GRIDGATE_TENANT_KEYS", "").split(",") if "=" in pair)

samples: list[tuple[float, str, float, bool, float, float]] = []
failure_counts: dict[str, int] = {}  # "<request name>: <error>" -> count


def fixed_users(name: str) -> int:
    return int(os.environ.get(f"GRIDGATE_{name}_USERS", "0"))


@events.request.add_listener
def record(name: str, response_time: float, exception: BaseException | None, response: Any = None,
           context: dict[str, Any] | None = None, **_kwargs: Any) -> None:
    """One row per request, on locust's own clock and outcome (catch_response failures included)."""
    if exception is not None:
        key = f"{name}: {exception}"
        failure_counts[key] = failure_counts.get(key, 0) + 1
    extra = context or {}
    samples.append((round(time.time(), 4), name, round(response_time, 3), exception is None,
                    extra.get("first_token_ms", -1.0), extra.get("overhead_ms", -1.0)))


def overhead_of(headers: Any) -> float:
    value = headers.get("x-gridgate-overhead-ms") if headers else None
    try:
        return float(value) if value is not None else -1.0
    except ValueError:
        return -1.0


def chat_body(stream: bool, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens,
                            "messages": [{"role": "user", "content": random.choice(PROMPTS)}]}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


class GatewayUser(FastHttpUser):
    """Plain and streamed chat completions, checked for what a client needs (usage, [DONE])."""

    abstract = True
    tenant: str | None = None

    def headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        key = KEYS.get(self.tenant or "")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return {**headers, **(extra or {})}

    def chat_plain(self, name: str) -> None:
        with self.client.post(CHAT, json=chat_body(False), name=name, headers=self.headers(),
                              catch_response=True) as response:
            response.request_meta["context"] = {"overhead_ms": overhead_of(response.headers)}
            if response.status_code != 200:
                response.failure(f"status {response.status_code}")
                return
            try:
                usage = json.loads(response.content)["usage"]
            except (ValueError, KeyError, TypeError):
                response.failure("no usage in the body")
                return
            if usage.get("completion_tokens", 0) < 1:
                response.failure("empty completion")

    def chat_stream(self, name: str, max_tokens: int = MAX_TOKENS, mock_headers: dict[str, str] | None = None) -> None:
        """Time the whole stream as the request (not just its headers); note the time to first token."""
        started = time.perf_counter()
        first_token_ms = -1.0
        with self.client.post(CHAT, json=chat_body(True, max_tokens), name=name, stream=True,
                              headers=self.headers(mock_headers), catch_response=True) as response:
            context = {"overhead_ms": overhead_of(response.headers), "first_token_ms": -1.0}
            response.request_meta["context"] = context
            if response.status_code != 200:
                response.failure(f"status {response.status_code}")
                return
            # read(n) blocks until n bytes arrived: small reads until the first token, then big ones.
            received = b""
            for chunk in response.iter_content(chunk_size=64, decode_content=False):
                received += chunk
                if FIRST_CONTENT.search(received, max(0, len(received) - len(chunk) - 16)):
                    first_token_ms = (time.perf_counter() - started) * 1000
                    break
            for chunk in response.iter_content(chunk_size=16384, decode_content=False):
                received += chunk
            context["first_token_ms"] = round(first_token_ms, 3)
            response.request_meta["response_time"] = (time.perf_counter() - started) * 1000
            response.request_meta["response_length"] = len(received)
            if not received.rstrip().endswith(b"data: [DONE]"):
                response.failure("stream ended without [DONE]")
            elif b'"usage":{' not in received:
                response.failure("stream without a usage chunk")


class ChatUser(GatewayUser):
    """The uniform load: every user alike, a share of requests streamed."""

    fixed_count = fixed_users("CHAT")
    wait_time = constant(WAIT_S)

    @task
    def chat(self) -> None:
        if random.random() < STREAM_SHARE:
            self.chat_stream("chat stream")
        else:
            self.chat_plain("chat")


class InteractiveUser(GatewayUser):
    """A person at a chat window: short requests, a pause between them."""

    tenant = "steady"
    fixed_count = fixed_users("INTERACTIVE")
    wait_time = constant(INTERACTIVE_WAIT_S)

    @task
    def chat(self) -> None:
        self.chat_plain("interactive")


class WindowedUser(GatewayUser):
    """Sends back to back inside the window (GRIDGATE_WINDOW), nothing outside it."""

    abstract = True

    @staticmethod
    def in_window() -> bool:
        return WINDOW_START <= time.time() - RUN_START < WINDOW_END

    def wait_time(self) -> float:
        elapsed = time.time() - RUN_START
        if elapsed < WINDOW_START:
            return min(1.0, WINDOW_START - elapsed)
        return 0.0 if elapsed < WINDOW_END else 1.0


class BurstUser(WindowedUser):
    """A batch job of another tenant bursting."""

    tenant = "noisy"
    fixed_count = fixed_users("BURST")

    @task
    def chat(self) -> None:
        if self.in_window():
            self.chat_plain("burst")


class LongStreamUser(WindowedUser):
    """Long generations streaming beside the short requests."""

    fixed_count = fixed_users("LONG_STREAM")

    @task
    def stream(self) -> None:
        if self.in_window():
                self.chat_stream("long stream", LONG_TOKENS, {"X-Mock-Tokens": str(LONG_TOKENS),
                                                          "X-Mock-Tokens-Per-S": str(LONG_TOKENS_PER_S)})


@events.quitting.add_listener
def write_samples(environment: Any, **_kwargs: Any) -> None:
    """Each locust process writes what it saw; bench.py merges the files."""
    if not SAMPLES_DIR:
        return
    os.makedirs(SAMPLES_DIR, exist_ok=True)
    with open(os.path.join(SAMPLES_DIR, f"samples-{os.getpid()}.json"), "w") as out:
        json.dump({"samples": samples, "failures": failure_counts}, out)
