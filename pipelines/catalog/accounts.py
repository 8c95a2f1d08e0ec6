"""The `accounts` section of a realm: billing accounts, their funding, the principals that
act for each (a principal belongs to one account) and the grants that fund them (a grant id
is unique in the realm)."""

from __future__ import annotations

from typing import Any

from pipelines.catalog.model import ID_PATTERN, Account, Grant
from pipelines.catalog.reader import FaultReader, RealmDraft

__all__ = ["read_accounts"]


def read_accounts(r: FaultReader, node: Any, path: str, realm: RealmDraft) -> None:
    accounts = realm.accounts
    principal_account = realm.principal_account
    grant_account: dict[str, str] = {}  # the ledger keys grants by (realm, id): one account per id
    for acct_id, a_node in r.table(node, path).items():
        a_path = f"{path}.{acct_id}"
        a_node = r.table(a_node, a_path)
        r.unknown_keys(a_node, a_path, ["funding", "credit_limit_xusd", "principals", "grants"])
        if not ID_PATTERN.fullmatch(acct_id):
            r.fault(a_path, "account id must be 1-128 chars of [A-Za-z0-9._:@/-]")
        funding = r.string(a_node, "funding", a_path, choices=("prepaid", "postpaid"))
        credit = r.integer_string(a_node, "credit_limit_xusd", a_path, default="0")
        principals = r.string_list(a_node, "principals", a_path) or ()
        for i, principal in enumerate(principals):
            if not ID_PATTERN.fullmatch(principal):
                r.fault(f"{a_path}.principals[{i}]", f"{principal!r} is not a valid principal id")
            elif principal in principal_account:
                if principal_account[principal] == acct_id:
                    continue  # already reported: "has repeated entries"
                r.fault(f"{a_path}.principals[{i}]",
                        f"principal {principal!r} already belongs to account {principal_account[principal]!r}")
            else:
                principal_account[principal] = acct_id
        grants: list[Grant] = []
        for i, g_node in enumerate(r.array_of_tables(a_node.get("grants"), f"{a_path}.grants")):
            g_path = f"{a_path}.grants[{i}]"
            r.unknown_keys(g_node, g_path, ["id", "amount_xusd", "effective_at"])
            gid = r.string(g_node, "id", g_path, pattern=ID_PATTERN)
            amount = r.integer_string(g_node, "amount_xusd", g_path)
            eff = r.instant(g_node, "effective_at", g_path)
            if gid is not None and gid in grant_account:
                where = "" if grant_account[gid] == acct_id else f" (also in account {grant_account[gid]!r})"
                r.fault(f"{g_path}.id", f"grant id {gid!r} is repeated{where}; grant ids are unique per realm")
            elif gid is not None:
                grant_account[gid] = acct_id
            if gid is not None and amount is not None and eff is not None:
                grants.append(Grant(gid, amount, eff))
        if funding is not None and credit is not None:
            accounts[acct_id] = Account(acct_id, funding, credit, principals, tuple(grants))
