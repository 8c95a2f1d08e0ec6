"""The gate book: leases, holds, usage, funding, carried remainders and idempotency records,
kept in memory by the writer process and rebuilt from the operational file at start. With the
writer's index (`warehouse.event_index`), ended leases (7 days) and idempotency records (24 h)
live on disk, and memory keeps only the most recent of them (`ENDED_LEASE_CACHE`,
`IDEMPOTENCY_CACHE`): the book's memory follows the traffic of a lease's lifetime, not a week
of it.

Every authorize, commit and cancel is decided here, one at a time in queue order, against
this state, and its rows are staged into the same group transaction. That makes decisions
serializable per account without locks: concurrent authorizes can never hold more than is
available, because the second one sees the first one's hold.

Limits, in the contract's order (`writer.gate.checks`): quota (quantity per window), budget
(xusd per window), funding (prepaid accounts: grants in force + credit limit - committed -
held). A hold is the estimate (quantity against quotas, its price at authorize time against
budgets and funding); commit releases it and books the actual quantity and amount on the day
of the commit. Windows are UTC calendar days and months (`writer.gate.state`). The book's SQL
is `warehouse.gate_store`.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import heapq
import logging
import os
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import duckdb
import msgspec

from core.clock import Clock
from core.constants import INT64_MAX
from pipelines.catalog import Budget, Catalog, Feature, Quota, Realm
from pipelines.events import format_instant
from pipelines.price_index import PriceIndex, price_fingerprint
from pipelines.pricing import PricedLine, PriceRow, price_line, quote
from warehouse.event_index import EventIndex, idempotency_digest
from warehouse.gate_store import (
    carried_remainders,
    committed_totals,
    idempotency_records,
    last_seqs,
    leases_to_keep,
    record_expired,
    record_grants,
    recorded_grants,
    usage_by_day,
)
from warehouse.writer import Transaction
from writer.gate.checks import CHECKS, Ask
from writer.gate.state import Holds, Lease, Tally
from writer.ops import (
    AuthorizeOp,
    CancelOp,
    CommitBatchOp,
    CommitOp,
    GateOutcome,
    IdemKey,
    MeterLine,
    QuotaUse,
    RecordOutcomeOp,
    Standing,
    StandingOp,
    UsageOp,
    commit_body_kept,
)

__all__ = ["GateBook", "token_digest"]

_encode = msgspec.json.encode
IDEMPOTENCY_TTL = timedelta(hours=24)
ENDED_LEASE_MEMORY = timedelta(days=7)
# Idempotency records held in memory besides the index on disk: the most recent ones.
IDEMPOTENCY_CACHE = 20_000
# Ended leases held in memory besides the index on disk: the most recently ended.
ENDED_LEASE_CACHE = 50_000
# How far before the index's lease mark the file is read at start: leases that ended in a
# group whose put into the index a kill cut off.
LEASE_MARK_MARGIN = timedelta(minutes=5)
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _us(at: datetime) -> int:
    return (at - _EPOCH) // timedelta(microseconds=1)


def _at(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


def _lease_record(lease: Lease) -> tuple[bytes, int, bytes]:
    """An ended lease as the index keeps it: (token digest, ended_at us, msgpack)."""
    assert lease.ended_at is not None
    ended = _us(lease.ended_at)
    value = msgspec.msgpack.encode((
        lease.lease_id, ended, lease.realm, lease.principal_id, lease.account, lease.feature_code,
        lease.family, lease.held_qty, lease.held_xusd, _us(lease.created_at), _us(lease.expires_at),
        lease.state, lease.commit_body,
        None if lease.commit_outcome is None else msgspec.msgpack.encode(lease.commit_outcome)))
    return bytes.fromhex(lease.token_sha), ended, value


def _lease_from(sha: str, raw: bytes) -> Lease:
    (lease_id, ended, realm, principal, account, feature, family, qty, xusd, created, expires,
     state, body, outcome) = msgspec.msgpack.decode(raw)
    return Lease(lease_id, sha, realm, principal, account, feature, family, qty, xusd, _at(created),
                 _at(expires), state, _at(ended), body,
                 None if outcome is None else msgspec.msgpack.decode(outcome, type=GateOutcome))


class _Randomness:
    """Bytes from the operating system's CSPRNG, fetched 4 KiB at a time and handed out once
    each. A lease takes two draws and a commit one; a system call per draw was a tenth of the
    writer loop's time under load."""

    def __init__(self) -> None:
        self._pool = b""
        self._at = 0

    def take(self, n: int) -> bytes:
        if self._at + n > len(self._pool):
            self._pool = os.urandom(4096)
            self._at = 0
        chunk = self._pool[self._at:self._at + n]
        self._at += n
        return chunk


_random = _Randomness()


def _lease_token() -> str:
    """`tgl_` + 256 random bits, base64url without padding (as secrets.token_urlsafe(32))."""
    return "tgl_" + base64.urlsafe_b64encode(_random.take(32)).rstrip(b"=").decode("ascii")


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()

log = logging.getLogger("tollgate.writer.gate")


def _error(status: int, code: str, message: str, **extra: Any) -> GateOutcome:
    return GateOutcome(status=status, code=code, message=message, **extra)


def _meter_lines(feature: Feature, meters: list[MeterLine] | None,
                 quantity: int) -> list[tuple[str, int]] | GateOutcome:
    """The (meter, quantity) lines of a commit or an ingest: its `meters`, each a meter of the
    feature, or the quantity on the feature's primary meter."""
    if not meters:
        return [(feature.primary_meter, quantity)]
    bad = [(i, m.meter_code) for i, m in enumerate(meters) if m.meter_code not in feature.meters]
    if bad:
        return _error(422, "FEATURE.METER_NOT_ALLOWED",
                      f"meters not allowed for {feature.code}: {', '.join(m for _, m in bad)}",
                      errors=[{"field": f"meters[{i}].meter_code", "code": "FEATURE.METER_NOT_ALLOWED",
                               "message": f"{m} is not a meter of {feature.code}"} for i, m in bad])
    return [(m.meter_code, m.quantity_minor) for m in meters]


def _price_lines(prices: PriceIndex, lines: list[tuple[str, int]], now: datetime,
                 carried: Callable[[str, str], int]) -> list[tuple[str, int, PriceRow | None, PricedLine | None]] | None:
    """Each line with its price row in force and its pricing, the carry running from line to
    line as the commit will store it; None when the amounts pass 2^63-1 xusd, so the commit
    is refused before it changes anything."""
    carry: dict[tuple[str, str], int] = {}
    total = 0
    out: list[tuple[str, int, PriceRow | None, PricedLine | None]] = []
    for meter, qty in lines:
        row = prices.at(meter, now)
        if row is None:
            out.append((meter, qty, None, None))
            continue
        key = (meter, price_fingerprint(row))
        priced = price_line(row, qty, carry[key] if key in carry else carried(*key))
        carry[key] = priced.remainder_after
        total += priced.amount_xusd
        if priced.amount_xusd > INT64_MAX or total > INT64_MAX:
            return None
        out.append((meter, qty, row, priced))
    return out


class GateBook:
    def __init__(self, catalog: Callable[[], Catalog], clock: Clock,
                 index: EventIndex | None = None) -> None:
        """With an `index`, idempotency records live on disk (24 h, expired by
        `expire_idempotency`) behind a cache of the most recent; without one (tools,
        tests), all of the last 24 h are held in memory, read from the file."""
        self._catalog = catalog
        self._clock = clock
        self._index = index
        self._price_index: dict[str, PriceIndex] = {}
        self._price_fingerprint = ""
        self.grants_pending = True  # the catalog's grants are not known to be in the file
        self._grant_failures: set[str] = set()

    # ---- state --------------------------------------------------------------------------
    def rebuild(self, conn: duckdb.DuckDBPyConnection) -> None:
        """Load the state from the file: at start, and after a group failed to commit."""
        now = self._clock.now()
        self.leases: dict[str, Lease] = {}
        self.expiry: list[tuple[datetime, str]] = []
        self.tally = Tally()
        self.holds = Holds()
        self.committed: dict[tuple[str, str], int] = defaultdict(int)
        self.grants: dict[tuple[str, str], list[tuple[datetime, int]]] = defaultdict(list)
        self.grant_ids: set[tuple[str, str]] = set()
        self.grant_rows: dict[tuple[str, str], list[tuple[str, int, datetime]]] = defaultdict(list)
        self.carry: dict[tuple[str, str, str, str], int] = {}
        self.idempotency: dict[tuple[str, str, str, str], tuple[str, GateOutcome, datetime]] = {}
        since = now - ENDED_LEASE_MEMORY
        self._ended: dict[str, None] = {}  # ended leases in memory, oldest first
        index = self._index
        if index is not None:
            mark = index.lease_mark()
            if mark:  # older ended leases are in the index
                since = max(since, _at(mark) - LEASE_MARK_MARGIN)
        rows = leases_to_keep(conn, since)
        for (lease_id, sha, realm, principal, account, feature, family, qty, xusd, created, expires,
             state, ended, body, reply) in rows:
            lease = Lease(lease_id, sha, realm, principal, account, feature, family, qty, xusd,
                          created, expires, state or "active", ended)
            if body is not None:
                # A body stored before `commit_body_kept` held every field: keep what it keeps.
                lease.commit_body = commit_body_kept(msgspec.json.decode(body.encode()))
                lease.commit_outcome = msgspec.json.decode(reply.encode(), type=GateOutcome)
            self.leases[sha] = lease
            if lease.state == "active":
                self.holds.change(lease, +1)
                heapq.heappush(self.expiry, (expires, sha))
            else:
                self._ended[sha] = None
        if index is not None:
            # Into the index: leases a kill kept from it, and (at the first start with an
            # index) every lease that ended in the last 7 days. Then memory keeps the latest.
            index.put_leases(_lease_record(self.leases[sha]) for sha in self._ended)
            self._trim_ended()
        month_start = datetime(now.year, now.month, 1, tzinfo=timezone.utc)
        for realm, account, principal, feature, day, qty, xusd in usage_by_day(conn, month_start):
            self.tally.add(realm, account, principal, feature, day, int(qty), int(xusd))
        for realm, account, total in committed_totals(conn):
            self.committed[(realm, account)] = int(total)
        for realm, account, gid, amount, eff in recorded_grants(conn):
            self.grants[(realm, account)].append((eff, amount))
            self.grant_rows[(realm, account)].append((gid, amount, eff))
            self.grant_ids.add((realm, gid))
        for realm, account, meter, fingerprint, remainder in carried_remainders(conn):
            self.carry[(realm, account, meter, fingerprint)] = int(remainder)
        records = idempotency_records(conn, now - IDEMPOTENCY_TTL)
        if self._index is not None:
            if records:  # written to the file by an earlier version: they move to the index
                self._index.put_idempotency(
                    (idempotency_digest(realm, principal, endpoint, key), sha,
                     int(stored_at.timestamp() * 1_000_000), reply)
                    for realm, principal, endpoint, key, sha, reply, stored_at in records)
            # Fetched: a result left pending keeps its write transaction open, and no
            # checkpoint of the file could run until the connection's next statement.
            conn.execute("DELETE FROM idempotency").fetchall()
        else:
            for realm, principal, endpoint, key, sha, reply, stored_at in records:
                outcome = msgspec.msgpack.decode(reply, type=GateOutcome)
                self.idempotency[(realm, principal, endpoint, key)] = (sha, outcome, stored_at)
        self.line_seq, self.commit_seq = last_seqs(conn)
        self.grants_pending = True
        self.sync_pending_grants(conn)

    def sync_pending_grants(self, conn: duckdb.DuckDBPyConnection) -> bool:
        """`sync_grants` while a sync is pending (set at start and by every new catalog),
        cleared only once the grants are in the file: a write that fails is tried again on
        the writer's next tick, not at the next catalog change. Each kind of failure is
        logged once until a sync lands. True when nothing is pending any more."""
        if not self.grants_pending:
            return True
        try:
            self.sync_grants(conn)
        except Exception as exc:
            kind = type(exc).__name__
            if kind not in self._grant_failures:
                self._grant_failures.add(kind)
                log.exception("recording the catalog's grants failed; retrying on every tick")
            return False
        if self._grant_failures:
            log.info("the catalog's grants are recorded after %s",
                     ", ".join(sorted(self._grant_failures)))
            self._grant_failures.clear()
        self.grants_pending = False
        return True

    def sync_grants(self, conn: duckdb.DuckDBPyConnection) -> None:
        """Record the catalog's grants in the ledger, once per id (idempotent by id)."""
        catalog = self._catalog()
        new = []
        now = self._clock.now()
        for realm in catalog.realms.values():
            for account in realm.accounts.values():
                for grant in account.grants:
                    if (realm.id, grant.id) in self.grant_ids:
                        continue
                    new.append((realm.id, account.id, grant.id, grant.amount_xusd, grant.effective_at, now))
        if not new:
            return
        record_grants(conn, new)
        for realm_id, account_id, gid, amount, eff, _ in new:
            self.grants[(realm_id, account_id)].append((eff, amount))
            self.grant_rows[(realm_id, account_id)].append((gid, amount, eff))
            self.grant_ids.add((realm_id, gid))

    def _prices(self, realm: Realm) -> PriceIndex:
        catalog = self._catalog()
        if catalog.fingerprint != self._price_fingerprint:
            self._price_index = {r.id: PriceIndex.of(r) for r in catalog.realms.values()}
            self._price_fingerprint = catalog.fingerprint
        return self._price_index.get(realm.id) or PriceIndex()

    def balance(self, realm: str, account: str, now: datetime) -> int:
        granted = sum(amount for eff, amount in self.grants.get((realm, account), ()) if eff <= now)
        return granted - self.committed.get((realm, account), 0)

    # ---- idempotency ----------------------------------------------------------------------
    def _with_idempotency(self, tx: Transaction, idem: IdemKey | None,
                          decide: Callable[[], GateOutcome]) -> GateOutcome:
        if idem is None:
            return decide()
        scope = (idem.realm, idem.principal_id, idem.endpoint, idem.key)
        found = self.idempotency.get(scope)
        if found is None and self._index is not None:
            on_disk = self._index.get_idempotency(idempotency_digest(*scope))
            if on_disk is not None:
                body_sha, stored_us, reply = on_disk
                found = (body_sha, msgspec.msgpack.decode(reply, type=GateOutcome),
                         datetime.fromtimestamp(stored_us / 1_000_000, timezone.utc))
        if found is not None and tx.now - found[2] < IDEMPOTENCY_TTL:
            sha, outcome, _ = found
            if sha != idem.body_sha256:
                return _error(409, "IDEMPOTENCY.CONFLICT",
                              "this Idempotency-Key was used with a different body")
            replay = msgspec.structs.replace(outcome, replayed=True)
            return replay
        outcome = decide()
        if outcome.storable:
            cache = self.idempotency
            cache[scope] = (idem.body_sha256, outcome, tx.now)
            reply = msgspec.msgpack.encode(outcome)
            tx.stage("idempotency", (idem.realm, idem.principal_id, idem.endpoint, idem.key,
                                     idem.body_sha256, outcome.status, reply, "{}", tx.now))
            index = self._index
            if index is not None:
                if len(cache) > IDEMPOTENCY_CACHE:
                    del cache[next(iter(cache))]  # the oldest: it is on disk
                record = (idempotency_digest(*scope), idem.body_sha256,
                          int(tx.now.timestamp() * 1_000_000), reply)
                # Durable in the journal first; a kill before this put is caught up when the
                # journal is applied at start (the idempotency table's writer, `writer.host`).
                tx.after_commit(lambda: index.put_idempotency((record,)))
        return outcome

    def record_outcome(self, tx: Transaction, op: RecordOutcomeOp) -> Callable[[], GateOutcome]:
        result = self._with_idempotency(tx, op.idem, lambda: op.outcome)
        return lambda: result

    # ---- authorize --------------------------------------------------------------------------
    def authorize(self, tx: Transaction, op: AuthorizeOp) -> Callable[[], GateOutcome]:
        result = self._with_idempotency(tx, op.idem, lambda: self._authorize(tx, op))
        return lambda: result

    def _authorize(self, tx: Transaction, op: AuthorizeOp) -> GateOutcome:
        catalog = self._catalog()
        realm = catalog.realms.get(op.realm)
        feature = realm.features.get(op.feature_code) if realm else None
        if realm is None or feature is None or not feature.active:
            return _error(422, "RESOURCE.NOT_FOUND", f"unknown or inactive feature {op.feature_code!r}")
        account = realm.accounts.get(op.billing_account_id)
        if account is None:
            return _error(422, "RESOURCE.NOT_FOUND", f"unknown billing account {op.billing_account_id!r}")
        now = tx.now
        estimate = op.estimated_quantity_minor
        row = self._prices(realm).at(feature.primary_meter, now)
        cost = quote(row, estimate) if row is not None else 0
        if op.at_least_a_block and row is not None:
            cost = max(cost, row.unit_price_xusd)
        quotas = self._quotas(realm, feature, account.id)
        budgets = self._budgets(realm, feature, account.id)
        ask = Ask(realm=realm, feature=feature, account=account, principal_id=op.principal_id,
                  estimate=estimate, cost=cost, now=now, today=now.date(), quotas=quotas,
                  budgets=budgets)
        hints: list[dict[str, Any]] = []
        for check in CHECKS:
            refused = check(self, ask, hints)
            if refused is not None:
                return refused

        token = _lease_token()
        sha = token_digest(token)
        lease = Lease(
            lease_id="lse_" + _random.take(12).hex(), token_sha=sha, realm=realm.id,
            principal_id=op.principal_id, account=account.id, feature_code=feature.code,
            family=feature.family or "", held_qty=estimate, held_xusd=cost, created_at=now,
            expires_at=now + timedelta(seconds=realm.lease_ttl(feature)),
        )
        self.leases[sha] = lease
        self.holds.change(lease, +1)
        heapq.heappush(self.expiry, (lease.expires_at, sha))
        tx.stage("leases", (lease.lease_id, sha, realm.id, op.principal_id, account.id, op.user_id,
                            feature.code, feature.family, estimate, cost,
                            _encode({"quotas": [q.quota_id for q in quotas],
                                     "budgets": [b.id for b in budgets],
                                     "funding": account.funding == "prepaid"}).decode(),
                            now, lease.expires_at,
                            _encode(op.labels).decode()))
        data = {
            "lease_token": token,
            "lease": token,
            "lease_id": lease.lease_id,
            "feature_code": feature.code,
            "feature_family_code": lease.family,
            "window_start": format_instant(now),
            "window_end": format_instant(lease.expires_at),
            "expires_at": format_instant(lease.expires_at),
            "held_quantity_minor": str(estimate),
            "held_amount_xusd": str(cost),
        }
        return GateOutcome(status=200, data=data, hints=hints)

    @staticmethod
    def _quotas(realm: Realm, feature: Feature, account: str) -> list[Quota]:
        return [q for q in realm.quotas
                if q.feature == feature.code and (q.accounts is None or account in q.accounts)]

    @staticmethod
    def _budgets(realm: Realm, feature: Feature, account: str) -> list[Budget]:
        return [b for b in realm.budgets
                if (b.accounts is None or account in b.accounts)
                and (b.features is None or feature.code in b.features)]

    # ---- commit -------------------------------------------------------------------------------
    def commit(self, tx: Transaction, op: CommitOp) -> Callable[[], GateOutcome]:
        result = self._with_idempotency(tx, op.idem, lambda: self._commit(tx, op))
        return lambda: result

    def _ended_lease(self, tx: Transaction | None, lease: Lease) -> None:
        """`lease` just ended: into the index once durable, and into the ended leases kept
        in memory (the oldest of which then leave memory)."""
        self._ended[lease.token_sha] = None
        index = self._index
        if index is None:
            return
        if tx is None:
            index.put_leases((_lease_record(lease),))
        else:
            record = _lease_record(lease)
            tx.after_commit(lambda: index.put_leases((record,)))
        self._trim_ended()

    def _trim_ended(self) -> None:
        ended = self._ended
        while len(ended) > ENDED_LEASE_CACHE:
            sha = next(iter(ended))
            del ended[sha]
            lease = self.leases.get(sha)
            if lease is not None and lease.state != "active":
                del self.leases[sha]

    def _lease_of(self, realm: str, principal: str, token: str) -> Lease | None:
        sha = token_digest(token)
        lease = self.leases.get(sha)
        if lease is None and self._index is not None:
            raw = self._index.get_lease(bytes.fromhex(sha))
            if raw is not None:
                lease = _lease_from(sha, raw)
                if self._clock.now() - (lease.ended_at or lease.expires_at) > ENDED_LEASE_MEMORY:
                    lease = None  # past what the book remembers, not yet removed from disk
                else:
                    self.leases[sha] = lease
                    self._ended[sha] = None
                    self._trim_ended()
        if lease is None or lease.realm != realm or lease.principal_id != principal:
            return None
        return lease

    def _commit(self, tx: Transaction, op: CommitOp) -> GateOutcome:
        lease = self._lease_of(op.realm, op.principal_id, op.lease_token)
        if lease is None:
            return _error(422, "LEASE.NOT_FOUND", "no lease for this token and principal")
        if lease.state == "committed":
            if lease.commit_body == op.body_canonical and lease.commit_outcome is not None:
                return lease.commit_outcome
            return _error(409, "LEASE.ALREADY_COMMITTED", "this lease was committed with another body")
        if lease.state == "cancelled":
            return _error(409, "LEASE.CANCELLED", "this lease was cancelled")
        if op.feature_code != lease.feature_code:
            return _error(422, "LEASE.FEATURE_MISMATCH",
                          f"the lease is for {lease.feature_code!r}, not {op.feature_code!r}")
        catalog = self._catalog()
        realm = catalog.realms.get(lease.realm)
        feature = realm.features.get(lease.feature_code) if realm else None
        if realm is None or feature is None:
            return _error(422, "RESOURCE.NOT_FOUND", f"feature {lease.feature_code!r} is no longer in the catalog")
        lines = _meter_lines(feature, op.meters, op.quantity_minor)
        if isinstance(lines, GateOutcome):
            return lines

        now = tx.now
        hints: list[dict[str, Any]] = []
        expired = lease.state == "expired" or now >= lease.expires_at
        if expired:
            hints.append({"type": "lease.expired", "expires_at": format_instant(lease.expires_at)})
        booked = self._book(tx, realm, feature, lease.account, lease.principal_id, lease.lease_id,
                            lines, op.quantity_minor, now, hints)
        if isinstance(booked, GateOutcome):
            return booked
        commit_id, total, data = booked
        if lease.state == "active":
            self.holds.change(lease, -1)
        lease.state = "committed"
        lease.ended_at = now
        data["lease_id"] = lease.lease_id
        outcome = GateOutcome(status=200, data=data, hints=hints)
        lease.commit_body = op.body_canonical
        lease.commit_outcome = outcome
        self._ended_lease(tx, lease)
        tx.stage("commits", (self.commit_seq, commit_id, lease.lease_id, realm.id, lease.account,
                             lease.principal_id, lease.feature_code, op.quantity_minor, total, now, expired,
                             op.body_canonical.decode(), _encode(outcome).decode(),
                             _encode(op.labels).decode()))
        return outcome

    def _book(self, tx: Transaction, realm: Realm, feature: Feature, account: str, principal: str,
              lease_id: str, lines: list[tuple[str, int]], quantity: int, at: datetime,
              hints: list[dict[str, Any]]) -> GateOutcome | tuple[str, int, dict[str, Any]]:
        """Price `lines` with the rows in force at `at`, stage the commit's lines and count
        its usage on `at`'s day: what a commit and an ingest share. Returns the commit id,
        its amount and the reply's data, or the refusal of an amount beyond the ledger."""
        prices = self._prices(realm)
        planned = _price_lines(prices, lines, at, lambda meter, fingerprint: self.carry.get(
            (realm.id, account, meter, fingerprint), 0))
        if planned is None:
            return _error(422, "VALIDATION.INVALID_INPUT",
                          f"the commit's amount is beyond what the ledger holds ({INT64_MAX} xusd)",
                          errors=[{"field": "quantity_minor", "code": "VALIDATION.INVALID_VALUE",
                                   "message": "priced, this quantity exceeds 2^63-1 xusd"}])
        commit_id = "cmt_" + _random.take(12).hex()
        total = 0
        out_lines = []
        unpriced = []
        self.commit_seq += 1
        for index, (meter, qty, row, priced) in enumerate(planned):
            line_id = f"{commit_id}.{index}"
            self.line_seq += 1
            if row is None or priced is None:
                unpriced.append(meter)
                amount, carried, remainder = 0, 0, 0
                price_id = unit_price = unit_qty = rounding = fingerprint = None
            else:
                carried = priced.carried
                fingerprint = price_fingerprint(row)
                self.carry[(realm.id, account, meter, fingerprint)] = remainder = priced.remainder_after
                amount = priced.amount_xusd
                price_id, unit_price, unit_qty, rounding = (
                    row.price_id, row.unit_price_xusd, row.unit_quantity_minor, row.rounding)
            total += amount
            tx.stage("commit_lines", (self.line_seq, line_id, commit_id, lease_id, realm.id,
                                      account, principal, feature.code, meter, qty,
                                      price_id, unit_price, unit_qty, rounding, carried, remainder,
                                      amount, fingerprint, at))
            out_lines.append({
                "line_id": line_id, "meter_code": meter, "quantity_minor": str(qty),
                "unit_price_xusd": str(unit_price or 0), "unit_quantity_minor": str(unit_qty or 1),
                "amount_xusd": str(amount), "pricing_fingerprint": fingerprint,
            })
        if unpriced:
            hints.append({"type": "pricing.not_configured", "feature_code": feature.code, "meters": unpriced})
        self.tally.add(realm.id, account, principal, feature.code, at.date(), quantity, total)
        self.committed[(realm.id, account)] += total
        balance = self.balance(realm.id, account, tx.now)
        data = {"commit_id": commit_id, "amount_xusd": str(total), "lines": out_lines,
                "balance_xusd": str(balance)}
        return commit_id, total, data

    # ---- commit batch -------------------------------------------------------------------------
    def commit_batch(self, tx: Transaction, op: CommitBatchOp) -> Callable[[], GateOutcome]:
        result = self._with_idempotency(tx, op.idem, lambda: self._commit_batch(tx, op))
        return lambda: result

    def _commit_batch(self, tx: Transaction, op: CommitBatchOp) -> GateOutcome:
        """Each item as its own commit, in order, each under its own idempotency scope; the
        batch answers 200 with one outcome per item (a refused item does not stop the rest)."""
        items = []
        for item in op.items:
            outcome = self._with_idempotency(tx, item.idem, functools.partial(self._commit, tx, item))
            items.append({"status": outcome.status, "code": outcome.code, "message": outcome.message,
                          "data": outcome.data, "errors": outcome.errors, "hints": outcome.hints,
                          "replayed": outcome.replayed})
        return GateOutcome(status=200, data={"items": items})

    # ---- usage without a lease ------------------------------------------------------------------
    def usage(self, tx: Transaction, op: UsageOp) -> Callable[[], GateOutcome]:
        result = self._with_idempotency(tx, op.idem, lambda: self._usage(tx, op))
        return lambda: result

    def _usage(self, tx: Transaction, op: UsageOp) -> GateOutcome:
        catalog = self._catalog()
        realm = catalog.realms.get(op.realm)
        feature = realm.features.get(op.feature_code) if realm else None
        if realm is None or feature is None or not feature.active:
            return _error(422, "RESOURCE.NOT_FOUND", f"unknown or inactive feature {op.feature_code!r}")
        if op.billing_account_id not in realm.accounts:
            return _error(422, "RESOURCE.NOT_FOUND", f"unknown billing account {op.billing_account_id!r}")
        lines = _meter_lines(feature, op.meters, op.quantity_minor)
        if isinstance(lines, GateOutcome):
            return lines
        at = datetime.fromisoformat(op.occurred_at)
        hints: list[dict[str, Any]] = []
        booked = self._book(tx, realm, feature, op.billing_account_id, op.principal_id, "",
                            lines, op.quantity_minor, at, hints)
        if isinstance(booked, GateOutcome):
            return booked
        commit_id, total, data = booked
        outcome = GateOutcome(status=200, data=data, hints=hints)
        tx.stage("commits", (self.commit_seq, commit_id, "", realm.id, op.billing_account_id,
                             op.principal_id, feature.code, op.quantity_minor, total, at, False,
                             op.body_canonical.decode(), _encode(outcome).decode(),
                             _encode(op.labels).decode()))
        return outcome

    # ---- reads ----------------------------------------------------------------------------------
    def standing(self, tx: Transaction, op: StandingOp) -> Callable[[], Standing]:
        """The account's grants, committed and held amounts, and (with a principal) the use of
        every quota that applies to the principal's calls, in the windows open now."""
        today = tx.now.date()
        quotas: list[QuotaUse] = []
        realm = self._catalog().realms.get(op.realm)
        if realm is not None and op.principal_id is not None:
            for q in realm.quotas:
                if q.accounts is not None and op.billing_account_id not in q.accounts:
                    continue
                sid = op.principal_id if q.scope == "principal" else op.billing_account_id
                used, _ = self.tally.window(op.realm, q.scope, sid, q.window, today, (q.feature,))
                held, _ = self.holds.held(op.realm, q.scope, sid, (q.feature,))
                quotas.append(QuotaUse(q.quota_id, used, held))
        grants = [(gid, amount, format_instant(eff))
                  for gid, amount, eff in self.grant_rows.get((op.realm, op.billing_account_id), ())]
        result = Standing(grants=grants, committed_xusd=self.committed.get((op.realm, op.billing_account_id), 0),
                          held_xusd=self.holds.funding.get((op.realm, op.billing_account_id), 0),
                          quotas=quotas, as_of=format_instant(tx.now))
        return lambda: result

    # ---- cancel -------------------------------------------------------------------------------
    def cancel(self, tx: Transaction, op: CancelOp) -> Callable[[], GateOutcome]:
        result = self._with_idempotency(tx, op.idem, lambda: self._cancel(tx, op))
        return lambda: result

    def _cancel(self, tx: Transaction, op: CancelOp) -> GateOutcome:
        lease = self._lease_of(op.realm, op.principal_id, op.lease_token)
        if lease is None:
            return _error(422, "LEASE.NOT_FOUND", "no lease for this token and principal")
        if lease.state == "active" and tx.now >= lease.expires_at:
            # Past its time, not yet reached by the expiry sweep: it expired, this call
            # cancels nothing (a commit would treat it as expired too).
            self.holds.change(lease, -1)
            lease.state = "expired"
            lease.ended_at = lease.expires_at
            tx.stage("lease_transitions", (lease.lease_id, "expired", lease.expires_at, None))
            self._ended_lease(tx, lease)
        if lease.state != "active":
            return GateOutcome(status=200, data={"cancelled": False, "state": lease.state, "released_cap": "0",
                                                 "lease_id": lease.lease_id})
        self.holds.change(lease, -1)
        lease.state = "cancelled"
        lease.ended_at = tx.now
        self._ended_lease(tx, lease)
        tx.stage("lease_transitions", (lease.lease_id, "cancelled", tx.now, op.reason))
        return GateOutcome(status=200, data={"cancelled": True, "state": "cancelled",
                                             "released_cap": str(lease.held_qty), "lease_id": lease.lease_id})

    # ---- time -----------------------------------------------------------------------------------
    def expire_due(self, conn: duckdb.DuckDBPyConnection) -> int:
        """Expire every active lease past its time, releasing its holds (no call needed)."""
        now = self._clock.now()
        due: list[Lease] = []
        while self.expiry and self.expiry[0][0] <= now:
            _, sha = heapq.heappop(self.expiry)
            lease = self.leases.get(sha)
            if lease is not None and lease.state == "active":
                due.append(lease)
        if not due:
            return 0
        try:
            record_expired(conn, [(lease.lease_id, lease.expires_at) for lease in due])
        except duckdb.Error:
            for lease in due:
                heapq.heappush(self.expiry, (lease.expires_at, lease.token_sha))
            raise
        for lease in due:
            self.holds.change(lease, -1)
            lease.state = "expired"
            lease.ended_at = lease.expires_at
            self._ended[lease.token_sha] = None
        if self._index is not None:
            self._index.put_leases(_lease_record(lease) for lease in due)
            self._trim_ended()
        return len(due)

    def expire_idempotency(self, limit: int = 20_000) -> int:
        """Delete up to `limit` idempotency records older than 24 h from the index."""
        if self._index is None:
            return 0
        cutoff = self._clock.now() - IDEMPOTENCY_TTL
        return self._index.expire_idempotency(int(cutoff.timestamp() * 1_000_000), limit)

    def expire_leases(self, limit: int = 20_000) -> int:
        """Delete up to `limit` leases that ended more than 7 days ago from the index."""
        if self._index is None:
            return 0
        return self._index.expire_leases(_us(self._clock.now() - ENDED_LEASE_MEMORY), limit)

    def forget_old(self) -> None:
        """Bound memory: ended leases after a week, idempotency records after 24 h, usage
        cells of months before the last."""
        now = self._clock.now()
        for sha in [s for s, lease in self.leases.items()
                    if lease.ended_at is not None and now - lease.ended_at > ENDED_LEASE_MEMORY]:
            del self.leases[sha]
            self._ended.pop(sha, None)
        for scope in [k for k, v in self.idempotency.items() if now - v[2] >= IDEMPOTENCY_TTL]:
            del self.idempotency[scope]
        if self._index is not None:
            self.expire_idempotency()
            self.expire_leases()
        first = now.date().replace(day=1)
        self.tally.forget_before((first - timedelta(days=1)).replace(day=1))
