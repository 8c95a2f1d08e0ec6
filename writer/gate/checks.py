"""The checks an authorize passes before it may hold anything, in the contract's order:
quotas (quantity per window), budgets (xusd per window), funding (prepaid accounts: grants in
force + credit limit - committed - held), and last the ledger's range.

The order decides which refusal a caller sees when several limits would refuse: the first
check that refuses ends the authorize with its outcome. A check that lets the authorize
through may add hints (low headroom) to the success. Each check has one shape, `Check`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any, Protocol

from core.constants import INT64_MAX
from pipelines.catalog import Account, Budget, Feature, Quota, Realm
from writer.gate.state import Holds, Tally
from writer.ops import GateOutcome

__all__ = ["CHECKS", "LOW_HEADROOM_DIVISOR", "Ask", "Check", "Standing", "check_budgets", "check_funding",
           "check_ledger_range", "check_quotas"]

# A success hints at low headroom below a fifth of the limit (integers: no float near money).
LOW_HEADROOM_DIVISOR = 5
_PERIODIC = {"day": "daily", "month": "monthly"}


# Not frozen: on the authorize path a frozen dataclass of these ten fields took 4.6 us to
# make, a plain one 0.8 us. The checks only read it.
@dataclass(slots=True)
class Ask:
    """One authorize as the checks see it: who asks, for what, how much, and its price now."""

    realm: Realm
    feature: Feature
    account: Account
    principal_id: str
    estimate: int  # quantity, minor units
    cost: int  # the estimate priced at authorize time, xusd
    now: datetime
    today: date  # now's UTC day
    quotas: list[Quota]  # those on this feature and account
    budgets: list[Budget]  # those on this account and feature


class Standing(Protocol):
    """What the checks read of the gate book: usage, holds and balances."""

    @property
    def tally(self) -> Tally: ...

    @property
    def holds(self) -> Holds: ...

    def balance(self, realm: str, account: str, now: datetime) -> int: ...


# (the book, the authorize, the success's hints so far) -> a refusal, or None to go on
Check = Callable[[Standing, Ask, list[dict[str, Any]]], GateOutcome | None]


def _hint_amount(xusd: int) -> int:
    """An amount for a hint, within signed 64-bit. A shortfall grows with an account's debt,
    which commits may push past any bound; an outcome travels from the writer as msgpack,
    which cannot carry an integer beyond 2^64-1 (the writer would die sending the reply)."""
    return min(xusd, INT64_MAX)


def check_quotas(book: Standing, ask: Ask, hints: list[dict[str, Any]]) -> GateOutcome | None:
    """Each quota's window must have the estimate left, after usage and what is held."""
    realm, feature, estimate = ask.realm, ask.feature, ask.estimate
    for q in ask.quotas:
        sid = ask.principal_id if q.scope == "principal" else ask.account.id
        used, _ = book.tally.window(realm.id, q.scope, sid, q.window, ask.today, (feature.code,))
        held, _ = book.holds.held(realm.id, q.scope, sid, (feature.code,))
        remaining = q.limit_minor - used - held
        if estimate > remaining:
            return GateOutcome(status=402, code="QUOTA.EXHAUSTED",
                               message=f"the {_PERIODIC[q.window]} quota on {feature.code} per {q.scope} "
                                       f"({q.quota_id}) has {max(0, remaining)} left, {estimate} asked",
                               hints=[{"type": "quota.remaining", "max_quantity_minor": max(0, remaining)}])
        after = remaining - estimate
        if after * LOW_HEADROOM_DIVISOR < q.limit_minor:
            hints.append({"type": "quota.remaining", "max_quantity_minor": after})
    return None


def check_budgets(book: Standing, ask: Ask, hints: list[dict[str, Any]]) -> GateOutcome | None:
    """Each budget's window must have room for the priced estimate, after spending and holds."""
    realm, cost = ask.realm, ask.cost
    for b in ask.budgets:
        sid = ask.principal_id if b.scope == "principal" else ask.account.id
        _, spent = book.tally.window(realm.id, b.scope, sid, b.window, ask.today, b.features)
        _, held = book.holds.held(realm.id, b.scope, sid, b.features)
        shortfall = spent + held + cost - b.limit_xusd
        if shortfall > 0:
            return GateOutcome(status=402, code="BUDGET.EXHAUSTED",
                               message=f"budget {b.id} ({b.window}) would be exceeded",
                               hints=[{"type": "budget.shortfall", "budget_id": b.id,
                                       "shortfall_xusd": _hint_amount(shortfall)}])
        headroom = -shortfall
        if headroom * LOW_HEADROOM_DIVISOR < b.limit_xusd:
            hints.append({"type": "budget.low_headroom", "budget_id": b.id, "headroom_xusd": headroom})
    return None


def check_funding(book: Standing, ask: Ask, hints: list[dict[str, Any]]) -> GateOutcome | None:
    """A prepaid account's balance and credit limit, less what it holds, must cover the
    priced estimate; a postpaid account is not checked."""
    realm, account = ask.realm, ask.account
    if account.funding == "prepaid":
        available = (book.balance(realm.id, account.id, ask.now) + account.credit_limit_xusd
                     - book.holds.funding.get((realm.id, account.id), 0))
        if ask.cost > available:
            return GateOutcome(status=402, code="FUNDING.INSUFFICIENT",
                               message="the account's balance does not cover the estimate",
                               hints=[{"type": "funding.xusd_shortfall",
                                       "shortfall_xusd": _hint_amount(ask.cost - available)}])
    return None


def check_ledger_range(book: Standing, ask: Ask, hints: list[dict[str, Any]]) -> GateOutcome | None:
    # Checked after the limits, whose refusals come first in the contract's order: only a
    # hold this call would keep must fit the ledger's BIGINT.
    if ask.cost > INT64_MAX:
        return GateOutcome(status=422, code="VALIDATION.INVALID_INPUT",
                           message=f"the estimate's price is beyond what the ledger holds ({INT64_MAX} xusd)",
                           errors=[{"field": "estimated_quantity_minor", "code": "VALIDATION.INVALID_VALUE",
                                    "message": "priced, this estimate exceeds 2^63-1 xusd"}])
    return None


# The contract's order: the first refusal is the one a caller sees.
CHECKS: tuple[Check, ...] = (check_quotas, check_budgets, check_funding, check_ledger_range)
