"""Locust users posting chat completions through the gateway, a share of them streaming.

Run by loadtest/bench.py (`make bench`); by hand:
    .venv/bin/locust -f loadtest/locustfile.py --headless -u 50 -r 25 -t 30s --host http://127.0.0.1:18080

Environment knobs:
  GRIDGATE_MODEL          capability to ask for                         (demo-model)
  GRIDGATE_STREAM_SHARE   share of requests with "stream": true          (0.25)
  GRIDGATE_MAX_TOKENS     max_tokens of each request                     (32)
  GRIDGATE_WAIT_S         think time between a user's requests, seconds  (0)
  GRIDGATE_OVERHEAD_DIR   where each locust process writes what it saw (overhead-<pid>.json):
                          x-gridgate-overhead-ms values, stream first-token times, failures by error
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
OVERHEAD_DIR = os.environ.get("GRIDGATE_OVERHEAD_DIR")
CHAT = "/v1/chat/completions"
FIRST_CONTENT = re.compile(rb'"content":"[^"]')  # a non-empty content delta: the first token
PROMPTS = ("Say hello.", "Summarise the plot of Hamlet in one line.", "What is 17 * 23?",
           "Write a haiku about load balancers.")

# x-gridgate-overhead-ms values this process saw, how many responses lacked the header, and the
# streams' times to first token (kept out of locust's stats so its request counts stay true).
overhead_ms: list[float] = []
missing_overhead = 0
first_token_ms_seen: list[float] = []
failure_counts: dict[str, int] = {}  # "<request name>: <error>" -> count


@events.request.add_listener
def count_failure(name: str, exception: BaseException | None, **_kwargs: Any) -> None:
    if exception is not None:
        key = f"{name}: {exception}"
        failure_counts[key] = failure_counts.get(key, 0) + 1


def record_overhead(headers: Any) -> None:
    global missing_overhead
    value = headers.get("x-gridgate-overhead-ms") if headers else None
    if value is None:
        missing_overhead += 1
        return
    try:
        overhead_ms.append(float(value))
    except ValueError:
        missing_overhead += 1


def chat_body(stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS,
                            "messages": [{"role": "user", "content": random.choice(PROMPTS)}]}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


class ChatUser(FastHttpUser):
    wait_time = constant(WAIT_S)

    @task
    def chat(self) -> None:
        if random.random() < STREAM_SHARE:
            self.chat_stream()
        else:
            self.chat_plain()

    def chat_plain(self) -> None:
        with self.client.post(CHAT, json=chat_body(False), name="chat", catch_response=True) as response:
            record_overhead(response.headers)
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

    def chat_stream(self) -> None:
        """Time the whole stream as the request (not just its headers); note the time to first token."""
        started = time.perf_counter()
        first_token_ms: float | None = None
        with self.client.post(CHAT, json=chat_body(True), name="chat stream", stream=True,
                              catch_response=True) as response:
            record_overhead(response.headers)
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
            response.request_meta["response_time"] = (time.perf_counter() - started) * 1000
            response.request_meta["response_length"] = len(received)
            if not received.rstrip().endswith(b"data: [DONE]"):
                response.failure("stream ended without [DONE]")
            elif b'"usage":{' not in received:
                response.failure("stream without a usage chunk")
        if first_token_ms is not None:
            first_token_ms_seen.append(first_token_ms)


@events.quitting.add_listener
def write_overhead(environment: Any, **_kwargs: Any) -> None:
    """Each locust process writes what it saw; bench.py merges the files."""
    if not OVERHEAD_DIR:
        return
    os.makedirs(OVERHEAD_DIR, exist_ok=True)
    with open(os.path.join(OVERHEAD_DIR, f"overhead-{os.getpid()}.json"), "w") as out:
        json.dump({"overhead_ms": overhead_ms, "missing": missing_overhead, "first_token_ms": first_token_ms_seen,
                   "failures": failure_counts}, out)
