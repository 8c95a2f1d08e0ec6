"""`tollgate catalog check|apply FILE`: validate a catalog, or validate and apply it.

This module owns applying a catalog to a data folder (`apply_catalog`, which `serve` also uses
for the demo catalog): the lock that makes one apply at a time, reading the catalogs applied
before (for the grant-id rule of `pipelines.catalog_rules`), and the lake's record first.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from cyclopts import App, Parameter

from cli.shared import OPTIONS, CommandError, DataDir
from core.settings import Settings

if TYPE_CHECKING:
    from warehouse.catalog_store import CatalogStore

__all__ = ["app", "apply_catalog"]

app = App(name="catalog", help="Check or apply a catalog.",
          group_parameters=OPTIONS)

CatalogFile = Annotated[str, Parameter(metavar="FILE", help="the catalog, a TOML file")]


def _read(file: str) -> str:
    try:
        return Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CommandError(f"cannot read the catalog {file}: {exc}", 2) from None


@app.command(sort_key=1)
def check(file: CatalogFile, /, *, data_dir: DataDir = None) -> int:
    """Validate a catalog whole; every fault is named with its path.

    Nothing is applied. Exit code 0 when it is valid, 1 when it is not.
    """
    from pipelines.catalog import CatalogInvalid, load_catalog

    text = _read(file)
    try:
        catalog = load_catalog(text)
    except CatalogInvalid as exc:
        print(f"catalog {file} is invalid ({len(exc.faults)} faults):", file=sys.stderr)
        print("\n".join(f"  {f}" for f in exc.faults), file=sys.stderr)
        return 1
    print(f"catalog {file} is valid (fingerprint {catalog.fingerprint}, "
          f"realms: {', '.join(sorted(catalog.realms))})")
    return 0


@app.command(sort_key=2)
def apply(file: CatalogFile, /, *, data_dir: DataDir = None) -> int:
    """Validate a catalog and apply it atomically.

    The lake's catalog history records it first: nothing is applied if the
    lake cannot record it. A running service picks it up within 2 s; the flows
    rate under the catalog the lake recorded last. Exit code 1 when it was not
    applied.
    """
    text = _read(file)
    ok, message = apply_catalog(Settings.from_env(data_dir), text)
    print(message if ok else f"catalog {file} was not applied:\n{message}",
          file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def apply_catalog(settings: Settings, text: str) -> tuple[bool, str]:
    """Validate a whole catalog and apply it atomically; the message names every fault."""
    from pipelines.catalog import CatalogInvalid, load_catalog
    from pipelines.catalog_rules import grant_changes
    from warehouse.catalog_store import CatalogStore

    try:
        catalog = load_catalog(text)
    except CatalogInvalid as exc:
        return False, "\n".join(f"  {f}" for f in exc.faults)
    store = CatalogStore(settings.catalog_dir)
    # One apply at a time: another one between our check of the grants and our switch could
    # bring a grant id back changed, or leave the lake and the service on different catalogs.
    with store.locked():
        faults = grant_changes(_applied_documents(store), catalog)
        if faults:
            return False, "\n".join(f"  {f}" for f in faults)
        from warehouse.catalog_history import record_catalog  # DuckDB loads only when applying

        # The lake first: the flows rate under the catalog the lake records last, so a catalog
        # the lake could not record is not applied at all (the service keeps the one before).
        try:
            record_catalog(settings.data_dir, catalog)
        except Exception as exc:  # noqa: BLE001 (any failure: nothing is applied, say why)
            return False, f"  the lake could not record the catalog, so it was not applied: {exc}"
        store.apply(text, catalog.fingerprint)
    realms = ", ".join(sorted(catalog.realms)) or "(none)"
    return True, f"catalog {catalog.fingerprint} applied (realms: {realms})"


def _applied_documents(store: CatalogStore) -> list[str]:
    """Every catalog applied to this data folder, oldest first (the history, then the current
    document in case it predates the history)."""
    history = store.folder / "history"
    texts = [p.read_text(encoding="utf-8") for p in sorted(history.glob("*.toml"))] if history.is_dir() else []
    current = store.read()
    if current is not None:
        texts.append(current)
    return texts
