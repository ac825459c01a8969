"""Access-log lines are formatted at write-out: what a line says is what was true when the request ended."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

from workers.access_log import AccessLog
from workers.line_writer import LineWriter
from workers.request_record import RequestRecord


def _exchange(ended_ms_ago: float, took_ms: float) -> SimpleNamespace:
    """The fields a record copies from its exchange when it closes, for a request that started `took_ms`
    before it ended."""
    t_start = time.perf_counter() - (took_ms + ended_ms_ago) / 1000
    return SimpleNamespace(t_start=t_start, t_first_byte=t_start + 0.002, method=b"POST",
                           target=b"/v1/chat/completions?key=secret", body=b"x" * 40, bytes_out=123, record=None)


def test_the_line_names_the_shadow_limits_that_would_have_refused_the_request(tmp_path: Path) -> None:
    async def write() -> list[dict]:
        access_log = AccessLog(LineWriter(str(tmp_path / "access.log"), flush_delay_s=10.0))
        ends = SimpleNamespace(close=access_log.record)
        RequestRecord(exchange=_exchange(ended_ms_ago=0, took_ms=1), ends=ends, request_id=b"req-1", tenant="team-a",
                      status=200, shadow=("key requests 60/1m", "rule r tokens 100/1h")).close()
        RequestRecord(exchange=_exchange(ended_ms_ago=0, took_ms=1), ends=ends, request_id=b"req-2", tenant="team-a",
                      status=200).close()
        await access_log.close()
        return [json.loads(text) for text in (tmp_path / "access.log").read_text().splitlines()]

    shadowed, plain = asyncio.run(write())
    assert shadowed["shadow"] == ["key requests 60/1m", "rule r tokens 100/1h"]
    assert "shadow" not in plain  # only when some limit would have refused


def test_a_line_written_later_keeps_the_times_and_values_of_when_it_was_recorded(tmp_path: Path) -> None:
    async def write() -> list[dict]:
        access_log = AccessLog(LineWriter(str(tmp_path / "access.log"), flush_delay_s=10.0))
        exchange = _exchange(ended_ms_ago=0, took_ms=10)
        record = RequestRecord(exchange=exchange, ends=SimpleNamespace(close=access_log.record), request_id=b"req-1",
                               tenant="team-a", capability="m", overhead_s=0.0004567, status=200,
                               tokens_prompt=7, tokens_completion=16, body=b"upstream body")
        record.close()
        recorded_at = time.time()
        exchange.bytes_out = 999  # changes after the end are not the line's
        assert record.exchange is None and record.body == b""  # a kept line holds no exchange, no body
        access_log.rejected(431, "header_too_large")
        await asyncio.sleep(0.2)  # the line is formatted at close, well after the request ended
        await access_log.close()
        assert all(b"?" not in target for target in access_log._paths)  # no query (no key) is remembered
        lines = [json.loads(text) for text in (tmp_path / "access.log").read_text().splitlines()]
        stamped = datetime.fromisoformat(lines[0]["ts"].replace("Z", "+00:00")).timestamp()
        # When it ended, not when it was written 0.2 s later. (Within 0.1 s of the clock read just after the
        # close, not 0.01: a process that loses the CPU between the two lines on a loaded machine reads later.
        # And up to 5 ms after it: the end is kept on the monotonic clock and put on the wall clock at the
        # write-out, so a wall clock slewed or stepped meanwhile moves the stamp by as much; one run saw 0.5 ms.)
        assert recorded_at - 0.1 <= stamped <= recorded_at + 0.005
        return lines

    served, rejected = asyncio.run(write())
    assert (served["request_id"], served["tenant"], served["path"], served["status"]) == (
        "req-1", "team-a", "/v1/chat/completions", 200)
    assert 10 <= served["duration_ms"] < 150  # not the 200 ms it waited to be written
    assert served["first_byte_ms"] == 2.0 and served["overhead_ms"] == 0.457
    assert (served["bytes_in"], served["bytes_out"]) == (40, 123)
    assert (served["tokens_prompt"], served["tokens_completion"]) == (7, 16)
    assert (rejected["status"], rejected["error"], rejected["method"], rejected["duration_ms"]) == (
        431, "header_too_large", None, None)


def test_timestamps_follow_the_end_times_across_second_boundaries(tmp_path: Path) -> None:
    # `_fill` formats a millisecond of an already formatted second itself, and asks `_timestamp` otherwise:
    # every line's time must be its end time (on the wall clock) to the millisecond, both ways.
    async def write() -> tuple[list[float], list[str], str]:
        access_log = AccessLog(LineWriter(str(tmp_path / "access.log"), flush_delay_s=10.0))
        start = time.perf_counter()
        ends = [start + i * 0.000_37 for i in range(6000)]  # 2.2 s: two or three second boundaries
        for ended in ends:
            access_log.record(RequestRecord(request_id=b"r", status=200, ended=ended, closed=True))
        await access_log.close()
        lines = (tmp_path / "access.log").read_text().splitlines()
        return ends, [json.loads(text)["ts"] for text in lines], access_log._timestamp(1_700_000_000_005)

    ends, stamps, general = asyncio.run(write())
    assert general == "2023-11-14T22:13:20.005Z"
    assert len(stamps) == len(ends)
    wall = [datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp() for ts in stamps]
    offsets = [stamp - ended for stamp, ended in zip(wall, ends, strict=True)]
    assert max(offsets) - min(offsets) < 0.0011  # one wall offset for all, truncated to the millisecond
    assert len({ts[:19] for ts in stamps}) >= 3 and all(len(ts) == 24 for ts in stamps)


def test_a_sampled_traced_and_shadowed_line_carries_every_field_in_the_documented_order(tmp_path: Path) -> None:
    # Evidence, trace and shadow are set on the line after it is built (most lines have none of them).
    from gateway.routing.evidence import RouteEvidence
    from workers.access_log import AccessLine

    async def write() -> list[dict]:
        access_log = AccessLog(LineWriter(str(tmp_path / "access.log"), flush_delay_s=10.0))
        evidence = RouteEvidence("site-a", "existing_only", 3, {"cooled": 1}, None)
        for fields in ({"evidence": evidence, "trace": SimpleNamespace(trace_id="t-1"), "shadow": ("a 1/1m",),
                        "identity": "mtls", "subject": "spiffe://example.org/sa/a"},
                       {"trace": SimpleNamespace(trace_id="t-2")}, {}):
            access_log.record(RequestRecord(request_id=b"r", status=200, ended=time.perf_counter(), closed=True,
                                            **fields))
        await access_log.close()
        return [json.loads(text) for text in (tmp_path / "access.log").read_text().splitlines()]

    full, traced, plain = asyncio.run(write())
    assert [key for key in full if key in ("site", "admission_state", "candidates", "excluded", "trace_id",
                                           "shadow")] == ["site", "admission_state", "candidates", "excluded",
                                                          "trace_id", "shadow"]
    assert list(full) == [key for key in AccessLine.__struct_fields__ if key in full]
    assert (full["site"], full["admission_state"], full["candidates"], full["excluded"]) == (
        "site-a", "existing_only", 3, {"cooled": 1})
    assert (full["trace_id"], full["shadow"], traced["trace_id"]) == ("t-1", ["a 1/1m"], "t-2")
    assert (full["identity"], full["subject"]) == ("mtls", "spiffe://example.org/sa/a") and "identity" not in plain
    assert "site" not in traced and "shadow" not in traced and "trace_id" not in plain


class _Endpoint:
    """An upstream endpoint as the line sees it (hashable by identity, as workers.clusters.UpstreamEndpoint)."""

    __slots__ = ("address",)

    def __init__(self, address: str) -> None:
        self.address = address


def varied_records(count: int, seed: int = 7) -> list[RequestRecord]:
    """Closed records of many shapes: a few shared values (tenants, paths, routes, endpoints) that repeat,
    quotes, backslashes, ``%`` and unicode in them, None and set per-request values, tiny and large times,
    priced or not, and now and then a rarer field."""
    import random

    from gateway.models.aliases import ModelRoute
    from gateway.routing.evidence import RouteEvidence
    from gateway.routing.plan import RouteDecision

    rng = random.Random(seed)
    pick = rng.choice

    def route(cluster: str, stable_id: str, group: int | None, mode: str, affinity: str) -> RouteDecision:
        return RouteDecision(None, cluster, stable_id, group, mode, "rev-%1", affinity, 0, (), 0, None, b"")

    routes = [None, route("bench-a", "inference_model/m/local/a", 0, "roundRobin", "new"),
              route("bench-b", "im/m/b", None, "stable_hash", "reused"),
              route('q"uote\\d', "id-é-β-%d", 3, "pinned", "none")]
    endpoints = [None, _Endpoint("127.0.0.1:19001"), _Endpoint("[::1]:8080")]
    tenants = [None, "team-a", "équipe-β", 'a"b\\c%s', "\x01ctl"]
    targets = [None, b"/v1/chat/completions", b"/v1/embeddings?key=secret%20x", b"/p%20ath/\xe9\"x", b"/"]
    request_ids = [b"a7985488122f-1f4", b'q"uo\\te', b"%s%d%%", b"\x00", b"", None, b"\xff\xfe"]
    times = [1e-7, 0.000335, 0.0004567, 0.002, 1.5, 12345.6789, 1e6, 3e13]  # 3e13 s: 3e16 ms, in exponent form
    # A few sets of shared values, as a gateway sees (its lines repeat them), some of them priced.
    profiles = [dict(capability=pick([None, "demo-model", "m-ü"]), route=pick(routes),
                     endpoint=pick(endpoints), error=pick([None, None, "client_closed", "upstream_timeout"]),
                     method=pick([b"POST", b"POST", b"GET", None]), target=pick(targets),
                     served_model=pick([None, None, "fallback-m"]), priced=rng.random() < 0.6) for _ in range(16)]
    identities = [("mtls", "spiffe://example.org/sa/a"), ("jwt:okta", "user-7"), ("jwt:okta", 'quote " \\ é 100%')]
    records = []
    start = time.perf_counter()
    for index in range(count):
        shared = dict(pick(profiles))
        t_start = None if rng.random() < 0.05 else start - pick(times)
        ended = start + index * 0.0007 if t_start is None else t_start + pick(times)
        usage = rng.random()
        fields = dict(
            request_id=pick(request_ids) if rng.random() < 0.2 else b"a7985488122f-%x" % index, tenant=pick(tenants),
            attempts=rng.randrange(0, 4), status=pick([200, 200, 200, 429, 499, 502]), ended=ended,
            t_start=t_start, t_first_byte=0.0 if rng.random() < 0.1 or t_start is None else t_start + pick(times) / 2,
            bytes_in=rng.randrange(0, 10**9), bytes_out=rng.randrange(0, 10**12),
            # Usage not reported (not metered: most often both None), or one count only.
            tokens_prompt=None if usage < 0.2 else rng.randrange(0, 10**6),
            tokens_completion=None if usage < 0.17 or usage > 0.97 else rng.randrange(0, 10**6),
            overhead_s=None if rng.random() < 0.1 else pick(times) / 3, closed=True,
        )
        if shared.pop("priced"):
            fields.update(cost_nusd=pick([0, 17, 123456789012]), tokens_cached=pick([None, 0, 5]),
                          tokens_reasoning=pick([None, 0, 9]))
        elif rng.random() < 0.3:  # usage details, not priced: not on the line
            fields.update(tokens_cached=5, tokens_reasoning=9)
        fields.update(shared)
        if rng.random() < 0.2:  # a JWT's or a client certificate's request: identity and subject on the line
            fields["identity"], fields["subject"] = pick(identities)
        rare = rng.random()
        if rare < 0.03:
            fields["evidence"] = RouteEvidence("site-a", "existing_only", 3, {"cooled": 1}, None)
        elif rare < 0.06:
            fields["trace"] = SimpleNamespace(trace_id=f"t-{index}")
        elif rare < 0.09:
            fields["shadow"] = ("key requests 60/1m",)
        elif rare < 0.12:
            fields.update(model_route=ModelRoute("alias-m", "demo-model", True), fallback_hops=1,
                          fallback_reasons=["status_429"])
        elif rare < 0.14:
            fields.update(filtered=2, filtered_reasons=1)
        elif rare < 0.15:
            fields["spend_alert"] = "tenant team-a 80% of 10 USD/1d"
        records.append(RequestRecord(**fields))
    return records


def filled_lines(access_log: AccessLog, records: list, batch_size: int = 500) -> list[bytes]:
    """The lines ``access_log`` writes for ``records``, recorded and filled in batches (no file I/O)."""
    lines: list[bytes] = []
    for batch in range(0, len(records), batch_size):
        for record in records[batch:batch + batch_size]:
            access_log.record(record)
        access_log._fill()
        buffer = access_log.writer.buffer  # type: ignore[union-attr]
        lines += bytes(buffer).splitlines(keepends=True)
        buffer.clear()
    return lines


def test_a_line_from_a_template_is_byte_for_byte_the_line_encoded_whole(tmp_path: Path) -> None:
    # Lines sharing their tenant, path, route, endpoint ... are written from a template (`_template`); each
    # must be exactly what encoding its AccessLine writes, for every shape of record, in several batches.
    import msgspec

    records = varied_records(4000)

    async def write() -> tuple[AccessLog, list[bytes], int]:
        access_log = AccessLog(LineWriter(str(tmp_path / "access.log"), flush_delay_s=10.0))
        whole = 0
        encode_line = access_log._encode_line

        def counted(*args: object) -> None:
            nonlocal whole
            whole += 1
            encode_line(*args)  # type: ignore[arg-type]

        access_log._encode_line = counted  # type: ignore[method-assign]
        lines = filled_lines(access_log, records)
        await access_log.close()
        return access_log, lines, whole

    access_log, lines, whole = asyncio.run(write())
    assert len(lines) == len(records)
    for record, text in zip(records, lines, strict=True):
        ts = json.loads(text)["ts"]
        assert text == msgspec.json.encode(access_log._line(record, ts)) + b"\n", text
    # Every line of a template's shape came from one, but the first of each template: a line with no rarer
    # field, an answer sent, its request id and times all there (a token count None is its own: null).
    rare = ("filtered", "evidence", "trace", "shadow", "model_route", "spend_alert")
    own = ("request_id", "t_start", "overhead_s")
    templated = [r for r in records if not any(getattr(r, name) for name in rare) and r.t_first_byte
                 and all(getattr(r, name) is not None for name in own)]
    assert len(templated) > len(records) / 3
    assert whole == len(records) - len(templated) + len(access_log._templates)
    assert all(b"secret" not in repr(key).encode() for key in access_log._templates)


def test_unsampled_lines_are_written_out_on_the_writers_own_timer_and_bounded_per_write_out(tmp_path: Path) -> None:
    # Unsampled, ``record`` is the pending list's append (no call arms the flush): the writer writes out every
    # flush_delay_s whether or not lines came, and a write-out takes at most `_max_pending` (the rest counted).
    async def write() -> tuple[list[dict], int, list[dict], int]:
        path = tmp_path / "access.log"
        access_log = AccessLog(LineWriter(str(path), flush_delay_s=0.01))
        ends = SimpleNamespace(close=access_log.record)
        await asyncio.sleep(0.05)  # idle write-outs: nothing to write
        RequestRecord(exchange=_exchange(ended_ms_ago=0, took_ms=1), ends=ends, request_id=b"req-1", tenant="t",
                      status=200).close()
        await asyncio.sleep(0.1)  # no close, no flush asked for: the timer wrote it
        early = [json.loads(text) for text in path.read_text().splitlines()]
        access_log._max_pending = 3
        for number in range(5):
            RequestRecord(exchange=_exchange(ended_ms_ago=0, took_ms=1), ends=ends, request_id=b"more-%d" % number,
                          tenant="t", status=200).close()
        await asyncio.sleep(0.1)
        dropped = access_log.dropped
        await access_log.close()
        return early, dropped, [json.loads(text) for text in path.read_text().splitlines()], len(access_log._pending)

    early, dropped, lines, left = asyncio.run(write())
    assert [line["request_id"] for line in early] == ["req-1"]
    assert [line["request_id"] for line in lines] == ["req-1", "more-0", "more-1", "more-2"]
    assert (dropped, left) == (2, 0)



def test_a_write_out_makes_its_lines_a_slice_per_callback_in_order_and_loses_none(tmp_path: Path) -> None:
    # A busy worker's write-out formats its pending lines FILL_SLICE_LINES at a time, the rest in callbacks
    # right after (no one stall of the loop for all of them); every line arrives, in the order recorded.
    from workers.line_writer import FILL_SLICE_LINES

    count = FILL_SLICE_LINES * 3 + 5
    path = tmp_path / "access.log"

    async def write() -> tuple[list[int], list[str]]:
        access_log = AccessLog(LineWriter(str(path), flush_delay_s=10.0))
        writer = access_log.writer
        assert writer is not None
        ends = SimpleNamespace(close=access_log.record)
        for n in range(count):
            RequestRecord(exchange=_exchange(ended_ms_ago=0, took_ms=1), ends=ends, request_id=b"req-%d" % n,
                          tenant="team-a", status=200).close()
        seen: list[int] = []
        writer.flush()  # the timer's call: one slice now
        seen.append(len(path.read_text().splitlines()))
        for _ in range(4):
            await asyncio.sleep(0)  # each callback after it: one more slice
            seen.append(len(path.read_text().splitlines()))
        await access_log.close()
        return seen, [json.loads(text)["request_id"] for text in path.read_text().splitlines()]

    seen, ids = asyncio.run(write())
    assert seen == [FILL_SLICE_LINES, 2 * FILL_SLICE_LINES, 3 * FILL_SLICE_LINES, count, count]
    assert ids == [f"req-{n}" for n in range(count)]


def test_closing_the_log_writes_every_pending_line_at_once(tmp_path: Path) -> None:
    from workers.line_writer import FILL_SLICE_LINES

    path = tmp_path / "access.log"

    async def write() -> int:
        access_log = AccessLog(LineWriter(str(path), flush_delay_s=10.0))
        ends = SimpleNamespace(close=access_log.record)
        for n in range(FILL_SLICE_LINES * 2 + 1):
            RequestRecord(exchange=_exchange(ended_ms_ago=0, took_ms=1), ends=ends, request_id=b"r%d" % n,
                          tenant="team-a", status=200).close()
        await access_log.close()
        return len(path.read_text().splitlines())

    assert asyncio.run(write()) == FILL_SLICE_LINES * 2 + 1
