"""What each feature costs on the request path, measured in one run (ratios, not absolute figures).

    python -m loadtest.bench_features [--method paired|sequential] [--rounds 4] [--duration 8]
        [--connections 32] [--variants 0,4,lease]

Gateway workers pinned to core 0; wrk, the mock providers and the embedded Valkey on core 1. Variants
of loadtest/configs/bench.yaml (`VARIANTS`): the routing core only (the access log off too), + health
checks and outlier detection, + session affinity, + auth and token quota with every request decided in
Valkey (embedded Valkey, `quota.lease: null`), + the access log (to a file), everything that way, everything
with the default worker-held blocks, and the production config of docs/limits.md (auth, a request limit
and token budgets, the access log to a file, session affinity; defaults otherwise), and that config with a
hard USD budget on a priced model (docs/pricing.md), on a managed key, and with the response cache
(docs/cache.md) at a 0 % hit rate and with every request a hit (loadtest/configs/wrk_cache.lua). For each: the
worker's CPU time per request and "vs core" = core's CPU per
request / the variant's; req/s (32 connections); the gateway overhead p50/p99 at one connection
(``x-gridgate-overhead-ms``). CPU per request, not req/s: with quota on, the load core also runs
Valkey's Lua ledger for every request and saturates first, which says nothing about the gateway.

This shared 2-core machine changes speed from minute to minute (the core variant alone measured
135..175 µs per request minutes apart): a ratio of two runs made one after the other spreads by
+-6-10 %. Both methods run `--rounds` rounds (mocks up throughout; every gateway a process of its own:
start, ready, 1 s settle, 2 s warm-up, the measured wrk run, stop; variants in order in odd rounds and
reversed in even ones, `round_order`) and take the ratio within a round:

- `paired` (default): each variant runs AT THE SAME TIME as the core. Two gateways of one worker, both
  on core 0 (about half of it each), the core on bench.yaml's ports and the variant on listen + 100,
  admin + 10 (`PARTNER_PORT_OFFSETS`), each warmed up and then measured by its own wrk, the two started
  together with the same connections and duration; each worker's CPU is read over that one window, so
  a change of machine speed hits both alike (per-round ratios spread by about +-1.5 %). The core starts
  first in odd rounds, the variant in even ones. Absolute CPU per request and req/s are then
  two-gateways-per-core figures (higher than alone: context switches), so only the ratio is the
  result. The overhead at one connection wants the core to itself: after the last round each variant,
  the core included, runs once more alone for it. Checked for bias: the core beside a second copy
  of itself reads 100.0 % (99.0..100.5 over 3 rounds), and back to back with the sequential method,
  everything with leases read 84.4 % and 85.4 % paired against 79.8 % and 90.6 % sequential.
- `sequential`: every variant alone, one after the other; the overhead run in the last round. Its
  absolute figures are one gateway per core, but its ratios spread by +-6-10 % (one run's rounds
  ranged from 79 % to 106 % for one variant).

Reported per variant: the median over rounds of the per-round ratios with their min..max (the spread
that is left), and the medians of CPU µs per request and req/s. `--variants` picks a subset (indexes
or name substrings; the core always runs). Every variant's config is first checked by the gateway's
own parser, so a variant the gateway does not support yet fails at once, naming the field.

Prints a markdown table and writes loadtest/reports/bench-features-<time>.{json,md}; the JSON records
the method and every run's raw wrk figures and worker CPU per request (paired: each of the core's runs
names the variant beside it). Gateway logs: loadtest/reports/gateway-bench-variant-<N>.log.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import Any

from gateway.config import load_config
from gateway.identity.auth import hash_api_key
from gateway.yaml_config import ConfigError
from loadtest.bench_core import run_wrk
from loadtest.feature_report import Figures, render, summarize_paired, summarize_rounds
from loadtest.report import child_pids, process_cpu_s, run_bench, write_report
from loadtest.topology import (
    BENCH_CONFIG,
    CHAT_PATH,
    GatewayProcess,
    Topology,
    pin_self,
    raise_fd_limit,
    split_cores,
    start_mocks,
    stop_all,
    write_derived_config,
)

HERE = os.path.dirname(os.path.abspath(__file__))
WRK_FEATURES = os.path.join(HERE, "configs", "wrk_features.lua")
WRK_CACHE = os.path.join(HERE, "configs", "wrk_cache.lua")  # the cache variants' requests (CACHE_MODE)
BENCH_KEY = "sk-bench"
BENCH_ISSUER = "https://idp.bench.invalid"  # the JWT variants' issuer (its keys in a file: no IdP is called)
JWT_TOKEN_FILE = "jwt-%s.token"  # beside the variant's config, by algorithm (the variants share a directory)
BENCH_ADMIN_TOKEN = "bench-admin-token"  # the managed-key variant's admin token (keys:write)
WARM_UP_S = 2
METHODS = ("paired", "sequential")
# Paired mode: the variant listens beside the core gateway on the core's (listen, admin) ports + these.
PARTNER_PORT_OFFSETS = (100, 10)

FAST_HEALTH = {"type": "http", "path": "/health", "interval": "1s", "timeout": "500ms"}
# Every metered request decided in Valkey (worker-held blocks off): the exact path's cost.
QUOTA_EXACT = None
# The production variant's request limit: far above what the bench sends, so it never refuses, but checked
# and taken (in blocks) like any other.
PRODUCTION_REQUESTS = {"window": "1m", "count": 50_000_000}
# Its USD budget (the spend variant): a day's hard budget it never nears, on the bench model priced as gpt-4o.
PRODUCTION_SPEND = {"usd": 1_000_000, "period": "1d", "enforce": "hard"}
PRODUCTION_PRICES = {"input": "2.50", "output": "10.00"}

Address = tuple[str, int]


# --------------------------------------------------------------------------------------------------
# The variants: config changes to loadtest/configs/bench.yaml


Feature = Callable[[dict[str, Any], str], None]  # (config, work directory)


def _health(config: dict[str, Any], _work_dir: str) -> None:
    for cluster in config["clusters"]:
        cluster["health_check"] = dict(FAST_HEALTH)
        cluster["outlier_detection"] = {"consecutive_failures": 5, "base_ejection": "30s"}


def _affinity(config: dict[str, Any], _work_dir: str) -> None:
    config["routing"]["session_affinity"] = {"enabled": True, "header": "X-Session-Id", "ttl": "1h"}


def _quota(config: dict[str, Any], work_dir: str) -> None:
    config["auth"] = {"keys": [{"tenant": "bench", "key": hash_api_key(BENCH_KEY), "alias": "bench"}]}
    config["quota"] = {
        "backend": {"kind": "embedded", "data_dir": os.path.join(work_dir, "valkey")},
        "rules": [{"name": "bench", "match": {"tenant": "bench"},
                   "budgets": [{"window": "1m", "tokens": 10**12}, {"window": "1d", "tokens": 10**13}]}],
    }


def _exact(config: dict[str, Any], _work_dir: str) -> None:
    config["quota"]["lease"] = QUOTA_EXACT


def _request_limit(config: dict[str, Any], _work_dir: str) -> None:
    config["quota"]["rules"][0]["requests"] = [dict(PRODUCTION_REQUESTS)]


def _spend(config: dict[str, Any], _work_dir: str) -> None:
    # A hard USD budget far above what the bench spends, on a priced model: every request reserves its worst
    # case and settles its real cost (in blocks, as tokens are), in the same ledger call (docs/limits.md).
    config["pricing"] = {"overrides": {"demo-model": dict(PRODUCTION_PRICES)}}
    config["quota"]["rules"][0]["spend"] = [dict(PRODUCTION_SPEND)]


def _access_log(config: dict[str, Any], work_dir: str) -> None:
    # A regular file, as on a host that logs to disk (one variant with a log runs at a time).
    config["access_log"] = {"enabled": True, "path": os.path.join(work_dir, "access.log")}


def _managed_key(config: dict[str, Any], _work_dir: str) -> None:
    # Its requests on a managed key (made with the admin API once the gateway serves: ``running``) instead
    # of the YAML key: the host key table's lookup, and the key's own worker-held blocks.
    config.setdefault("admin", {})["tokens"] = [{"name": "bench", "key": hash_api_key(BENCH_ADMIN_TOKEN),
                                                "scopes": ["keys:write"]}]


def _cache(config: dict[str, Any], _work_dir: str) -> None:
    # The response cache (docs/cache.md) in the quota's embedded Valkey; wrk_cache.lua makes the requests
    # cacheable (temperature 0): each new (0 % hits) or each the same (hits), by the variant (CACHE_SCRIPTS).
    config["cache"] = {"enabled": True}


def _prefix(config: dict[str, Any], _work_dir: str) -> None:
    # Prefix affinity (docs/routing.md): a hash of each request's prompt prefix, its placement; sessions
    # bound already keep their provider (session affinity wins), so the hash is the cost of most requests.
    config["routing"]["prefix_affinity"] = {"enabled": True}


def _jwt(alg: str) -> Feature:
    """Requests identified by a JWT (docs/identity.md) signed with a key of ``alg`` made here: the issuer's
    JWKS in a file beside the config, and one token (a client reusing its token: the verified-token cache)
    that wrk sends instead of the API key (``wrk_script_for``)."""

    def feature(config: dict[str, Any], work_dir: str) -> None:
        import jwt as pyjwt  # the bench's JWT variants only
        from cryptography.hazmat.primitives.asymmetric import ec, rsa
        from jwt.algorithms import ECAlgorithm, RSAAlgorithm

        if alg == "RS256":
            private: Any = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            jwk = RSAAlgorithm.to_jwk(private.public_key(), as_dict=True)
        else:
            private = ec.generate_private_key(ec.SECP256R1())
            jwk = ECAlgorithm.to_jwk(private.public_key(), as_dict=True)
        jwk.update({"kid": "bench-1", "use": "sig", "alg": alg})
        with open(os.path.join(work_dir, f"jwks-{alg}.json"), "w") as out:
            json.dump({"keys": [jwk]}, out)
        now = int(time.time())
        token = pyjwt.encode({"iss": BENCH_ISSUER, "aud": "gridgate-bench", "sub": "bench-client", "org": "bench",
                              "iat": now, "exp": now + 86400}, private, algorithm=alg, headers={"kid": "bench-1"})
        with open(os.path.join(work_dir, JWT_TOKEN_FILE % alg), "w") as out:
            out.write(token)
        config["auth"]["jwt"] = [{"name": "bench", "issuer": BENCH_ISSUER, "audience": ["gridgate-bench"],
                                  "jwks_file": f"jwks-{alg}.json", "algorithms": [alg], "tenant_claim": "org"}]

    return feature


LONG_KEY = "sk-" + "x" * 697  # an RS256 JWT's length, for the header-size control variant


def _long_key(config: dict[str, Any], _work_dir: str) -> None:
    # The JWT variants' control: an opaque API key as long as an RS256 token (what the header's size costs).
    config["auth"]["keys"][0]["key"] = hash_api_key(LONG_KEY)


def _console(config: dict[str, Any], _work_dir: str) -> None:
    # The console on (docs/console.md): with admin tokens every worker keeps the ring of its last requests.
    config.setdefault("admin", {})["tokens"] = [{"name": "bench-console", "key": hash_api_key(BENCH_ADMIN_TOKEN)}]


def _core(config: dict[str, Any], _work_dir: str) -> None:
    # The access log is on by default: the core path goes without it, "everything" has it (issue 13).
    config["access_log"] = {"enabled": False}


CORE = 0  # the reference of every "vs core" ratio
VARIANTS: tuple[tuple[str, tuple[Feature, ...]], ...] = (
    ("core (auth, quota, health, access log off)", ()),
    ("+ health checks + outlier detection", (_health,)),
    ("+ session affinity", (_affinity,)),
    ("+ auth + token quota, exact (a Valkey call per request)", (_quota, _exact)),
    ("+ access log", (_access_log,)),
    ("everything, exact quota", (_health, _affinity, _quota, _exact, _access_log)),
    ("everything, quota leases (the default)", (_health, _affinity, _quota, _access_log)),
    # docs/limits.md's production config: the defaults, with a request limit beside the token budgets.
    ("production: auth + request limit + token budgets + access log + sessions, defaults",
     (_affinity, _quota, _request_limit, _access_log)),
    ("production + a hard USD budget (a priced model)", (_affinity, _quota, _request_limit, _access_log, _spend)),
    ("production on a managed key", (_affinity, _quota, _request_limit, _access_log, _managed_key)),
    ("production + response cache, 0 % hits (each request new: a GET and a SET)",
     (_affinity, _quota, _request_limit, _access_log, _cache)),
    ("production + response cache, every request a hit (no provider)",
     (_affinity, _quota, _request_limit, _access_log, _cache)),
    ("production on a JWT, RS256 (a client reusing its token)",
     (_affinity, _quota, _request_limit, _access_log, _jwt("RS256"))),
    ("production on a JWT, ES256 (a client reusing its token)",
     (_affinity, _quota, _request_limit, _access_log, _jwt("ES256"))),
    ("production + routing by prompt prefix",
     (_affinity, _quota, _request_limit, _access_log, _prefix)),
    ("+ the console (admin tokens: the ring of the last requests)", (_console,)),
    ("production on a 700-byte API key (the JWT variants' header-size control)",
     (_affinity, _quota, _request_limit, _access_log, _long_key)),
)
# The cache variants' wrk mode (wrk_cache.lua's CACHE_MODE), by variant index.
CACHE_SCRIPTS = {index: "misses" if "0 % hits" in name else "hits"
                 for index, (name, _) in enumerate(VARIANTS) if "response cache" in name}
VARIANT_NAMES = tuple(name for name, _ in VARIANTS)


def select_variants(spec: str | None, names: Sequence[str] = VARIANT_NAMES) -> list[int]:
    """The indexes `spec` names, in variant order and always with CORE; all of them for None.

    `spec` is comma-separated indexes or case-insensitive substrings of names ("lease", "4,affinity").
    """
    if spec is None:
        return list(range(len(names)))
    chosen = {CORE}
    for token in (part.strip() for part in spec.split(",")):
        if token.isdigit():
            if int(token) >= len(names):
                raise ValueError(f"no variant {token}: there are {len(names)} (0-{len(names) - 1})")
            chosen.add(int(token))
        elif token:
            matches = {index for index, name in enumerate(names) if token.lower() in name.lower()}
            if not matches:
                raise ValueError(f"no variant name contains {token!r}")
            chosen |= matches
    return sorted(chosen)


def partner_addresses(topology: Topology, offsets: tuple[int, int] = PARTNER_PORT_OFFSETS) -> tuple[Address, Address]:
    """(listen, admin) of a variant running beside `topology`'s gateway in paired mode: its ports + `offsets`.

    Refused (ValueError) when a derived port is out of range, the same for both, or one `topology`
    itself uses (its listen and admin ports, its provider endpoints, which the mocks hold).
    """
    listen = (topology.listen[0], topology.listen[1] + offsets[0])
    admin = (topology.admin[0], topology.admin[1] + offsets[1])
    taken = {topology.listen[1], topology.admin[1], *(port for _, _, port in topology.endpoints)}
    if listen[1] == admin[1] or any(port in taken or not 0 < port < 65536 for port in (listen[1], admin[1])):
        raise ValueError(f"paired mode would put a variant on listen port {listen[1]} and admin port {admin[1]}, "
                         f"which clash with each other, with {topology.config_path} or the port range: "
                         "change PARTNER_PORT_OFFSETS")
    return listen, admin


def derived_config(index: int, work_dir: str, addresses: tuple[Address, Address] | None = None) -> str:
    """Write variant `index`'s config (on `addresses` = (listen, admin) if given), checked by the gateway's
    own parser; its path."""
    name, features = VARIANTS[index]

    def change(config: dict[str, Any]) -> None:
        for feature in (_core, *features):
            feature(config, work_dir)
        if addresses is not None:
            (listen_host, listen_port), (admin_host, admin_port) = addresses
            config["listen"] = f"{listen_host}:{listen_port}"
            config["admin"] = {**config.get("admin", {}), "listen": f"{admin_host}:{admin_port}"}

    path = write_derived_config(BENCH_CONFIG, work_dir, f"variant-{index}", change)
    try:
        load_config(path)
    except ConfigError as exc:
        raise RuntimeError(f"variant {index} ({name}): the gateway refuses its config: {'; '.join(exc.problems)} "
                           "(run the others with --variants)") from None
    return path


def variant_configs(indexes: Sequence[int], method: str, work_dir: str) -> dict[int, str]:
    """Every selected variant's config path; in paired mode the non-core ones listen beside the core."""
    partner = None
    if method == "paired":
        try:
            partner = partner_addresses(Topology.from_config(BENCH_CONFIG))
        except ValueError as exc:
            raise RuntimeError(str(exc)) from None
    return {index: derived_config(index, work_dir, None if index == CORE else partner) for index in indexes}


def round_order(round_number: int, items: Sequence[int]) -> list[int]:
    """`items` in order in odd rounds, reversed in even ones (rounds count from 1).

    A place in a round (the first after the mocks idled, the last before the next round; in a pair,
    the gateway started first) then weighs on every item alike.
    """
    return list(items) if round_number % 2 else list(reversed(items))


# --------------------------------------------------------------------------------------------------
# Measuring


def pin_valkey(supervisor_pid: int, cpus: set[int] | None) -> None:
    """The embedded Valkey stands in for a remote server: keep it off the measured worker's core."""
    if not cpus:
        return
    for pid in child_pids(supervisor_pid):
        try:
            with open(f"/proc/{pid}/comm") as comm:
                if "valkey" in comm.read():
                    os.sched_setaffinity(pid, cpus)
        except OSError:
            continue


def gateway_url(gateway: GatewayProcess) -> str:
    host, port = gateway.topology.listen
    return f"http://{host}:{port}{CHAT_PATH}"


@contextmanager
def running(config_paths: Sequence[str], gateway_cpus: set[int] | None,
            load_cpus: set[int] | None) -> Iterator[list[GatewayProcess]]:
    """Gateways of one worker each, started in the given order without waiting for one another and all
    pinned to `gateway_cpus`; yielded ready, their embedded Valkey moved to `load_cpus`, after 1 s to
    settle. Stopped on leaving."""
    with ExitStack() as stack:
        gateways = []
        for path in config_paths:
            name = os.path.splitext(os.path.basename(path))[0]
            gateway = GatewayProcess(Topology.from_config(path), 1, gateway_cpus, log_name=f"gateway-bench-{name}.log")
            stack.callback(gateway.stop)
            gateways.append(gateway)
        for gateway, path in zip(gateways, config_paths, strict=True):
            gateway.wait_ready()
            pin_valkey(gateway.process.pid, load_cpus)
            gateway.wrk_script = wrk_script_for(gateway, path)  # type: ignore[attr-defined]
        time.sleep(1.0)
        yield gateways


def wrk_script_for(gateway: GatewayProcess, config_path: str) -> str:
    """wrk's script for the (ready) gateway of ``config_path``: the shared one, for a cache variant its
    mode of wrk_cache.lua, or for the managed-key variant (a config with an admin token that writes keys) a copy sending a
    managed key made for it."""
    name = os.path.splitext(os.path.basename(config_path))[0]
    mode = CACHE_SCRIPTS.get(int(name.removeprefix("variant-"))) if name.startswith("variant-") else None
    if mode is not None:
        return cache_script(mode, os.path.dirname(config_path), gateway.topology.listen[1])
    config = load_config(config_path)
    if config.auth is not None and config.auth.keys and config.auth.keys[0].key == hash_api_key(LONG_KEY):
        return long_key_script(os.path.dirname(config_path), gateway.topology.listen[1])
    if config.auth is not None and config.auth.jwt:
        return jwt_script(os.path.dirname(config_path), gateway.topology.listen[1], config.auth.jwt[0].algorithms[0])
    if not any("keys:write" in token.scopes for token in config.admin.tokens):
        return WRK_FEATURES
    return managed_key_script(gateway, os.path.dirname(config_path))


def long_key_script(work_dir: str, port: int) -> str:
    """A copy of wrk's script sending ``LONG_KEY`` instead of the bench key."""
    with open(WRK_FEATURES) as source:
        script = source.read().replace(f"Bearer {BENCH_KEY}", f"Bearer {LONG_KEY}")
    path = os.path.join(work_dir, f"wrk-long-key-{port}.lua")
    with open(path, "w") as out:
        out.write(script)
    return path


def jwt_script(work_dir: str, port: int, alg: str) -> str:
    """A copy of wrk's script sending the JWT variant's token (``_jwt``) instead of the API key."""
    with open(os.path.join(work_dir, JWT_TOKEN_FILE % alg)) as token, open(WRK_FEATURES) as source:
        script = source.read().replace(f"Bearer {BENCH_KEY}", f"Bearer {token.read().strip()}")
    path = os.path.join(work_dir, f"wrk-jwt-{port}.lua")
    with open(path, "w") as out:
        out.write(script)
    return path


def cache_script(mode: str, work_dir: str, port: int) -> str:
    """wrk_cache.lua in ``mode`` (misses: a run id keeps one run's contents apart from the last's)."""
    with open(WRK_CACHE) as source:
        script = source.read().replace('"CACHE_MODE"', f'"{mode}"').replace("RUN_ID", f'"{os.urandom(4).hex()}"')
    path = os.path.join(work_dir, f"wrk-cache-{mode}-{port}.lua")
    with open(path, "w") as out:
        out.write(script)
    return path


def managed_key_script(gateway: GatewayProcess, work_dir: str) -> str:
    """Make a managed key of the bench tenant through the gateway's admin API; a copy of wrk's script
    sending it (written in ``work_dir``), once the key serves."""
    host, port = gateway.topology.admin
    request = urllib.request.Request(
        f"http://{host}:{port}/admin/keys", data=json.dumps({"tenant": "bench", "alias": "bench-managed"}).encode(),
        headers={"Authorization": f"Bearer {BENCH_ADMIN_TOKEN}", "Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=5) as answer:
        key = json.loads(answer.read())["key"]
    with open(WRK_FEATURES) as source:
        script = source.read().replace(f"Bearer {BENCH_KEY}", f"Bearer {key}")
    path = os.path.join(work_dir, f"wrk-managed-{port}.lua")
    with open(path, "w") as out:
        out.write(script)
    deadline = time.monotonic() + 5  # the key reaches the host table within a second (docs/keys.md)
    while time.monotonic() < deadline:
        probe = urllib.request.Request(gateway_url(gateway), data=b'{"model":"demo-model"}', method="POST",
                                       headers={"Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(probe, timeout=5):
                return path
        except urllib.error.HTTPError as refused:
            if refused.code != 401:
                return path  # the key is known: any other answer is the request's own
        time.sleep(0.05)
    raise RuntimeError(f"the managed key never served on {gateway_url(gateway)}")


def wrk_together(gateways: Sequence[GatewayProcess], connections: int, duration_s: int,
                 load_cpus: set[int] | None) -> list[dict[str, Any]]:
    """One wrk per gateway, started together (in the given order) on the load cores: their figures."""
    with ThreadPoolExecutor(len(gateways)) as pool:
        futures = [pool.submit(run_wrk, gateway_url(gateway), gateway.wrk_script, connections, duration_s,  # type: ignore[attr-defined]
                               load_cpus)
                   for gateway in gateways]
        return [future.result() for future in futures]


def cpu_s(pids: Sequence[int]) -> float:
    return sum(process_cpu_s(pid) for pid in pids)


def measure_window(gateways: Sequence[GatewayProcess], args: argparse.Namespace,
                   load_cpus: set[int] | None) -> list[dict[str, Any]]:
    """A warm-up, then the measured run, of all `gateways` at the same time: per gateway wrk's figures plus
    its worker's CPU µs per request over that one window."""
    wrk_together(gateways, args.connections, WARM_UP_S, load_cpus)
    workers = [gateway.worker_pids() for gateway in gateways]
    before = [cpu_s(pids) for pids in workers]
    runs = wrk_together(gateways, args.connections, args.duration, load_cpus)
    used = [cpu_s(pids) - cpu_before for pids, cpu_before in zip(workers, before, strict=True)]
    for gateway, run, cpu_used in zip(gateways, runs, used, strict=True):
        if not run.get("requests"):
            raise RuntimeError(f"no request completed in {args.duration} s ({run['command']}); "
                               f"see {gateway.log_path}")
        run["worker_cpu_us_per_request"] = cpu_used / run["requests"] * 1e6
    return runs


def overhead_run(gateway: GatewayProcess, args: argparse.Namespace, load_cpus: set[int] | None) -> dict[str, Any]:
    """wrk at one connection: the overhead percentiles (``x-gridgate-overhead-ms``)."""
    return run_wrk(gateway_url(gateway), gateway.wrk_script, 1, max(3, args.duration // 2), load_cpus)  # type: ignore[attr-defined]


def measure(config_paths: Sequence[str], args: argparse.Namespace, gateway_cpus: set[int] | None,
            load_cpus: set[int] | None, overhead: bool = False) -> list[dict[str, Any]]:
    """One window of the gateways for `config_paths`, run at the same time (sequential: one; paired: two),
    each in a gateway of its own: per gateway wrk's figures with the worker CPU µs per request, its
    workers' RSS, and with `overhead` the overhead run at one connection after the window (for a single
    gateway: a latency figure wants the core to itself)."""
    with running(config_paths, gateway_cpus, load_cpus) as gateways:
        runs: list[dict[str, Any]] = [{"throughput": throughput}
                                      for throughput in measure_window(gateways, args, load_cpus)]
        for gateway, run in zip(gateways, runs, strict=True):
            if overhead:
                run["overhead_1conn"] = overhead_run(gateway, args, load_cpus)
            run["rss_kib"] = gateway.rss()["workers_kib"]
        return runs


def measure_alone(config_path: str, args: argparse.Namespace, gateway_cpus: set[int] | None,
                  load_cpus: set[int] | None) -> dict[str, Any]:
    """Paired mode's latency figure: the gateway alone, warmed up, then the overhead run at one connection."""
    with running([config_path], gateway_cpus, load_cpus) as gateways:
        wrk_together(gateways, args.connections, WARM_UP_S, load_cpus)
        return {"overhead_1conn": overhead_run(gateways[0], args, load_cpus),
                "rss_kib": gateways[0].rss()["workers_kib"]}


# --------------------------------------------------------------------------------------------------
# The run


def log(message: str) -> None:
    print(f"bench_features: {message}", file=sys.stderr)


def run_sequential(configs: Mapping[int, str], args: argparse.Namespace, entries: Mapping[int, dict[str, Any]],
                   gateway_cpus: set[int] | None, load_cpus: set[int] | None) -> dict[str, dict[str, Any]]:
    """Every round runs each variant alone, one after the other; the summaries per variant name."""
    for round_number in range(1, args.rounds + 1):
        last = round_number == args.rounds
        for index in round_order(round_number, args.variants):
            log(f"round {round_number}/{args.rounds}: {VARIANTS[index][0]}")
            (measured,) = measure([configs[index]], args, gateway_cpus, load_cpus, overhead=last)
            entries[index]["runs"].append({"round": round_number, **measured})
    return summarize_rounds({entry["variant"]: [run["throughput"] for run in entry["runs"]]
                             for entry in entries.values()}, VARIANTS[CORE][0])


def run_paired(configs: Mapping[int, str], args: argparse.Namespace, entries: Mapping[int, dict[str, Any]],
               gateway_cpus: set[int] | None, load_cpus: set[int] | None) -> dict[str, dict[str, Any]]:
    """Every round runs each non-core variant at the same time as the core; then each variant alone for the
    overhead at one connection. The summaries per variant name."""
    others = [index for index in args.variants if index != CORE]
    windows: dict[str, list[tuple[Figures, Figures]]] = {VARIANTS[index][0]: [] for index in others}
    for round_number in range(1, args.rounds + 1):
        for index in round_order(round_number, others):
            order = round_order(round_number, (CORE, index))
            log(f"round {round_number}/{args.rounds}: {VARIANTS[index][0]} beside the core "
                f"({VARIANTS[order[0]][0]} started first)")
            measured = dict(zip(order, measure([configs[i] for i in order], args, gateway_cpus, load_cpus),
                                strict=True))
            for own in order:
                entries[own]["runs"].append({"round": round_number, "started_first": own == order[0],
                                             **({"paired_with": index} if own == CORE else {}), **measured[own]})
            windows[VARIANTS[index][0]].append((measured[CORE]["throughput"], measured[index]["throughput"]))
    for index in args.variants:
        log(f"alone: {VARIANTS[index][0]}, overhead at one connection")
        entries[index]["alone"] = measure_alone(configs[index], args, gateway_cpus, load_cpus)
    return summarize_paired(windows, VARIANTS[CORE][0])


def run(args: argparse.Namespace) -> int:
    if shutil.which("wrk") is None:
        print("bench_features: wrk not found on PATH; skipping (apt-get install -y wrk)")
        return 0
    gateway_cpus, load_cpus = split_cores()
    raise_fd_limit()
    pin_self(load_cpus)
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "method": args.method,
                               "rounds": args.rounds, "duration_s": args.duration, "warm_up_s": WARM_UP_S,
                               "connections": args.connections, "gateway_cpus": sorted(gateway_cpus or []),
                               "load_cpus": sorted(load_cpus or []), "quota_lease": "default",
                               "production_requests": PRODUCTION_REQUESTS, "production_spend": PRODUCTION_SPEND, "variants": []}
    work_dir = tempfile.mkdtemp(prefix="gridgate-bench-")
    try:
        configs = variant_configs(args.variants, args.method, work_dir)
        entries = {index: {"index": index, "variant": VARIANTS[index][0], "runs": []} for index in args.variants}
        mocks = start_mocks(Topology.from_config(BENCH_CONFIG), load_cpus, tokens=16, models="demo-model")
        try:
            method = run_paired if args.method == "paired" else run_sequential
            summaries = method(configs, args, entries, gateway_cpus, load_cpus)
        finally:
            stop_all(mocks)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    for entry in entries.values():
        entry["summary"] = summaries[entry["variant"]]
        results["variants"].append(entry)
    command = (f"python -m loadtest.bench_features --method {args.method} --rounds {args.rounds} "
               f"--duration {args.duration} --connections {args.connections} "
               f"--variants {','.join(map(str, args.variants))}")
    write_report("bench-features", results, f"What each feature costs on the request path ({results['started']})",
                 command, render(results, CORE))
    return 0


def main(argv: list[str] | None = None) -> int:
    listing = "; ".join(f"{index} = {name}" for index, name in enumerate(VARIANT_NAMES))
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_features", description=__doc__.split("\n")[0])
    parser.add_argument("--method", choices=METHODS, default="paired",
                        help="paired: each variant at the same time as the core (the default); "
                             "sequential: one variant after the other (noisier ratios)")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved repetitions; medians are reported")
    parser.add_argument("--duration", type=int, default=8, help="seconds per measured wrk run")
    parser.add_argument("--connections", type=int, default=32, help="per wrk (paired: per gateway)")
    parser.add_argument("--variants", metavar="LIST",
                        help=f"comma-separated indexes or name substrings (default: all; {CORE} always runs): {listing}".replace("%", "%%"))
    args = parser.parse_args(argv)
    if min(args.rounds, args.duration, args.connections) < 1:
        parser.error("--rounds, --duration and --connections must be at least 1")
    try:
        args.variants = select_variants(args.variants)
    except ValueError as exc:
        parser.error(f"--variants: {exc}; the variants are {listing}")
    if args.method == "paired" and args.variants == [CORE]:
        parser.error("--method paired measures variants beside the core: name one besides it in --variants")
    return run_bench("bench_features", run, args)


if __name__ == "__main__":
    sys.exit(main())
