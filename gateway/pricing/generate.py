"""``make prices``: regenerate gateway/pricing/data/ from the pinned LiteLLM price table.

LiteLLM (MIT, Copyright (c) 2023 Berri AI) ships its price table in its wheel as
``litellm/model_prices_and_context_window_backup.json``. This script downloads that one wheel of
the pinned version (``pip download --no-deps --only-binary=:all:``: nothing of it is installed or
run), checks the table's SHA-256 against the pin, keeps the chat, completion, responses and
embedding models and the prices the gateway uses, and writes:

- ``data/prices.json``: per model, one row per input-size tier, in integer nano-USD per million
  tokens (gateway/pricing/table.py reads it);
- ``data/NOTICE``: where the prices come from, and LiteLLM's license.

Both files are committed: tests and CI never download. To move to a newer LiteLLM release, set
``LITELLM_VERSION``, run ``make prices``, review the SHA-256 it reports and the diff of prices,
then pin ``LITELLM_SHA256`` (docs/pricing.md). ``--source FILE`` converts a local table instead.

How LiteLLM's fields map (the rules of its own cost calculator, at this version):
- ``input_cost_per_token``, ``output_cost_per_token``: the base prices (absent: 0);
- ``cache_read_input_token_cost`` / ``cache_creation_input_token_cost``: cached input and cache
  write (absent: the input price of the same tier);
- ``output_cost_per_reasoning_token``: reasoning (absent: the output price of the same tier);
- ``<price>_above_<N>[k]_tokens``: a tier for prompts of more than N tokens (xAI: N or more); a
  price the tier does not name stays the one of the tier below;
- ``tiered_pricing`` (a list of ``{range: [start, end], ...}``): a tier for prompts of more than
  ``start`` tokens; a tier without an output price keeps the model's.
Batch, priority, flex and other service-tier prices, per-second, per-character, per-image and
audio prices are left out: the gateway meters tokens of standard requests.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gateway.pricing.table import COLUMNS, TABLE_FORMAT, UNIT
from gateway.pricing.units import MAX_NUSD_PER_MILLION, usd_per_token_to_nusd_per_million

LITELLM_VERSION = "1.109.3"
LITELLM_SHA256 = "f19922250764a755b43068310c93b898a58bb5601f5a5664cd0e0e2e932c7a5d"  # of the JSON below
SOURCE_MEMBER = "litellm/model_prices_and_context_window_backup.json"
# One wheel, whatever machine regenerates: the table is the same in every wheel of a release.
WHEEL_PLATFORM = ("--platform", "manylinux_2_28_x86_64", "--python-version", "3.11", "--implementation", "cp")
MODES = frozenset({"chat", "completion", "responses", "embedding"})
INCLUSIVE_THRESHOLD_PROVIDERS = frozenset({"xai"})  # bill the higher tier from N tokens, not N + 1

DATA_DIR = Path(__file__).resolve().parent / "data"

_BASE_KEYS = ("input_cost_per_token", "output_cost_per_token", "cache_read_input_token_cost",
              "cache_creation_input_token_cost")
_ABOVE = re.compile(rf"^({'|'.join(_BASE_KEYS)})_above_(\d+)(k?)_tokens$")


class SourceError(Exception):
    """The source table cannot be used (download failed, checksum differs, not a price table)."""


# --------------------------------------------------------------------------- conversion (pure)


def _price(value: Any) -> int | None:
    """A LiteLLM per-token USD price -> nano-USD per million tokens; None when absent or unusable."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        converted = usd_per_token_to_nusd_per_million(value)
    except ValueError:
        return None
    return converted if converted <= MAX_NUSD_PER_MILLION else None


def _row(start: int, input_: int, output: int, cached: int | None, write: int | None, reasoning: int | None) -> list[int]:
    return [start, input_, output, input_ if cached is None else cached, input_ if write is None else write,
            output if reasoning is None else reasoning]


def _above_tiers(entry: Mapping[str, Any]) -> list[list[int]]:
    """The ``*_above_<N>_tokens`` tiers, each resolved on the one below it (LiteLLM's rule)."""
    thresholds: dict[int, dict[str, int]] = {}
    for key, value in entry.items():
        match = _ABOVE.match(key)
        price = _price(value) if match else None
        if match and price is not None:
            tokens = int(match.group(2)) * (1000 if match.group(3) else 1)
            thresholds.setdefault(tokens, {})[match.group(1)] = price
    if not thresholds:
        return []
    inclusive = entry.get("litellm_provider") in INCLUSIVE_THRESHOLD_PROVIDERS
    prices = {key: _price(entry.get(key)) for key in _BASE_KEYS}
    reasoning = _price(entry.get("output_cost_per_reasoning_token"))
    rows = []
    for tokens in sorted(thresholds):
        prices |= thresholds[tokens]
        rows.append(_row(tokens if inclusive else tokens + 1, prices["input_cost_per_token"] or 0,
                         prices["output_cost_per_token"] or 0, prices["cache_read_input_token_cost"],
                         prices["cache_creation_input_token_cost"], reasoning))
    return rows


def _ranged_tiers(entry: Mapping[str, Any]) -> list[list[int]] | None:
    """``tiered_pricing`` as rows (the first from 0), or None when it is absent or unusable."""
    tiers = entry.get("tiered_pricing")
    if not isinstance(tiers, list) or not tiers:
        return None
    ranged = []
    for tier in tiers:
        bounds = tier.get("range") if isinstance(tier, dict) else None
        if not (isinstance(bounds, list) and len(bounds) == 2 and all(isinstance(b, int | float) for b in bounds)):
            return None
        input_ = _price(tier.get("input_cost_per_token"))
        if input_ is None:
            return None
        ranged.append((bounds[0], input_, tier))
    model_output = _price(entry.get("output_cost_per_token")) or 0
    rows = []
    for index, (start, input_, tier) in enumerate(sorted(ranged, key=lambda item: item[0])):
        output = _price(tier.get("output_cost_per_token"))
        output = model_output if output is None else output
        rows.append(_row(0 if index == 0 else int(start) + 1, input_, output,
                         _price(tier.get("cache_read_input_token_cost")),
                         _price(tier.get("cache_creation_input_token_cost")),
                         _price(tier.get("output_cost_per_reasoning_token"))))
    return rows


def convert_entry(entry: Mapping[str, Any]) -> list[list[int]] | None:
    """One LiteLLM model entry -> its rows, or None when it is not a token-priced model we meter."""
    if entry.get("mode") not in MODES:
        return None
    ranged = _ranged_tiers(entry)
    if ranged is not None:
        rows = ranged
    else:
        input_, output = _price(entry.get("input_cost_per_token")), _price(entry.get("output_cost_per_token"))
        if input_ is None and output is None:
            return None  # priced per second, character or image, or not at all
        base = _row(0, input_ or 0, output or 0, _price(entry.get("cache_read_input_token_cost")),
                    _price(entry.get("cache_creation_input_token_cost")),
                    _price(entry.get("output_cost_per_reasoning_token")))
        rows = [base, *_above_tiers(entry)]
    kept = [rows[0]]
    for row in rows[1:]:  # a tier that changes no price is no tier
        if row[1:] != kept[-1][1:] and row[0] > kept[-1][0]:
            kept.append(row)
    return kept


def convert(source: Mapping[str, Any]) -> dict[str, list[list[int]]]:
    """A LiteLLM price table -> the rows of every model we keep, sorted by name."""
    models = {}
    for name, entry in source.items():
        if name == "sample_spec" or not isinstance(entry, dict):
            continue
        rows = convert_entry(entry)
        if rows is not None:
            models[name] = rows
    return dict(sorted(models.items()))


def render(models: Mapping[str, list[list[int]]], version: str, sha256: str) -> str:
    """The price file: a header, then one model per line."""
    header = {
        "format": TABLE_FORMAT,
        "source": f"LiteLLM {SOURCE_MEMBER} (https://github.com/BerriAI/litellm), MIT license",
        "source_version": version,
        "source_sha256": sha256,
        "license": "MIT, Copyright (c) 2023 Berri AI: see NOTICE beside this file",
        "unit": UNIT,
        "columns": COLUMNS,
    }
    lines = [f"  {json.dumps(key)}: {json.dumps(value)}," for key, value in header.items()]
    body = ",\n".join(f"    {json.dumps(name)}: {json.dumps(rows, separators=(',', ':'))}"
                      for name, rows in models.items())
    return "{\n" + "\n".join(lines) + '\n  "models": {\n' + body + "\n  }\n}\n"


def notice(version: str, sha256: str, license_text: str) -> str:
    return (
        "The prices in prices.json are derived from LiteLLM's price table,\n"
        f"{SOURCE_MEMBER} of litellm {version}\n"
        f"(SHA-256 {sha256}), converted by gateway/pricing/generate.py.\n"
        "LiteLLM is distributed under the following license:\n\n" + license_text.strip() + "\n"
    )


# --------------------------------------------------------------------------- I/O


def download(version: str, into: Path) -> Path:
    """The pinned litellm wheel, downloaded (not installed) into ``into``."""
    command = [sys.executable, "-m", "pip", "download", f"litellm=={version}", "--no-deps",
               "--only-binary=:all:", *WHEEL_PLATFORM, "--dest", str(into), "--quiet"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(into.glob("litellm-*.whl"))
    if result.returncode != 0 or not wheels:
        raise SourceError(f"pip download litellm=={version} failed: {result.stderr.strip()[-2000:]}")
    return wheels[0]


def read_archive(path: Path) -> tuple[bytes, str]:
    """(the price table, the license text) from a litellm wheel or sdist."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            table = _member(names, lambda n: n.endswith(SOURCE_MEMBER))
            license_ = _member(names, lambda n: ".dist-info/" in n and n.rsplit("/", 1)[-1] == "LICENSE")
            return archive.read(table), archive.read(license_).decode()
    with tarfile.open(path) as archive:
        names = archive.getnames()
        table = _member(names, lambda n: n.endswith(SOURCE_MEMBER) and n.count("/") == 2)
        license_ = _member(names, lambda n: n.count("/") == 1 and n.endswith("/LICENSE"))
        return _extract(archive, table), _extract(archive, license_).decode()


def _member(names: list[str], wanted: Any) -> str:
    found = [name for name in names if wanted(name)]
    if not found:
        raise SourceError("the archive holds no price table or no LICENSE")
    return found[0]


def _extract(archive: tarfile.TarFile, name: str) -> bytes:
    handle = archive.extractfile(name)
    if handle is None:
        raise SourceError(f"{name} is not a file")
    return handle.read()


def generate(table: bytes, license_text: str, version: str, out: Path, expected_sha256: str | None) -> int:
    """Convert ``table`` and write the data files into ``out``; the number of models kept."""
    sha256 = hashlib.sha256(table).hexdigest()
    if expected_sha256 is not None and sha256 != expected_sha256:
        raise SourceError(f"litellm {version}: the price table's SHA-256 is {sha256}, the pin is {expected_sha256}; "
                          "review that release, then set LITELLM_SHA256")
    try:
        source = json.load(io.BytesIO(table))
    except ValueError as exc:
        raise SourceError(f"not a JSON price table: {exc}") from None
    if not isinstance(source, dict):
        raise SourceError("not a JSON price table: the top level must be an object")
    models = convert(source)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prices.json").write_text(render(models, version, sha256))
    (out / "NOTICE").write_text(notice(version, sha256, license_text))
    return len(models)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.pricing.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, help="a local LiteLLM price table (JSON) instead of the pinned wheel")
    parser.add_argument("--source-version", default="local", help="what to record as its version (with --source)")
    parser.add_argument("--license", type=Path, help="the license text to record (with --source)")
    parser.add_argument("--out", type=Path, default=DATA_DIR, help="where to write prices.json and NOTICE")
    args = parser.parse_args(argv)
    try:
        if args.source is not None:
            table, version, expected = args.source.read_bytes(), args.source_version, None
            license_text = args.license.read_text() if args.license else "(license not recorded)"
        else:
            with tempfile.TemporaryDirectory(prefix="gridgate-prices-") as tmp:
                table, license_text = read_archive(download(LITELLM_VERSION, Path(tmp)))
            version, expected = LITELLM_VERSION, LITELLM_SHA256
        count = generate(table, license_text, version, args.out, expected)
    except (OSError, SourceError) as exc:
        print(f"prices: {exc}", file=sys.stderr)
        return 1
    print(f"prices: {count} models from litellm {version} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
