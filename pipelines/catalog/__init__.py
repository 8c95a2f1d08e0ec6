"""The catalog: realms, billing accounts, principals, features, meters, prices, limits and
rating policies, parsed from one TOML document and validated whole.

`load_catalog(text)` returns a `Catalog` or raises `CatalogInvalid` carrying every fault, each
with the dotted path of the value at fault, so an operator fixes a catalog in one pass.
Money and quantities are integer strings in the document and `int` here; no float is read.

    model           the frozen values a catalog is made of; the id and code patterns
    reader          faults, the fault-collecting reader of TOML values, a realm's draft
    load            `load_catalog`: the document, its realms, each realm's sections in order
    realm_settings, accounts, features, prices, limits, policies
                    one reader per section, all of one shape (`reader.SectionReader`)

The names below are the package's public face: import them from `pipelines.catalog`.
"""

from __future__ import annotations

from pipelines.catalog.load import load_catalog
from pipelines.catalog.model import (
    CODE_PATTERN,
    ID_PATTERN,
    Account,
    Budget,
    Catalog,
    Feature,
    Grant,
    Meter,
    Policy,
    PolicyVersion,
    Price,
    Quota,
    RateLimit,
    Realm,
    RealmSettings,
)
from pipelines.catalog.reader import CatalogFault, CatalogInvalid, DslValidator

__all__ = [
    "Account",
    "Budget",
    "Catalog",
    "CatalogFault",
    "CatalogInvalid",
    "DslValidator",
    "Feature",
    "Grant",
    "Meter",
    "Policy",
    "PolicyVersion",
    "Price",
    "Quota",
    "RateLimit",
    "Realm",
    "RealmSettings",
    "CODE_PATTERN",
    "ID_PATTERN",
    "load_catalog",
]
