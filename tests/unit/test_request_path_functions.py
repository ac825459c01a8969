"""No function of the request path spans more than 50 lines (its ``def`` line to its last line, docstring
included; methods, async and nested functions too): one step per function, read at a glance. Split along a
sub-step, the rare branches out of line, so the common path gains no call."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 50
REQUEST_PATH = ("workers", "gateway/http", "gateway/request", "gateway/routing", "gateway/quota",
                "gateway/identity", "gateway/keys", "shm")


def function_spans() -> dict[str, list[int]]:
    """``file:function`` -> the span in lines of each function of that name in the request-path packages."""
    spans: dict[str, list[int]] = {}
    for package in REQUEST_PATH:
        for path in sorted((REPO / package).rglob("*.py")):
            relative = path.relative_to(REPO).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), filename=relative)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    assert node.end_lineno is not None
                    spans.setdefault(f"{relative}:{node.name}", []).append(node.end_lineno - node.lineno + 1)
    return spans


def test_the_search_finds_the_request_path():
    spans = function_spans()
    assert len(spans) > 500
    assert {"workers/relay.py:upstream_head", "gateway/request/headers.py:scan", "shm/segment.py:__init__"} <= set(spans)


def test_no_request_path_function_is_over_50_lines():
    too_long = [f"{name}:{lines}" for name, spans in sorted(function_spans().items())
                for lines in spans if lines > MAX_LINES]
    assert not too_long, f"split these functions (file:function:lines) to at most {MAX_LINES} lines: {too_long}"

