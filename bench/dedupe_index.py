"""Measure the candidate stores for the event dedupe index (issue 16, docs/measurements.md).

    python bench/dedupe_index.py --store rocksdb --count 10000000 --dir /tmp/idx [--keys timed]

Inserts `count` random 16-byte ids (with a value like the index keeps: 8 bytes of
created_at and a labels object) in batches of 1,000, then times lookups of 1,000 fresh
(absent) ids and of 1,000 stored ids, at every decade of the count. Prints microseconds per
id, the process's RSS, its CPU per id inserted (user + system, the store's compaction
threads included) and the store's bytes on disk per id.

`--keys id` keys each id alone (the index's layout before 2026-11-28); `--keys timed` (the
service's layout, `warehouse.event_index.event_key`) leads each key with an occurred_at that
advances 25 us an id (40,000 events a second) and lags it by up to 2 s at random, as events
sent by several clients near their business time do. The raw limit measured in the
same run: a Python set lookup of the same ids (what the old in-memory set cost).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import time
from pathlib import Path

BATCH = 1000
VALUE_LABELS = b'{"tenant":"t-0042","region":"eu-west-1","tier":"pro"}'


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class Rocks:
    def __init__(self, path: Path, cache_mib: int) -> None:
        from warehouse.event_index import open_rocks
        self.db = open_rocks(path, cache_mib << 20)

    def insert(self, items: list[tuple[bytes, bytes]]) -> None:
        from rocksdict import WriteBatch
        wb = WriteBatch(raw_mode=True)
        for k, v in items:
            wb.put(k, v)
        self.db.write(wb)

    def lookup(self, keys: list[bytes]) -> int:
        return sum(v is not None for v in self.db.get(keys))

    def settle(self) -> float:
        """Wait for the compactions in flight (the writer looks up while they run, too:
        both figures are printed); the seconds waited."""
        began = time.perf_counter()
        while (self.db.property_int_value("rocksdb.compaction-pending")
               or self.db.property_int_value("rocksdb.num-running-compactions")):
            time.sleep(0.05)
        return time.perf_counter() - began

    def close(self) -> None:
        self.db.close()


class Lmdb:
    def __init__(self, path: Path, cache_mib: int) -> None:
        import lmdb
        path.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(str(path), map_size=1 << 40, sync=False, metasync=False,
                             readahead=False, writemap=False)

    def insert(self, items: list[tuple[bytes, bytes]]) -> None:
        with self.env.begin(write=True) as tx:
            for k, v in items:
                tx.put(k, v)

    def lookup(self, keys: list[bytes]) -> int:
        with self.env.begin() as tx:
            return sum(tx.get(k) is not None for k in keys)

    def settle(self) -> float:
        return 0.0

    def close(self) -> None:
        self.env.close()


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def make_keys(rnd: random.Random, layout: str, done: int, n: int) -> list[bytes]:
    if layout == "id":
        return [rnd.randbytes(16) for _ in range(n)]
    from warehouse.event_index import event_key
    now_us = 1_790_000_000_000_000 + done * 25
    return [event_key(now_us - rnd.randrange(2_000_000), rnd.randbytes(16)) for _ in range(n)]


def measure(store: Rocks | Lmdb, rnd: random.Random, stored: list[bytes], done: int,
            insert_s: float, path: Path, phase: str, waited: float, layout: str,
            cpu_per_id: float) -> None:
    absent = present = 0.0
    for _ in range(5):  # 5 rounds of 1,000: the machine is noisy
        fresh = make_keys(rnd, layout, done, BATCH)
        t = time.perf_counter()
        hits = store.lookup(fresh)
        absent += time.perf_counter() - t
        sample = rnd.sample(stored, BATCH)
        t = time.perf_counter()
        found = store.lookup(sample)
        present += time.perf_counter() - t
        assert hits == 0 and found == BATCH, (hits, found)
    print(f"  at {done:>13,} ({phase}, waited {waited:4.1f} s): insert {insert_s / done * 1e6:6.2f} "
          f"us/id (cumulative), cpu {cpu_per_id:6.2f} us/id (since the last line), absent {absent / 5 / BATCH * 1e6:6.2f} us/id, present "
          f"{present / 5 / BATCH * 1e6:6.2f} us/id, rss {rss_mib():7.0f} MiB, "
          f"disk {disk_bytes(path) / done:6.1f} B/id", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", choices=["rocksdb", "lmdb"], default="rocksdb")
    parser.add_argument("--count", type=int, default=1_000_000)
    parser.add_argument("--dir", default="/tmp/tollgate-dedupe-bench")
    parser.add_argument("--cache-mib", type=int, default=64)
    parser.add_argument("--keys", choices=["id", "timed"], default="id")
    args = parser.parse_args()
    path = Path(args.dir) / args.store
    shutil.rmtree(path, ignore_errors=True)
    rnd = random.Random(1)
    store = Rocks(path, args.cache_mib) if args.store == "rocksdb" else Lmdb(path, args.cache_mib)
    value = (1_790_000_000_000_000).to_bytes(8, "big") + VALUE_LABELS
    stored: list[bytes] = []  # a sample of stored ids for the present-lookups
    checkpoints = {10 ** k for k in range(5, 11)} | {args.count}
    base_rss = rss_mib()
    print(f"store={args.store} keys={args.keys} count={args.count:,} cache={args.cache_mib} MiB"
          f" rss_start={base_rss:.0f} MiB")
    done = 0
    insert_s = 0.0
    cpu_at, done_at = cpu_s(), 0
    while done < args.count:
        n = min(BATCH, args.count - done)
        keys = make_keys(rnd, args.keys, done, n)
        if len(stored) < 100_000:
            stored.extend(keys[:10])
        else:
            stored[rnd.randrange(len(stored))] = keys[0]
        t = time.perf_counter()
        store.insert([(k, value) for k in keys])
        insert_s += time.perf_counter() - t
        done += n
        if done in checkpoints or done % 2_000_000 == 0:
            span = max(done - done_at, 1)  # the ids since the last busy line
            for phase in ("busy", "settled") if done in checkpoints else ("busy",):
                waited = store.settle() if phase == "settled" else 0.0
                # busy: CPU an id of the inserts since the last line; settled: CPU an id of
                # the wait for the compactions those inserts left (the same ids)
                cpu_per_id = (cpu_s() - cpu_at) / span * 1e6
                measure(store, rnd, stored, done, insert_s, path, phase, waited, args.keys,
                        cpu_per_id)
                cpu_at = cpu_s()
            done_at = done
    # The raw limit: a set of the same number of ints (the index this replaces), its lookups.
    n = min(args.count, 1_000_000)
    ints = {rnd.getrandbits(128) for _ in range(n)}
    probe = [rnd.getrandbits(128) for _ in range(BATCH)]
    t = time.perf_counter()
    sum(p in ints for p in probe)
    print(f"raw limit: python set of {n:,} 128-bit ints: lookup "
          f"{(time.perf_counter() - t) / BATCH * 1e6:.2f} us/id")
    store.close()
    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
