"""A differential fuzzer for the upstream response parser (``ClientCodec``), with hypothesis.

Response streams are generated from a model (1xx heads, a final head framed by Content-Length,
chunked with extensions and trailers, both, or nothing; bodiless answers to HEAD, 204 and 304;
HTTP/1.0 and ``Connection: close``; data after the end on the same connection; the provider's EOF),
rendered to bytes, optionally mutated byte by byte, and fed to the codec in random pieces. Checked:

- the same events whatever the split (bodies compared as the bytes they add up to);
- the same events as plain h11 fed the whole stream at once (the reference: the codec frames bodies
  itself and caps 1xx heads, and must agree with h11 everywhere else, except that it may refuse a
  malformed chunk line, extension or trailer that h11 waits on or tolerates, after the same events);
- for a valid stream, the body delivered is the declared body;
- ``reusable`` is True only when the answer ended cleanly, framed one way beyond doubt, with a body
  its request and status allow, after no 1xx head declaring a body, and nothing after it (not even
  bytes fed after the end, nor the provider's EOF);
- no exception but the codec's ParseError, no endless event loop, and the bytes buffered stay bounded.

``make test`` runs a short derandomized pass (``HYPOTHESIS_PROFILE`` unset: the ``ci`` profile, a few
seconds); ``make fuzz-upstream`` a long random one (``HYPOTHESIS_PROFILE=fuzz``, ``FUZZ_EXAMPLES``
examples per property, 20,000 by default). A failing example found by a long run is kept below as an
``@example`` so that every later run replays it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import h11
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.http import client_codec, codec

settings.register_profile("ci", max_examples=150, derandomize=True, database=None, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fuzz", max_examples=int(os.environ.get("FUZZ_EXAMPLES", "20000")), deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")

MAX_HEAD = 65536  # the codec's default head limit, which bounds what it may buffer
MAX_EVENTS = 10_000  # more events than this from one stream: the codec is looping


# -- the model ----------------------------------------------------------------------------------------
@dataclass
class Model:
    method: bytes
    informational: list[tuple[int, list[tuple[bytes, bytes]]]]
    version: bytes
    status: int
    headers: list[tuple[bytes, bytes]]
    framing: str  # length | chunked | both | none
    body: bytes
    chunks: list[int] = field(default_factory=list)  # chunk sizes (chunked, both)
    extensions: list[bytes] = field(default_factory=list)  # per chunk, b"" or b";name=value"
    trailers: list[tuple[bytes, bytes]] = field(default_factory=list)
    close: bool = False  # Connection: close
    after: bytes = b""  # bytes on the connection after the answer
    eof: bool = False  # the provider closes after sending everything

    @property
    def bodiless(self) -> bool:
        return self.method == b"HEAD" or self.status in (204, 304)

    @property
    def odd_informational(self) -> bool:
        return any(name in (b"content-length", b"transfer-encoding") for _, hs in self.informational for name, _ in hs)

    def render(self) -> bytes:
        out = []
        for status, headers in self.informational:
            out.append(b"HTTP/1.1 %d Info\r\n" % status + b"".join(b"%s: %s\r\n" % h for h in headers) + b"\r\n")
        headers = list(self.headers)
        encoded = self._encoded_body()
        if self.framing in ("length", "both"):
            declared = len(self.body) if self.framing == "length" else len(encoded)
            headers.append((b"Content-Length", b"%d" % declared))
        if self.framing in ("chunked", "both"):
            headers.append((b"Transfer-Encoding", b"chunked"))
        if self.close:
            headers.append((b"Connection", b"close"))
        out.append(b"HTTP/%s %d Reason\r\n" % (self.version, self.status)
                   + b"".join(b"%s: %s\r\n" % h for h in headers) + b"\r\n")
        if not self.bodiless:
            out.append(encoded)
        out.append(self.after)
        return b"".join(out)

    def _encoded_body(self) -> bytes:
        if self.framing in ("length", "none"):
            return self.body
        out, start = [], 0
        for size, extension in zip(self.chunks, self.extensions, strict=True):
            out.append(b"%x%s\r\n%s\r\n" % (size, extension, self.body[start:start + size]))
            start += size
        out.append(b"0\r\n" + b"".join(b"%s: %s\r\n" % t for t in self.trailers) + b"\r\n")
        return b"".join(out)

    def expected_events(self) -> list[tuple]:
        """What a correct parser reports (before any error the 1xx cap raises)."""
        events: list[tuple] = [("info", status) for status, _ in self.informational]
        if len(self.informational) > client_codec.MAX_INFORMATIONAL_HEADS:
            return [*events[:client_codec.MAX_INFORMATIONAL_HEADS], ("error",)]
        events.append(("head", self.status))
        if self.bodiless:
            return [*events, ("end",)]
        delivered = self.body + (self.after if self.framing == "none" else b"")
        if delivered:
            events.append(("body", delivered))
        if self.framing != "none" or self.eof:
            events.append(("end",))
        return events

    def expected_reusable(self) -> bool:
        return (len(self.informational) <= client_codec.MAX_INFORMATIONAL_HEADS and not self.odd_informational
                and self.version == b"1.1" and not self.close and not self.bodiless
                and self.framing in ("length", "chunked") and not self.after and not self.eof)


_NAME = st.text("abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=10).map(lambda s: b"x-" + s.encode())
_VALUE = st.text("".join(map(chr, range(0x21, 0x7f))), max_size=16).map(str.encode)
_HEADERS = st.lists(st.tuples(_NAME, _VALUE), max_size=3)
_ODD_INFO_HEADER = st.sampled_from([(b"content-length", b"5"), (b"transfer-encoding", b"chunked")])


# Framing headers a broken provider adds to an otherwise valid answer (the malformed streams only).
_ODD_HEADERS = st.sampled_from([
    (b"Content-Length", b"7"), (b"Content-Length", b"0"), (b"Content-Length", b"-1"), (b"Content-Length", b"+5"),
    (b"Content-Length", b"1 2"), (b"Content-Length", b"99999999999999999999"), (b"Transfer-Encoding", b"gzip"),
    (b"Transfer-Encoding", b"chunked, identity"), (b"Transfer-Encoding", b"identity"),
    (b"Transfer-Encoding", b"chunked"), (b"Connection", b"keep-alive, close"), (b"Connection", b"upgrade"),
    (b"X-Folded", b"a\r\n b"), (b"X-Bare-Lf", b"a\nContent-Length: 3"),
])


@st.composite
def models(draw, odd: bool = False) -> Model:
    informational = draw(st.lists(
        st.tuples(st.sampled_from([100, 102, 103]),
                  st.one_of(_HEADERS, _HEADERS.flatmap(lambda hs: _ODD_INFO_HEADER.map(lambda odd: [*hs, odd])))),
        max_size=3,
    ) | st.lists(st.just((100, [])), min_size=15, max_size=20))  # around the cap
    framing = draw(st.sampled_from(["length", "chunked", "both", "none"]))
    body = draw(st.binary(max_size=200))
    chunks: list[int] = []
    left = len(body)
    while left:
        size = draw(st.integers(1, left))
        chunks.append(size)
        left -= size
    extensions = [draw(st.sampled_from([b"", b";a=1", b";name", b';q="x y"'])) for _ in chunks]
    after = draw(st.sampled_from([b"", b"", b"", b"X", b"\r\n", b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nleak"]))
    return Model(
        method=draw(st.sampled_from([b"POST", b"GET", b"HEAD"])),
        informational=informational,
        version=draw(st.sampled_from([b"1.1", b"1.1", b"1.1", b"1.0"])),
        status=draw(st.sampled_from([200, 201, 204, 304, 404, 429, 500])),
        headers=draw(_HEADERS) + (draw(st.lists(_ODD_HEADERS, max_size=2)) if odd else []),
        framing=framing,
        body=body,
        chunks=chunks,
        extensions=extensions,
        trailers=draw(st.lists(st.tuples(_NAME, _VALUE), max_size=2)) if framing in ("chunked", "both") else [],
        close=draw(st.booleans()),
        after=after,
        eof=draw(st.booleans()),
    )


def pieces_of(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:], strict=False) if b > a]


# -- running the codec and the reference ----------------------------------------------------------------
@dataclass
class Outcome:
    events: list[tuple]
    reusable: bool


def _append(events: list[tuple], item: tuple) -> None:
    if item[0] == "body" and events and events[-1][0] == "body":
        events[-1] = ("body", events[-1][1] + item[1])
    elif item[0] != "body" or item[1]:
        events.append(item)


def run_codec(method: bytes, pieces: list[bytes], eof: bool) -> Outcome:
    client = client_codec.ClientCodec(MAX_HEAD)
    client.encode_request(method, b"/", b"up", [])
    events: list[tuple] = []
    feeds = [*pieces, b""] if eof else pieces
    ended = False
    for index, piece in enumerate(feeds):
        client.feed(piece)
        if ended:
            continue  # bytes after the end: only ``reusable`` may tell
        try:
            for _ in range(MAX_EVENTS):
                event = client.next_event()
                if event is codec.NEED_DATA or event is codec.PAUSED:
                    break
                kind = type(event)
                if kind is codec.Body:
                    _append(events, ("body", bytes(event.data)))
                elif kind is codec.Informational:
                    events.append(("info", event.status_code))
                elif kind is codec.ResponseHead:
                    events.append(("head", event.status_code))
                elif kind is codec.EndOfMessage:
                    events.append(("end",))
                    ended = True
                    break
                elif kind is codec.ConnectionClosed:
                    events.append(("closed",))
                    return Outcome(events, client.reusable)
                else:
                    raise AssertionError(f"unexpected event {event!r}")
            else:
                raise AssertionError("the codec kept producing events without needing data")
        except codec.ParseError as error:
            assert error.status == 502
            events.append(("error",))
            return Outcome(events, client.reusable)
        if not ended and index < len(pieces):
            # Bounded: a head in progress is capped by h11; a counted body keeps nothing once handed out.
            assert client.buffered <= MAX_HEAD, client.buffered
    return Outcome(events, client.reusable)


def run_reference(method: bytes, data: bytes, eof: bool) -> list[tuple]:
    """Plain h11 (told the request it answers) fed the whole stream: the events up to the end."""
    parser = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
    parser.send(h11.Request(method=method, target=b"/", headers=[(b"host", b"up")]))
    parser.send(h11.EndOfMessage())
    if data:
        parser.receive_data(data)
    if eof:
        parser.receive_data(b"")  # b"" is how h11 learns of EOF
    events: list[tuple] = []
    informational = 0
    try:
        for _ in range(MAX_EVENTS):
            event = parser.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return events
            kind = type(event)
            if kind is h11.InformationalResponse:
                informational += 1
                if informational > client_codec.MAX_INFORMATIONAL_HEADS:
                    return [*events, ("error",)]  # the codec's cap
                events.append(("info", event.status_code))
            elif kind is h11.Response:
                events.append(("head", event.status_code))
            elif kind is h11.Data:
                _append(events, ("body", bytes(event.data)))
            elif kind is h11.EndOfMessage:
                return [*events, ("end",)]
            elif kind is h11.ConnectionClosed:
                return [*events, ("closed",)]
    except h11.RemoteProtocolError:
        return [*events, ("error",)]
    raise AssertionError("h11 kept producing events")


def _same_as_reference(ours: list[tuple], reference: list[tuple]) -> bool:
    # h11 told of a request reports a close before any response as an error; the codec, which tells
    # h11 of no request unless it must, reports ConnectionClosed. Both end the exchange as a reset.
    normalise = [("error",) if e == ("closed",) else e for e in ours]
    expected = [("error",) if e == ("closed",) else e for e in reference]
    if normalise == expected:
        return True
    # The chunked decoder (gateway/http/framing.py) is stricter than h11: it refuses a malformed chunk
    # line, extension or trailer as soon as the line is complete, where h11 may wait for more bytes or
    # accept it. Refusing sooner is allowed; what came before the refusal must be what h11 read.
    return normalise[-1:] == [("error",)] and _is_prefix(normalise[:-1], expected)


def _is_prefix(ours: list[tuple], reference: list[tuple]) -> bool:
    """``ours`` are the first events of ``reference`` (its last body may be cut short)."""
    if len(ours) > len(reference) or ours[:-1] != reference[:len(ours) - 1]:
        return False
    if not ours:
        return True
    last, theirs = ours[-1], reference[len(ours) - 1]
    return last == theirs or (last[0] == theirs[0] == "body" and theirs[1].startswith(last[1]))


def reusable_allowed(data: bytes, method: bytes, events: list[tuple], eof: bool) -> bool:
    """Whether the rule lets this stream's connection be reused, judged from h11's own reading."""
    if eof or not events or events[-1] != ("end",):
        return False
    parser = h11.Connection(h11.CLIENT)
    parser.send(h11.Request(method=method, target=b"/", headers=[(b"host", b"up")]))
    parser.send(h11.EndOfMessage())
    parser.receive_data(data)
    head = None
    while (event := parser.next_event()) is not h11.NEED_DATA and event is not h11.PAUSED:
        if type(event) is h11.InformationalResponse:
            if any(name in (b"content-length", b"transfer-encoding") for name, _ in event.headers):
                return False
        elif type(event) is h11.Response:
            head = event
        elif type(event) is h11.EndOfMessage:
            break
    names = [name for name, _ in head.headers]
    one_framing = (b"content-length" in names) != (b"transfer-encoding" in names)
    close = any(name == b"connection" and b"close" in value.lower() for name, value in head.headers)
    return (head.http_version == b"1.1" and not close and one_framing and method != b"HEAD"
            and head.status_code not in (204, 304) and not parser.trailing_data[0])


def check(method: bytes, data: bytes, eof: bool, cuts: list[int]) -> Outcome:
    whole = run_codec(method, [data] if data else [], eof)
    split = run_codec(method, pieces_of(data, cuts), eof)
    bytewise = run_codec(method, [data[i:i + 1] for i in range(len(data))], eof) if len(data) < 400 else split
    assert split.events == whole.events, "the events depend on how the stream was split"
    assert bytewise.events == whole.events, "the events depend on how the stream was split"
    assert split.reusable == whole.reusable == bytewise.reusable
    reference = run_reference(method, data, eof)
    sniffing = not eof and len(data) <= client_codec._INFORMATIONAL_PREFIX and not whole.events
    if not (sniffing and reference == [("error",)]):  # h11 may refuse a first byte before the codec passes it on
        assert _same_as_reference(whole.events, reference), (whole.events, reference)
    if whole.reusable:
        assert reusable_allowed(data, method, whole.events, eof)
    return whole


# -- the properties -------------------------------------------------------------------------------------
CHUNKED_THEN_NEXT = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5;x=y\r\nhello\r\n0\r\nt: 1\r\n\r\n"
                     b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nleak")


@settings(settings.get_profile(PROFILE))
@given(model=models(), cuts=st.lists(st.integers(0, 10_000), max_size=12))
@example(model=Model(b"POST", [], b"1.1", 200, [], "chunked", b"hello", [5], [b";x=y"], [(b"t", b"1")],
                     after=b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nleak"), cuts=[60])
@example(model=Model(b"HEAD", [], b"1.1", 200, [], "length", b"late body"), cuts=[])
# Found by this fuzzer: after the status code's first digit was sniffed (for 1xx heads), pieces of
# fewer than 10 bytes were held back to be sniffed again, so a head ending in a short write never ended.
@example(model=Model(b"POST", [], b"1.1", 200, [], "length", b""), cuts=[20, 39])
@example(model=Model(b"POST", [(100, [(b"content-length", b"5")])], b"1.1", 200, [], "length", b"ok"), cuts=[3])
@example(model=Model(b"POST", [(100, [])] * 17, b"1.1", 200, [], "length", b"ok"), cuts=[1, 2])
def test_valid_streams_parse_to_their_model_in_any_split(model: Model, cuts: list[int]):
    data = model.render()
    outcome = check(model.method, data, model.eof, cuts)
    assert outcome.events == model.expected_events()
    assert outcome.reusable == model.expected_reusable()


_MUTATION = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(0, 255)),
    st.tuples(st.just("insert"), st.integers(0, 10_000), st.sampled_from([b"\r\n", b"\n", b"\r", b"\x00", b" ",
                                                                           b":", b"0", b"f", b";", b"-1"])),
    st.tuples(st.just("delete"), st.integers(0, 10_000), st.integers(1, 4)),
    st.tuples(st.just("truncate"), st.integers(0, 10_000), st.just(0)),
)


def mutate(data: bytes, mutations: list[tuple]) -> bytes:
    for kind, position, argument in mutations:
        at = position % (len(data) + 1)
        if kind == "flip" and at < len(data):
            data = data[:at] + bytes([argument]) + data[at + 1:]
        elif kind == "insert":
            data = data[:at] + argument + data[at:]
        elif kind == "delete":
            data = data[:at] + data[at + argument:]
        elif kind == "truncate":
            data = data[:at]
    return data


@settings(settings.get_profile(PROFILE))
@given(model=models(odd=True), mutations=st.lists(_MUTATION, max_size=3),
       cuts=st.lists(st.integers(0, 10_000), max_size=12))
@example(model=Model(b"POST", [], b"1.1", 200, [], "chunked", b"hello", [5], [b""]),
         mutations=[("insert", 62, b"0")], cuts=[])  # a chunk-size with a leading zero
@example(model=Model(b"POST", [], b"1.1", 200, [], "length", b"hello"),
         mutations=[("insert", 35, b"1")], cuts=[10])  # a declared length one digit longer
def test_mutated_streams_never_crash_and_are_never_reused_in_doubt(model: Model, mutations: list[tuple],
                                                                   cuts: list[int]):
    data = mutate(model.render(), mutations)
    check(model.method, data, model.eof, cuts)


def test_bytes_fed_after_a_clean_end_forbid_reuse():
    for response in (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
                     b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"):
        assert run_codec(b"POST", [response], False).reusable
        assert not run_codec(b"POST", [response, b"H"], False).reusable  # a later read
        assert not run_codec(b"POST", [response + b"H"], False).reusable  # the same read
        assert not run_codec(b"POST", [response], True).reusable  # the provider closed


def test_chunked_end_followed_by_a_whole_response_is_never_reused():
    outcome = check(b"POST", CHUNKED_THEN_NEXT, False, [5, 60, 71])
    assert outcome.events == [("head", 200), ("body", b"hello"), ("end",)] and not outcome.reusable
