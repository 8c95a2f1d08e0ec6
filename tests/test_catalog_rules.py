"""The catalog's rule against the catalogs applied before it: a grant id, once applied, keeps
its account, amount and effective_at (pipelines.catalog_rules), checked without a data folder."""

from __future__ import annotations

from pipelines.catalog import load_catalog
from pipelines.catalog_rules import grant_changes


def document(*accounts: tuple[str, str, str, str], realm: str = "acme") -> str:
    """A catalog of one realm; each account is (account id, grant id, amount, effective_at),
    an empty grant id for an account without a grant."""
    parts = []
    for account, grant, amount, effective_at in accounts:
        parts.append(f'[realms.{realm}.accounts.{account}]\nfunding = "prepaid"\n'
                     f'credit_limit_xusd = "0"\nprincipals = ["p-{account}"]\n')
        if grant:
            parts.append(f'[[realms.{realm}.accounts.{account}.grants]]\nid = "{grant}"\n'
                         f'amount_xusd = "{amount}"\neffective_at = "{effective_at}"\n')
    return "\n".join(parts)


AT = "2026-11-01T00:00:00Z"
FIRST = document(("a1", "welcome", "5", AT), ("a2", "", "", ""))


def test_a_catalog_with_nothing_applied_before_has_no_changes() -> None:
    assert grant_changes([], load_catalog(FIRST)) == []


def test_the_same_grant_again_is_no_change() -> None:
    assert grant_changes([FIRST], load_catalog(FIRST)) == []


def test_another_amount_or_effective_at_is_named_with_its_path() -> None:
    for changed in (document(("a1", "welcome", "9", AT)),
                    document(("a1", "welcome", "5", "2026-12-01T00:00:00Z"))):
        assert grant_changes([FIRST], load_catalog(changed)) == [
            "realms.acme.accounts.a1.grants[0]: grant id 'welcome' was applied before with"
            " another amount or effective_at; use a new id"]


def test_a_grant_moved_to_another_account_is_named() -> None:
    moved = document(("a1", "", "", ""), ("a2", "welcome", "5", AT))
    assert grant_changes([FIRST], load_catalog(moved)) == [
        "realms.acme.accounts.a2.grants[0]: grant id 'welcome' was applied before to account"
        " 'a1'; the ledger keeps it there; use a new id"]


def test_an_id_keeps_what_it_was_first_applied_with_even_when_a_later_catalog_left_it_out() -> None:
    without = document(("a1", "", "", ""))
    changed = document(("a1", "welcome", "9", AT))
    assert len(grant_changes([FIRST, without], load_catalog(changed))) == 1
    assert grant_changes([FIRST, without], load_catalog(FIRST)) == []


def test_grant_ids_are_per_realm() -> None:
    other_realm = document(("a1", "welcome", "9", AT), realm="globex")
    assert grant_changes([FIRST], load_catalog(other_realm)) == []


def test_an_applied_document_that_no_longer_loads_is_skipped() -> None:
    assert grant_changes(["not = [toml", FIRST], load_catalog(FIRST)) == []
