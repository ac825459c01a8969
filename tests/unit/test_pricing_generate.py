"""`make prices`: the generator, run on a small LiteLLM-shaped table (never the network)."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import zipfile
from pathlib import Path

import pytest

from gateway.pricing import generate
from gateway.pricing.table import parse_table

M = 10**6  # USD per token -> nano-USD per million tokens: x 10**15; these fixtures write n * 1e-9 USD a token

SOURCE = {
    "sample_spec": {"mode": "one of: chat, embedding", "input_cost_per_token": 0.0},
    "gpt-4o": {
        "mode": "chat", "litellm_provider": "openai",
        "input_cost_per_token": 2.5e-06, "output_cost_per_token": 1e-05, "cache_read_input_token_cost": 1.25e-06,
        "input_cost_per_token_batches": 1.25e-06, "input_cost_per_token_priority": 4.25e-06,  # service tiers: left out
        "max_input_tokens": 128000, "supports_vision": True,
    },
    "claude-x": {
        "mode": "chat", "input_cost_per_token": 3e-06, "output_cost_per_token": 1.5e-05,
        "cache_read_input_token_cost": 3e-07, "cache_creation_input_token_cost": 3.75e-06,
        "cache_creation_input_token_cost_above_1hr": 6e-06,  # one-hour writes: left out
    },
    "gemini-x": {
        "mode": "chat", "input_cost_per_token": 1.25e-06, "output_cost_per_token": 1e-05,
        "cache_read_input_token_cost": 1.25e-07,
        "input_cost_per_token_above_200k_tokens": 2.5e-06, "output_cost_per_token_above_200k_tokens": 1.5e-05,
        "input_cost_per_token_above_200k_tokens_priority": 9e-06,  # a service tier's tier: left out
        "input_cost_per_token_above_500k_tokens": 5e-06,  # the next tier keeps the 200k tier's output price
    },
    "xai/grok-x": {
        "mode": "chat", "litellm_provider": "xai", "input_cost_per_token": 3e-06, "output_cost_per_token": 1.5e-05,
        "input_cost_per_token_above_128k_tokens": 6e-06,
    },
    "reasoner": {"mode": "responses", "input_cost_per_token": 1e-06, "output_cost_per_token": 4e-06,
                 "output_cost_per_reasoning_token": 8e-06},
    "dashscope/qwen-x": {
        "mode": "chat", "litellm_provider": "dashscope",
        "tiered_pricing": [
            {"input_cost_per_token": 1.2e-06, "output_cost_per_token": 3.6e-06, "range": [256000.0, 1000000.0]},
            {"input_cost_per_token": "4e-07", "output_cost_per_reasoning_token": 4e-06, "output_cost_per_token": 1.2e-06,
             "range": [0, 256000.0]},
        ],
    },
    "noisy": {"mode": "completion", "input_cost_per_token": 9.499999999999999e-07, "output_cost_per_token": 2e-06,
              "input_cost_per_token_above_100k_tokens": 9.499999999999999e-07},  # a tier that changes nothing
    "text-embedding-x": {"mode": "embedding", "input_cost_per_token": 2e-08},
    "free-model": {"mode": "chat", "input_cost_per_token": 0.0, "output_cost_per_token": 0.0},
    "dall-e-x": {"mode": "image_generation", "input_cost_per_pixel": 1e-08, "output_cost_per_token": 1e-06},
    "tts-x": {"mode": "chat", "input_cost_per_second": 0.0001, "output_cost_per_second": 0.0002},
    "broken": {"mode": "chat", "input_cost_per_token": "n/a", "output_cost_per_token": -1.0},
    "not-a-model": [1, 2, 3],
}

EXPECTED = {
    "claude-x": [[0, 3000 * M, 15000 * M, 300 * M, 3750 * M, 15000 * M]],
    "dashscope/qwen-x": [[0, 400 * M, 1200 * M, 400 * M, 400 * M, 4000 * M],
                         [256001, 1200 * M, 3600 * M, 1200 * M, 1200 * M, 3600 * M]],
    "free-model": [[0, 0, 0, 0, 0, 0]],
    "gemini-x": [[0, 1250 * M, 10000 * M, 125 * M, 1250 * M, 10000 * M],
                 [200001, 2500 * M, 15000 * M, 125 * M, 2500 * M, 15000 * M],
                 [500001, 5000 * M, 15000 * M, 125 * M, 5000 * M, 15000 * M]],
    "gpt-4o": [[0, 2500 * M, 10000 * M, 1250 * M, 2500 * M, 10000 * M]],
    "noisy": [[0, 950 * M, 2000 * M, 950 * M, 950 * M, 2000 * M]],
    "reasoner": [[0, 1000 * M, 4000 * M, 1000 * M, 1000 * M, 8000 * M]],
    "text-embedding-x": [[0, 20 * M, 0, 20 * M, 20 * M, 0]],
    "xai/grok-x": [[0, 3000 * M, 15000 * M, 3000 * M, 3000 * M, 15000 * M],
                   [128000, 6000 * M, 15000 * M, 6000 * M, 6000 * M, 15000 * M]],  # xAI: from 128k itself
}

LICENSE = "MIT License\n\nCopyright (c) 2023 Berri AI\n"


@pytest.fixture()
def source(tmp_path: Path) -> Path:
    path = tmp_path / "source.json"
    path.write_text(json.dumps(SOURCE))
    (tmp_path / "LICENSE").write_text(LICENSE)
    return path


def test_the_generator_keeps_the_token_prices_of_metered_models_as_integers(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert generate.main(["--source", str(source), "--source-version", "9.9.9",
                          "--license", str(tmp_path / "LICENSE"), "--out", str(out)]) == 0
    written = json.loads((out / "prices.json").read_text())
    assert written["models"] == EXPECTED
    assert written["source_version"] == "9.9.9"
    assert written["source_sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    table = parse_table((out / "prices.json").read_bytes())  # what the gateway loads
    assert sorted(table.models) == sorted(EXPECTED)
    notice = (out / "NOTICE").read_text()
    assert "9.9.9" in notice and "Copyright (c) 2023 Berri AI" in notice


def test_the_output_is_stable_and_diffs_by_model(source: Path, tmp_path: Path) -> None:
    for run in ("a", "b"):
        generate.main(["--source", str(source), "--out", str(tmp_path / run)])
    first = (tmp_path / "a" / "prices.json").read_bytes()
    assert first == (tmp_path / "b" / "prices.json").read_bytes()
    assert b'\n    "gpt-4o": [[0,2500000000,10000000000,1250000000,2500000000,10000000000]],\n' in first


def test_a_table_that_is_not_the_pinned_one_is_refused(tmp_path: Path) -> None:
    data = json.dumps(SOURCE).encode()
    with pytest.raises(generate.SourceError, match="SHA-256 is [0-9a-f]{64}, the pin is 0{64}"):
        generate.generate(data, LICENSE, "1.0", tmp_path, expected_sha256="0" * 64)
    assert not (tmp_path / "prices.json").exists()
    assert generate.generate(data, LICENSE, "1.0", tmp_path, hashlib.sha256(data).hexdigest()) == len(EXPECTED)


def test_a_source_that_is_no_price_table_fails_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert generate.main(["--source", str(bad), "--out", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.startswith("prices: not a JSON price table")


def test_the_table_and_license_are_read_from_a_wheel_or_an_sdist(tmp_path: Path) -> None:
    table = json.dumps(SOURCE).encode()
    wheel = tmp_path / "litellm-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("litellm/__init__.py", "")
        archive.writestr(generate.SOURCE_MEMBER, table)
        archive.writestr("litellm-1.0.dist-info/licenses/LICENSE", LICENSE)
    assert generate.read_archive(wheel) == (table, LICENSE)
    sdist = tmp_path / "litellm-1.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as archive:
        for name, data in ((f"litellm-1.0/{generate.SOURCE_MEMBER}", table), ("litellm-1.0/LICENSE", LICENSE.encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    assert generate.read_archive(sdist) == (table, LICENSE)
    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as archive:
        archive.writestr("litellm/__init__.py", "")
    with pytest.raises(generate.SourceError, match="no price table"):
        generate.read_archive(empty)
