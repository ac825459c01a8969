"""Managed keys, measured (docs/keys.md): revocation across hosts, and a 100,000-key load.

    .venv/bin/python -m loadtest.keys_measure propagation [--trials 100]
    .venv/bin/python -m loadtest.keys_measure load [--keys 100000]

``propagation``: one Valkey, two gateways (two supervisors with one worker each: two hosts' worth of
processes) pointed at it with ``auth.store``. Per trial: create a key on A and wait until B's table
holds it; then revoke it on A and time, from the moment A's call returned, until B's table says
revoked (B's admin page ``GET /admin/keys/{kid}`` reports its own table under ``on_this_host``; it is
polled every 2 ms). Also checks, each time A's call returns, that the kid is already in the tenant's
deny set (what the admission call refuses), and reads B's own store-write -> table-write time
(``gridgate_keys_last_propagation_seconds``).

``load``: writes N records straight into a Valkey (pipelined), then times one follower's full load
into a fresh table of capacity N in this process (the supervisor's code path), and reports the table's
sizes and this process's RSS before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import valkey
import yaml

from gateway.identity.auth import hash_api_key
from gateway.identity.keyformat import key_digest, new_key, new_kid
from gateway.keys.record import KeyRecord, encode_record
from gateway.keys.store import ALL, BY_TENANT, RECORD, KeyStore, deny_set_key
from gateway.valkey.client import BACKEND_ERRORS, create_client
from gateway.valkey.embedded import EmbeddedValkey
from loadtest.report import rss_kib
from loadtest.topology import ROOT, free_port, http_get

TOKEN = "keys-measure-admin-token"


def _call(admin: tuple[str, int], method: str, path: str, body: Any = None) -> tuple[int, Any]:
    import http.client

    connection = http.client.HTTPConnection(*admin, timeout=5)
    try:
        payload = None if body is None else json.dumps(body).encode()
        connection.request(method, path, payload, {"Authorization": f"Bearer {TOKEN}",
                                                   "Content-Type": "application/json"})
        response = connection.getresponse()
        data = response.read()
        return response.status, json.loads(data) if data else None
    finally:
        connection.close()


def _gateway(work: str, name: str, store_url: str) -> tuple[subprocess.Popen, tuple[str, int], Any]:
    overlay = os.path.join(work, "overlay.json")
    with open(overlay, "w") as out:
        json.dump({"local_site": "a", "candidates": [{"kind": "inference_model", "name": "m", "site": "a",
                                                      "cluster": "c"}]}, out)
    admin = ("127.0.0.1", free_port())
    config = {
        "listen": f"127.0.0.1:{free_port()}", "workers": 1, "admin": {
            "listen": f"{admin[0]}:{admin[1]}",
            "tokens": [{"name": name, "key": hash_api_key(TOKEN), "scopes": ["keys:read", "keys:write"]}]},
        "clusters": [{"name": "c", "endpoints": ["127.0.0.1:9"]}], "routing": {"overlay_file": overlay},
        "access_log": {"enabled": False}, "auth": {"store": {"kind": "valkey", "url": store_url}},
    }
    path = os.path.join(work, f"{name}.yaml")
    with open(path, "w") as out:
        yaml.safe_dump(config, out)
    log = open(os.path.join(work, f"{name}.log"), "wb")  # noqa: SIM115 - closed with the process
    process = subprocess.Popen([sys.executable, "-m", "gateway", "run", "-c", path], cwd=ROOT, stdout=log,
                               stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while http_get(admin, "/readyz", timeout=0.5)[0] != 200:
        if time.monotonic() > deadline or process.poll() is not None:
            raise RuntimeError(f"gateway {name} did not start; see {work}/{name}.log")
        time.sleep(0.05)
    return process, admin, log


def _host_status(admin: tuple[str, int], kid: str) -> str | None:
    status, body = _call(admin, "GET", f"/admin/keys/{kid}")
    return (body.get("on_this_host") or {}).get("status") if status == 200 else None


def _until(predicate, timeout: float = 5.0) -> float:
    started = time.perf_counter()
    while not predicate():
        if time.perf_counter() - started > timeout:
            raise RuntimeError("timed out")
        time.sleep(0.002)
    return time.perf_counter() - started


def _metric(admin: tuple[str, int], name: str) -> float:
    _, body = http_get(admin, "/metrics", timeout=2)
    match = re.search(rb"^" + name.encode() + rb" (\S+)$", body, re.M)
    return float(match.group(1)) if match else float("nan")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def propagation(trials: int) -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix="gridgate-keys-measure-")
    server = EmbeddedValkey(os.path.join(work, "valkey"), unix_socket=False)
    url = server.start()
    started: list[tuple[subprocess.Popen, Any]] = []
    direct = valkey.Valkey.from_url(url)
    try:
        a_process, a, a_log = _gateway(work, "a", url)
        started.append((a_process, a_log))
        b_process, b, b_log = _gateway(work, "b", url)
        started.append((b_process, b_log))
        seen, internal, denied = [], [], 0
        for _ in range(trials):
            _, created = _call(a, "POST", "/admin/keys", {"tenant": "measure"})
            kid = created["record"]["kid"]
            _until(lambda kid=kid: _host_status(b, kid) == "active")
            status, _ = _call(a, "POST", f"/admin/keys/{kid}/revoke")
            returned = time.perf_counter()
            denied += direct.hget(deny_set_key("measure"), kid) == b"revoked"
            _until(lambda kid=kid: _host_status(b, kid) == "revoked")
            seen.append(time.perf_counter() - returned)
            internal.append(_metric(b, "gridgate_keys_last_propagation_seconds"))
        return {
            "trials": trials,
            "revoked_in_deny_set_when_the_call_returned": f"{denied}/{trials}",
            "b_table_after_a_returned_ms": {"p50": round(statistics.median(seen) * 1000, 2),
                                            "p99": round(_percentile(seen, 0.99) * 1000, 2),
                                            "max": round(max(seen) * 1000, 2)},
            "b_store_write_to_table_ms": {"p50": round(statistics.median(internal) * 1000, 2),
                                          "p99": round(_percentile(internal, 0.99) * 1000, 2)},
            "note": "includes B's admin page round trips (polled every 2 ms)",
        }
    finally:
        direct.close()
        for process, log in started:
            process.terminate()
            process.wait(30)
            log.close()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


async def _load(url: str, count: int) -> dict[str, Any]:
    from gateway.keys.follower import KeyFollower
    from shm.keys import KeyTable, KeyTableWriter

    rss_before = rss_kib(os.getpid())
    table = KeyTable.create(count)
    writer = KeyTableWriter(table)
    follower = KeyFollower(KeyStore(create_client(url, timeout_s=30)), KeyStore(create_client(url, timeout_s=30)),
                           writer, backend_errors=BACKEND_ERRORS)
    started = time.perf_counter()
    await follower.load()
    seconds = time.perf_counter() - started
    gc.collect()
    rss_after = rss_kib(os.getpid())
    await follower.close()
    return {"keys": len(table), "load_s": round(seconds, 2), "table_mapping_bytes": table.layout.total,
            "table_index_bytes": table.layout.index_bytes(), "table_heap_bytes_used": writer.heap_used_bytes(),
            "process_rss_kib_before": rss_before, "process_rss_kib_after": rss_after}


def load(count: int) -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix="gridgate-keys-load-")
    server = EmbeddedValkey(os.path.join(work, "valkey"))
    url = server.start()
    try:
        direct = valkey.Valkey.from_url(url)
        written = time.perf_counter()
        pipe = direct.pipeline(transaction=False)
        for n in range(count):
            kid = new_kid()
            record = KeyRecord(kid=kid, tenant=f"tenant-{n % 100}", status="active",
                               digest=key_digest(new_key(kid)).hex(), created_at=1, created_by="measure",
                               updated_at=1, version=1, alias=f"svc-{n % 1000}", models=["gpt-4*", "claude-*"])
            pipe.set(RECORD + kid, encode_record(record))
            pipe.zadd(ALL, {kid: 0})
            pipe.zadd(BY_TENANT + record.tenant, {kid: 0})
            if n % 2000 == 1999:
                pipe.execute()
        pipe.execute()
        direct.close()
        result = asyncio.run(_load(url, count))
        result["write_records_s"] = round(time.perf_counter() - written - result["load_s"], 2)
        return result
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="what", required=True)
    prop = commands.add_parser("propagation")
    prop.add_argument("--trials", type=int, default=100)
    many = commands.add_parser("load")
    many.add_argument("--keys", type=int, default=100_000)
    args = parser.parse_args()
    print(json.dumps(propagation(args.trials) if args.what == "propagation" else load(args.keys), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
