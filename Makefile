# The interpreter of a new virtualenv: a PGO/LTO build when the machine has one (deploy/pick-python.sh).
PY ?= $(shell sh deploy/pick-python.sh)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install browser run test fuzz fuzz-upstream conformance bench bench-core bench-tls bench-mtls bench-relay bench-features bench-opcodes bench-surfaces bench-scale bench-prefix lint clean wrk prices

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

run: install
	$(BIN)/python -m loadtest.demo

# The console's browser tests (tests/integration/test_console_browser.py) drive Debian's chromium through
# its chromedriver: installed here when missing, where apt-get runs as root; elsewhere this says so and
# the tests skip with the reason. Never fails.
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
		echo "browser: apt-get could not install chromium; the console's browser tests will skip"; \
	else echo "browser: no chromium and no apt-get as root; the console's browser tests will skip"; fi

# The layer contracts first (pyproject.toml [tool.importlinter]: seconds), then the suite on every core
# (pytest-xdist; --dist loadfile keeps a file's tests, and the fixtures they share, in one process).
# --no-loadscope-reorder keeps the order tests/conftest.py gives (the longest files first,
# tests/schedule.py) instead of xdist's most-tests-first, which handed the one-test 70 s file out last.
# More processes than cores (TEST_WORKERS=4 on 2) was slower on a busy machine, and flakier.
TEST_WORKERS ?= auto
test: install browser
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The codec fuzzers' long run (hypothesis profile "long" in tests/fuzz_http.py; a short, derandomized
# run is part of `make test`). More examples: make fuzz GRIDGATE_FUZZ_EXAMPLES=50000. Paste the seed of
# any failure as an @example next to the test it broke.
fuzz: install
	GRIDGATE_FUZZ=long $(BIN)/python -m pytest -q -p no:cacheprovider -o timeout=0 tests/unit/*fuzz*.py

# HTTPWookiee (reverse-proxy mode) and smuggler against gridgate and nginx, on loopback
# (docs/conformance.md). Needs HTTPWOOKIEE_DIR and SMUGGLER_DIR (checkouts) and nginx; skips, saying
# why, whatever is missing.
conformance: install
	$(BIN)/python -m loadtest.conformance

bench: install
	$(BIN)/python -m loadtest.bench

# wrk-based data-plane figures (req/s per worker core, overhead percentiles, RSS, 1,000 streams).
bench-core: install wrk
	$(BIN)/python -m loadtest.bench_core

# What HTTPS on the listener and the access log cost a worker core (req/s per core, handshakes/s).
bench-tls: install wrk
	$(BIN)/python -m loadtest.bench_tls

# What mTLS (client certificates on the listener) costs a worker core beside plain HTTPS (no wrk: it
# cannot present a certificate; loadtest/tls_load.py drives every variant).
bench-mtls: install
	$(BIN)/python -m loadtest.bench_mtls

# gridgate (1 worker, routing on) against a bare uvloop + h11 relay, one core each: worker CPU per request
# and the ratio (issue 13, target 1: >= 1.0x). The upstream is nginx if installed, else the mock provider.
bench-relay: install wrk
	$(BIN)/python -m loadtest.bench_relay

# What each feature costs a worker core against the core path: each variant measured beside the core on
# one core (paired), median of 4 rounds (issue 13, target 2: everything >= 85 %).
# Run a subset with: python -m loadtest.bench_features --variants 0,5
bench-features: install wrk
	$(BIN)/python -m loadtest.bench_features --rounds 4

# Opcodes per request of the core and the production variant: a deterministic stand-in for CPU per
# request (the same figures on any machine), to rank Python-level changes the wall-clock bench cannot see.
bench-opcodes: install wrk
	$(BIN)/python -m loadtest.bench_opcodes --variants 0,7

# What a Responses or Messages request costs a worker against a chat completion (issue 25, item 6): one
# production-like gateway (auth, token quota, access log), each surface plain and streamed, 4 rounds.
bench-surfaces: install wrk
	$(BIN)/python -m loadtest.bench_surfaces --rounds 4

# How req/s scale with gateway workers (1, 2, 4 ... the cores, at most 16), with and without a token quota:
# efficiency against one worker, and the shm counters, affinity and Valkey calls each window saw.
# Choose the counts with: python -m loadtest.bench_scale --workers 1,2
bench-scale: install wrk
	$(BIN)/python -m loadtest.bench_scale

# Prefix affinity against round robin over three mock providers with prompt caches (issue 43): cached-input
# share, cost per 1,000 requests, first-token latency; the figure in docs/benchmarks/prefix-affinity.svg.
bench-prefix: install
	$(BIN)/python -m loadtest.bench_prefix --plot docs/benchmarks/prefix-affinity.svg

# The upstream response parser's fuzzer, long and random (make test runs a short derandomized pass);
# FUZZ_EXAMPLES=N sets the examples per property (default 20000).
fuzz-upstream: install
	HYPOTHESIS_PROFILE=fuzz $(BIN)/python -m pytest -q -p no:cacheprovider --timeout=0 tests/unit/test_client_codec_fuzz.py

lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache

# Regenerates gateway/pricing/data/ (the price table and its notice) from the LiteLLM release pinned in
# gateway/pricing/generate.py: downloads that one wheel, installs and runs none of it (docs/pricing.md).
# The result is committed; tests and CI never download.
prices: install
	$(BIN)/python -m gateway.pricing.generate

clean:
	rm -rf $(VENV) build *.egg-info

# The wrk benches install wrk when it is missing (Debian/Ubuntu).
wrk:
	command -v wrk >/dev/null || (apt-get update -qq && apt-get install -y -qq wrk)
