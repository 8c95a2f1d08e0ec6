"""GET /mgt/v1/wallet/balance: an account's money now.

The account is the one in context: X-Billing-Account-Id, or the account of X-Principal-Id.
The figures, all integer xusd (1 USD = 1,000,000 xusd):

    granted     the account's grants in force (effective_at <= now)
    committed   what commits and ingested usage booked, ever
    balance     granted - committed (may be negative: usage is booked whatever the funds)
    held        what the account's active leases hold
    available   balance + credit limit - held: what an authorize may still hold (the funding
                check of a prepaid account; a postpaid account is not checked)

In the official client's shape, `balances` is the spendable amount (available) and
`outstanding_balances` the net balance; each grant in force shows what it has left, grants
consumed oldest first, so a deficit shows on the newest. USD amounts are cents, truncated
toward zero.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from litestar import Controller, Request, get

from api.envelope import Reply, ok
from api.errors import BadRequest, Unprocessable
from api.gate.reads import available_xusd
from api.requests import account_in_context, read_signed
from api.runtime import Runtime
from writer.ops import Standing, StandingOp

__all__ = ["WalletController", "amounts"]

XUSD_PER_CENT = 10_000


def amounts(xusd: int) -> dict[str, str]:
    """xusd and USD cents (truncated toward zero), as integer strings.

    >>> amounts(-1_234_567)
    {'xusd': '-1234567', 'usd': '-123'}
    """
    cents = abs(xusd) // XUSD_PER_CENT
    return {"xusd": str(xusd), "usd": str(-cents if xusd < 0 else cents)}


def _grants(standing: Standing, now: datetime) -> list[dict[str, Any]]:
    in_force = sorted((eff, gid, amount) for gid, amount, eff in standing.grants
                      if datetime.fromisoformat(eff) <= now)
    left = standing.committed_xusd
    out = []
    for index, (eff, gid, amount) in enumerate(in_force):
        last = index == len(in_force) - 1
        used = left if last else min(max(left, 0), amount)
        left -= used
        out.append({"grant_id": gid, "status": "active", "on_ledger": True, "window_start": eff,
                    "issued": amounts(amount), "remaining": amounts(amount - used),
                    "consumed_xusd": str(used)})
    return out


class WalletController(Controller):
    path = "/mgt/v1/wallet"
    tags = ["wallet"]

    @get("/balance", operation_id="get_credit_balance")
    async def balance(self, request: Request[Any, Any, Any]) -> Reply:
        """The balance, holds, available funds and grants in force of the account in context."""
        runtime: Runtime = request.app.state.runtime
        ctx, raw = await read_signed(runtime, request)
        realm = runtime.realm(ctx)
        account = account_in_context(realm, ctx)
        if not account:
            raise BadRequest("VALIDATION.MISSING_CONTEXT",
                             "X-Billing-Account-Id (or X-Principal-Id) is required for the balance")
        if account not in realm.accounts:
            raise Unprocessable("RESOURCE.NOT_FOUND", f"unknown billing account {account!r}")
        standing: Standing = await runtime.write(StandingOp(realm.id, account, None))
        now = datetime.fromisoformat(standing.as_of)
        granted = sum(amount for _, amount, eff in standing.grants if datetime.fromisoformat(eff) <= now)
        balance = granted - standing.committed_xusd
        available = available_xusd(realm, account, standing, now)
        entry = realm.accounts[account]
        return ok({
            "billing_account_id": account,
            "billing_user_id": ctx.user_id or ctx.principal_id or "",
            "balances": amounts(available),
            "outstanding_balances": amounts(balance),
            "conversion": {"as_of": standing.as_of, "usd_per_xusd": "0.000001"},
            "grants": _grants(standing, now),
            "funding": entry.funding,
            "granted_xusd": str(granted),
            "committed_xusd": str(standing.committed_xusd),
            "balance_xusd": str(balance),
            "held_xusd": str(standing.held_xusd),
            "credit_limit_xusd": str(entry.credit_limit_xusd),
            "available_xusd": str(available),
        })
