"""A response cache hit's access line (docs/cache.md) comes from a template of its own: byte for byte the
line encoded whole, with its own savings, times and ids."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import msgspec
import pytest

from tests.unit.test_access_log_lines import filled_lines, varied_records
from workers.access_log import AccessLog
from workers.line_writer import LineWriter


def _hit_records(count: int, seed: int = 43) -> list:
    rng = random.Random(seed)
    records = varied_records(count, seed)
    for record in records:
        if rng.random() < 0.7:  # a hit: no upstream (no overhead), no usage, what it saved (or None)
            record.cache = "hit"
            record.overhead_s = None
            record.tokens_prompt = record.tokens_completion = None
            record.saved_tokens = rng.choice([None, 0, 26, 10**7])
            record.saved_nusd = rng.choice([None, 0, 1234, 10**12])
            if record.cost_nusd is not None:
                record.cost_nusd = 0
                record.tokens_cached = record.tokens_reasoning = None
        else:
            record.cache = rng.choice([None, "miss", "bypass"])
    return records


@pytest.mark.parametrize("sample", [1.0, 1.0 - 1e-12])  # every line kept as its values; or as its record
def test_a_hit_line_from_its_template_is_byte_for_byte_the_line_encoded_whole(tmp_path: Path, sample: float) -> None:
    records = _hit_records(4000)

    async def write() -> tuple[AccessLog, list[bytes]]:
        access_log = AccessLog(LineWriter(str(tmp_path / "access.log"), flush_delay_s=10.0), sample)
        lines = filled_lines(access_log, records)
        await access_log.close()
        return access_log, lines

    access_log, lines = asyncio.run(write())
    assert len(lines) == len(records)
    for record, text in zip(records, lines, strict=True):
        ts = json.loads(text)["ts"]
        assert text == msgspec.json.encode(access_log._line(record, ts)) + b"\n", text
    hits = [json.loads(text) for record, text in zip(records, lines, strict=True) if record.cache == "hit"]
    assert len(access_log._hit_templates) > 4  # hits were written from templates, several kinds of them
    assert {line.get("saved_nusd") for line in hits} >= {None, 0, 1234, 10**12}  # each its own savings
