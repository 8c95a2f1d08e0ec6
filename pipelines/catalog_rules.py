"""The rules a catalog keeps against the catalogs applied before it, beside the rules one
document keeps on its own (`pipelines.catalog`).

The ledger books a grant once, keyed by realm and grant id, and never changes it; so a grant
id, once applied in any earlier catalog (not only the last), may not come back with another
amount, effective_at or account. `grant_changes` names every grant that would: the caller
reads the applied documents (this module does no I/O) and refuses the catalog if any is named.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pipelines.catalog import Catalog, CatalogInvalid, Grant, load_catalog

__all__ = ["grant_changes"]


def _no_dsl_check(document: dict[str, Any]) -> list[tuple[str, str]]:
    # An applied document's rating DSL was validated when it was applied; only its grants
    # matter here, and compiling the DSL again would cost time for nothing.
    return []


def grant_changes(applied_documents: Iterable[str], catalog: Catalog) -> list[str]:
    """Every grant of `catalog` whose id an applied document gave another account, amount or
    effective_at, one fault a line with the grant's path; empty when `catalog` may be applied.

    `applied_documents` are the TOML texts applied before, oldest first: an id keeps what it
    was first applied with. A document that no longer loads is skipped (it cannot have been
    booked as it reads now)."""
    first: dict[tuple[str, str], tuple[str, Grant]] = {}
    for text in applied_documents:
        try:
            previous = load_catalog(text, dsl_validator=_no_dsl_check)
        except CatalogInvalid:
            continue
        for realm_id, realm in previous.realms.items():
            for account in realm.accounts.values():
                for grant in account.grants:
                    first.setdefault((realm_id, grant.id), (account.id, grant))
    faults: list[str] = []
    for realm_id, realm in catalog.realms.items():
        for account in realm.accounts.values():
            for i, grant in enumerate(account.grants):
                if (realm_id, grant.id) not in first:
                    continue
                old_account, old = first[(realm_id, grant.id)]
                where = f"realms.{realm_id}.accounts.{account.id}.grants[{i}]"
                if old_account != account.id:
                    faults.append(f"{where}: grant id {grant.id!r} was applied before to account"
                                  f" {old_account!r}; the ledger keeps it there; use a new id")
                elif (old.amount_xusd, old.effective_at) != (grant.amount_xusd, grant.effective_at):
                    faults.append(f"{where}: grant id {grant.id!r} was applied before with another"
                                  " amount or effective_at; use a new id")
    return faults
