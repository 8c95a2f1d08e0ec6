"""Gate loop over loopback: authorize+commit pairs per second with 32 concurrent clients,
uncontended (one principal and account per client) and contended (all clients on one shared
account), p50/p99 of each call, and in the same run the HTTP limit: GET /healthz (no auth, no
body, no writer) on the same server with the same client.

    python bench/gate.py [--pairs 20000] [--clients 32]

The server runs with its default HTTP workers (the usable cores), or TOLLGATE_WORKERS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from api.auth import sign_headers  # noqa: E402
from bench.loopback import Connection, percentile, run, start_server  # noqa: E402
from tests.catalog_builder import CatalogBuilder  # noqa: E402


def bench_catalog(clients: int) -> Path:
    """A catalog file: one prepaid account per client (principal solo-<i>) and one shared by
    all (principals shared-<i>), each funded for any run, over the feature api.search."""
    jan = "2026-01-01T00:00:00Z"
    catalog = (CatalogBuilder("acme")
               .family("api")
               .meter("api.calls", "request")
               .feature("api.search", "api.calls", family="api")
               .price("api.calls", 2000, jan, unit_quantity_minor=1))
    for i in range(clients):
        catalog.account(f"acct_{i}", "prepaid", principals=[f"solo-{i}"])
        catalog.grant(f"acct_{i}", f"bench-{i}", 9_000_000_000_000_000, jan)
    catalog.account("acct_shared", "prepaid", principals=[f"shared-{i}" for i in range(clients)])
    catalog.grant("acct_shared", "bench-shared", 9_000_000_000_000_000, jan)
    path = Path(tempfile.mkdtemp(prefix="tollgate-gate-")) / "catalog.toml"
    path.write_text(catalog.toml())
    return path


async def run_pairs(server, principals: list[str], pairs: int) -> tuple[float, list[float], list[float]]:
    remaining = [pairs]
    auth_lat: list[float] = []
    commit_lat: list[float] = []

    def signed(path: str, body: bytes, principal: str) -> dict[str, str]:
        return sign_headers(key_id=server.key_id, secret=server.secret, method="POST", path=path, body=body,
                            realm="acme", principal_id=principal)

    async def worker(principal: str) -> None:
        conn = await Connection.open(server.port)
        auth_body = json.dumps({"feature_code": "api.search", "estimated_quantity_minor": "3"}).encode()
        while remaining[0] > 0:
            remaining[0] -= 1
            t0 = time.perf_counter()
            status, reply = await conn.request("POST", "/mgt/v1/gate/authorize",
                                               signed("/mgt/v1/gate/authorize", auth_body, principal), auth_body)
            t1 = time.perf_counter()
            assert status == 200, reply[:300]
            token = json.loads(reply)["data"]["lease_token"]
            body = json.dumps({"lease_token": token, "feature_code": "api.search", "quantity_minor": "2"}).encode()
            status, reply = await conn.request("POST", "/mgt/v1/gate/commits",
                                               signed("/mgt/v1/gate/commits", body, principal), body)
            t2 = time.perf_counter()
            assert status == 200, reply[:300]
            auth_lat.append(t1 - t0)
            commit_lat.append(t2 - t1)
        conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(p) for p in principals))
    return time.perf_counter() - t0, sorted(auth_lat), sorted(commit_lat)


async def run_hello(server, clients: int, requests: int) -> float:
    remaining = [requests]

    async def worker() -> None:
        conn = await Connection.open(server.port)
        while remaining[0] > 0:
            remaining[0] -= 1
            status, _ = await conn.request("GET", "/healthz", {}, b"")
            assert status == 200
        conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return requests / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=20000)
    parser.add_argument("--clients", type=int, default=32)
    args = parser.parse_args()
    print(f"nproc={os.cpu_count()}  python={sys.version.split()[0]}"
          f"  workers={os.environ.get('TOLLGATE_WORKERS', 'default (the usable cores)')}")
    catalog = bench_catalog(args.clients)
    server = start_server(catalog)
    shutil.rmtree(catalog.parent, ignore_errors=True)
    try:
        run(run_pairs(server, [f"solo-{i}" for i in range(args.clients)], 500))  # warm up
        hello = run(run_hello(server, args.clients, 2 * args.pairs))
        for name, principals in (("uncontended", [f"solo-{i}" for i in range(args.clients)]),
                                 ("one account", [f"shared-{i}" for i in range(args.clients)])):
            elapsed, auth, com = run(run_pairs(server, principals, args.pairs))
            print(f"{name:12}: {args.pairs / elapsed:8,.0f} pairs/s  ({args.clients} clients)  "
                  f"authorize p50 {percentile(auth, .5) * 1000:.1f} ms p99 {percentile(auth, .99) * 1000:.1f} ms  "
                  f"commit p50 {percentile(com, .5) * 1000:.1f} ms p99 {percentile(com, .99) * 1000:.1f} ms")
        print(f"HTTP limit  : {hello:8,.0f} requests/s GET /healthz, same server and client "
              f"(= {hello / 2:,.0f} pairs/s if a pair cost two bare requests)")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
