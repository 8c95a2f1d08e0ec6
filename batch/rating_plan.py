"""The rating plan: a catalog's policies and prices compiled into SQL that rates many events at once.

`RatingPlan.from_catalog(catalog)` reads every realm's policy versions and price rows once;
`install(conn)` creates two small temp tables on a DuckDB connection (the line catalog and
the prices of each line), and the SQL builders below then rate and price a relation of events
in one vectorized query each, never a Python loop. The aggregate engine's days are rated by
`batch.aggregate_days`, which prices its lines with the same builders.

Lines. `lines_sql(source)` gives one or more rows per event of `source`:

    event_id, realm, billing_account_id, occurred_at, line_key, quantity_minor

`line_key` names a row of the line catalog (`LINE_CATALOG`: status, policy_id, policy_version,
feature_code, meter_code, line_index), so the per-event work carries two integers and the
strings are joined once, when rows are written.

- The version of a policy applied to an event is the one with the greatest
  `effective_at <= occurred_at`. A realm's version table is a handful
  of rows known when the SQL is built, so this as-of join is compiled into a CASE over the
  versions in descending `effective_at`: no sort of the events.
- An event matched (type and `where`) by no policy in force gives one `skipped_no_policy` line;
  by two or more policies, one `quarantined` line per matched policy (nothing priced); by one
  single-engine policy, one `rated` line per (intent, meter) in document order; by one
  aggregate-engine policy, one `deferred` line: its usage is rated per account, event type and
  UTC day by the aggregate run once the day is closed.
- `line_index` numbers the rows of one event's rating: document order for rated lines, the
  policy's position in its realm for quarantined lines, 0 otherwise.

Every `{payload: ...}` and `{label: ...}` the policies read is extracted once per event (one
`json_transform` into a struct of JSON leaves, only for the event types whose policies read
them), and the compiled expressions read those columns instead; the integer and number
coercions of a path get a fast path for a JSON integer. The DSL's SQL otherwise parses the
document and runs its regular expressions again at every reference, which made parsing, not
rating, the cost of a sweep. The policies are compiled with a reader of this module's
(`_HoistingReader`, the compiler's `Reader` hook) that allocates a column for each path as
it is read and gives the coercions their fast path; `tests/test_rating_plan.py` holds the
result to `pipelines.rating.evaluate` and `pipelines.pricing.price_line` on random events,
and the benchmark's catalog to reading each path once.

Prices. `priced_sql(lines)` joins each rated line to the price row of its (realm, meter) in
force at its `occurred_at` (an interval join), and `amounts_sql(priced)` charges
`A(cum_after) - A(cum_before)`, with `cum` the running quantity of the (account, price row)
in `occurred_at` order (tie-break event_id, then line) and `A(x) = unit_price * R(x / unit)`:
exactly what `pricing.price_line` charges line by line from a carry of 0, block rounding
included. Integers only: BIGINT while nothing can overflow, HUGEINT beyond; a line with
no price row costs 0 with price_id NULL.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone

import duckdb

from pipelines.catalog import Catalog, Price
from pipelines.rating import (
    INLINE,
    JsonColumn,
    JsonPath,
    PolicyDoc,
    SqlValue,
    compile_intents,
    compile_match,
    json_path_sql,
    parse_policy,
)
from pipelines.rating.tree import EventField

__all__ = [
    "LINE_CATALOG",
    "LINE_PRICES",
    "PRICE_ROWS",
    "LineSpec",
    "PlannedPrice",
    "PlannedVersion",
    "RatingPlan",
    "amounts_sql",
    "described_sql",
    "line_id",
    "priced_line_id",
    "priced_sql",
    "sql_instant",
    "sql_text",
]

LINE_CATALOG = "_rating_line_catalog"
LINE_PRICES = "_rating_line_prices"
PRICE_ROWS = "_rating_price_rows"

# The choices of an event that are not a policy version.
_NO_POLICY = -1
_SEVERAL = -2
SKIPPED_LINE = 0  # the line key of `skipped_no_policy`

_FAR_FUTURE = "TIMESTAMPTZ 'infinity'"


def sql_text(text: str | None) -> str:
    """A SQL string literal (NULL for None); NUL travels as chr(0), as DuckDB wants it."""
    if text is None:
        return "CAST(NULL AS VARCHAR)"
    quoted = "'" + text.replace("'", "''") + "'"
    if "\x00" in text:
        return "(" + quoted.replace("\x00", "' || chr(0) || '") + ")"
    return quoted


def sql_instant(moment: datetime) -> str:
    """A TIMESTAMPTZ literal, exact to the microsecond."""
    utc = moment.astimezone(timezone.utc)
    return f"TIMESTAMPTZ '{utc.replace(tzinfo=None).isoformat(sep=' ', timespec='microseconds')}+00'"


@dataclass(frozen=True, slots=True)
class PlannedVersion:
    key: int  # plan-wide number of this (realm, policy, version)
    realm: str
    policy_id: str
    policy_index: int  # position of the policy in its realm
    version: str
    effective_at: datetime
    document: PolicyDoc


@dataclass(frozen=True, slots=True)
class PlannedPrice:
    key: int  # plan-wide number of this price row: the carry partition with the account
    realm: str
    meter_code: str
    price_id: str
    unit_price_xusd: int
    unit_quantity_minor: int
    rounding: str
    effective_at: datetime
    effective_until: datetime | None  # the next row's effective_at for the same meter


@dataclass(frozen=True, slots=True)
class LineSpec:
    """One row of the line catalog."""

    key: int
    realm: str | None
    status: str
    policy_id: str | None
    policy_version: str | None
    feature_code: str | None
    meter_code: str | None
    line_index: int


def line_id(spec: LineSpec) -> int:
    """The lake's id of a kind of rating line (`rating_line_kinds`): 63 bits of a BLAKE2b
    digest of what describes it, the same in every process and run."""
    text = json.dumps([spec.realm, spec.status, spec.policy_id, spec.policy_version,
                       spec.feature_code, spec.meter_code, spec.line_index], separators=(",", ":"))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1


def priced_line_id(spec: LineSpec, price: PlannedPrice | None) -> int:
    """The lake's id of a kind of line of `rating_lines`: a line kind with its price row
    (none for a line without one), 63 bits of a BLAKE2b digest like `line_id`."""
    text = json.dumps([spec.realm, spec.status, spec.policy_id, spec.policy_version,
                       spec.feature_code, spec.meter_code, spec.line_index,
                       None if price is None else price.price_id,
                       None if price is None else price.unit_price_xusd,
                       None if price is None else price.unit_quantity_minor],
                      separators=(",", ":"))
    return int.from_bytes(hashlib.blake2b(b"priced:" + text.encode(), digest_size=8).digest(),
                          "big") >> 1


# ---- reading the JSON once ------------------------------------------------------------------
# The text yyjson writes for a BIGINT or UBIGINT value (whatever the payload spelled), when it
# has at most 18 characters: then it always fits BIGINT, and the integer and number coercions
# would find exactly these digits with their regexes.
_JSON_INTEGER = sql_text("-?[0-9]{1,18}")


@dataclass
class _JsonReads:
    """The payload and label paths a plan's compiled SQL reads, each extracted once per event
    into a column `_j{i}` holding the JSON text of its value (NULL when missing), with the
    event types that read each path (other events skip the work), and the event fields read.

    `reader(event_type)` is the `Reader` that compiles the policies of an event type against
    those columns, allocating one the first time a path is read; once every policy is
    compiled, `layers()` computes them."""

    paths: dict[tuple[JsonColumn, JsonPath], int] = field(default_factory=dict)
    readers: dict[int, set[str]] = field(default_factory=dict)
    fields: set[EventField] = field(default_factory=set)

    def reader(self, event_type: str) -> _HoistingReader:
        return _HoistingReader(self, event_type)

    def leaf(self, column: JsonColumn, path: JsonPath, event_type: str) -> str:
        """The column holding the JSON text of `path` of `column`, read for `event_type`."""
        index = self.paths.setdefault((column, path), len(self.paths))
        self.readers.setdefault(index, set()).add(event_type)
        return f"_j{index}"

    def _trees(self) -> Iterator[tuple[JsonColumn, list[tuple[int, JsonPath]], dict[str, object],
                                       dict[int, list[str]], set[int]]]:
        """Per column read: (column, its (index, path)s, json_transform structure, keys of
        each path read from it, paths read otherwise); see `layers`."""
        columns: tuple[JsonColumn, ...] = ("payload", "labels")
        for column in columns:
            mine = sorted((i, path) for (col, path), i in self.paths.items() if col == column)
            if mine:
                yield (column, mine, *_object_tree(mine))

    def layers(self) -> list[str]:
        """The select lists that add the `_j{i}` columns, innermost first.

        Paths of object keys only are read with one `json_transform` into a struct of JSON
        leaves (one parse, the cheapest read measured here); a path with an array index, a
        key that is also a leaf's parent, keys equal but for case (struct fields are matched
        without case) or a key with NUL (which a field name in SQL text cannot hold) is read
        with one `json_extract` over a list of paths."""
        extract: list[str] = []
        reads: list[str] = []
        for column, mine, tree, leaves, listed in self._trees():
            types: set[str] = set()
            for i, _ in mine:
                types |= self.readers.get(i, set())
            guard = _type_in(types)
            if tree:
                structure = sql_text(json.dumps(tree, separators=(",", ":")))
                extract.append(f"CASE WHEN {guard} THEN json_transform({column}, {structure}) END"
                               f" AS _{column}_tree")
                for i, keys in leaves.items():
                    leaf = f"_{column}_tree" + "".join(_field(k) for k in keys)
                    reads.append(f"CAST({leaf} AS VARCHAR) AS _j{i}")
            if listed:
                paths = ", ".join(json_path_sql(path) for i, path in mine if i in listed)
                extract.append(f"CASE WHEN {guard} THEN CAST(json_extract({column}, [{paths}])"
                               f" AS VARCHAR[]) END AS _{column}_leaves")
                for position, i in enumerate(sorted(listed), start=1):
                    reads.append(f"_{column}_leaves[{position}] AS _j{i}")
        return [", ".join(part) for part in (extract, reads) if part]


@dataclass(frozen=True, slots=True)
class _HoistingReader:
    """The `Reader` of the rating plan: the policies of `event_type` read each payload or
    label path from its `_j{i}` column of `reads`.

    A JSON integer of up to 18 characters is cast straight from that text; `json_type` /
    `json_extract_string` of it (the coercion rules' inputs) run only for other values,
    inline in the CASE's other branch: computed for every path of every event they had cost
    the sweep's query more than all of its JSON parsing."""

    reads: _JsonReads
    event_type: str

    def json(self, column: JsonColumn, path: JsonPath) -> SqlValue:
        leaf = self.reads.leaf(column, path, self.event_type)
        return SqlValue(f"NULLIF(json_type({leaf}), 'NULL')", f"json_extract_string({leaf}, '$')")

    def field(self, name: EventField) -> SqlValue:
        self.reads.fields.add(name)
        return INLINE.field(name)

    def integer(self, column: JsonColumn, path: JsonPath, coerced: str) -> str:
        return self._integer_first(column, path, coerced, "BIGINT")

    def number(self, column: JsonColumn, path: JsonPath, coerced: str) -> str:
        return self._integer_first(column, path, coerced, "DOUBLE")

    def _integer_first(self, column: JsonColumn, path: JsonPath, coerced: str, cast: str) -> str:
        leaf = self.reads.leaf(column, path, self.event_type)
        return (f"(CASE WHEN regexp_full_match({leaf}, {_JSON_INTEGER}) THEN CAST({leaf} AS {cast})"
                f" ELSE {coerced} END)")


def _object_tree(paths: list[tuple[int, JsonPath]]
                 ) -> tuple[dict[str, object], dict[int, list[str]], set[int]]:
    """(json_transform structure, keys of each path read from it, paths read otherwise)."""
    tree: dict[str, object] = {}
    leaves: dict[int, list[str]] = {}
    listed: set[int] = set()
    for index, parts in sorted(paths, key=lambda item: len(item[1])):
        if not parts or not all(isinstance(part, str) and "\x00" not in part for part in parts):
            listed.add(index)
            continue
        keys = [str(part) for part in parts]
        node: dict[str, object] = tree
        fits = True
        for depth, key in enumerate(keys):
            same_but_case = [k for k in node if k.lower() == key.lower() and k != key]
            child = node.get(key)
            last = depth == len(keys) - 1
            if same_but_case or child == "JSON" or (last and child is not None):
                fits = False
                break
            if last:
                node[key] = "JSON"
            else:
                node = node.setdefault(key, {})  # type: ignore[assignment]
        if fits:
            leaves[index] = keys
        else:
            listed.add(index)
    return _prune(tree), leaves, listed


def _prune(node: dict[str, object]) -> dict[str, object]:
    """Drop objects left empty by a path that did not fit."""
    kept: dict[str, object] = {}
    for key, child in node.items():
        if child == "JSON":
            kept[key] = child
        elif isinstance(child, dict) and (inner := _prune(child)):
            kept[key] = inner
    return kept


def _field(key: str) -> str:
    return '."' + key.replace('"', '""') + '"'


def _type_in(types: Iterable[str]) -> str:
    names = sorted(types)
    if not names:
        return "FALSE"
    return f"event_type IN ({', '.join(sql_text(t) for t in names)})"


# ---- the plan -------------------------------------------------------------------------------
class RatingPlan:
    """The policies and prices of a catalog, ready to be compiled into rating SQL."""

    def __init__(self, versions: Iterable[PlannedVersion], prices: Iterable[PlannedPrice],
                 params: Mapping[str, object] | None = None) -> None:
        self.versions = tuple(versions)
        self.prices = tuple(prices)
        self.params = params
        self.lines = self._line_specs()

    @classmethod
    def from_catalog(cls, catalog: Catalog) -> RatingPlan:
        versions: list[PlannedVersion] = []
        prices: list[PlannedPrice] = []
        for realm_id in sorted(catalog.realms):
            realm = catalog.realms[realm_id]
            for policy_index, policy_id in enumerate(sorted(realm.policies)):
                for version in realm.policies[policy_id].versions:
                    versions.append(PlannedVersion(
                        key=len(versions), realm=realm_id, policy_id=policy_id,
                        policy_index=policy_index, version=version.version,
                        effective_at=version.effective_at,
                        document=parse_policy(version.document)))
            by_meter: dict[str, list[Price]] = {}
            for price in realm.prices:
                by_meter.setdefault(price.meter, []).append(price)
            for meter, rows in sorted(by_meter.items()):
                rows.sort(key=lambda p: p.effective_at)
                for i, row in enumerate(rows):
                    until = rows[i + 1].effective_at if i + 1 < len(rows) else None
                    prices.append(PlannedPrice(
                        key=len(prices), realm=realm_id, meter_code=meter, price_id=row.price_id,
                        unit_price_xusd=row.unit_price_xusd,
                        unit_quantity_minor=row.unit_quantity_minor, rounding=row.rounding,
                        effective_at=row.effective_at, effective_until=until))
        return cls(versions, prices)

    # ---- the line catalog -----------------------------------------------------------------
    def _line_specs(self) -> list[LineSpec]:
        specs = [LineSpec(SKIPPED_LINE, None, "skipped_no_policy", None, None, None, None, 0)]
        self._rated: dict[int, list[int]] = {}
        self._quarantined: dict[int, int] = {}
        self._deferred: dict[int, int] = {}
        self._aggregate_lines: dict[tuple[int, int, int], int] = {}
        for version in self.versions:
            head = (version.realm, version.policy_id, version.version)
            self._quarantined[version.key] = len(specs)
            specs.append(LineSpec(len(specs), head[0], "quarantined", head[1], head[2], None, None,
                                  version.policy_index))
            if version.document.engine == "aggregate":
                self._deferred[version.key] = len(specs)
                specs.append(LineSpec(len(specs), head[0], "deferred", head[1], head[2], None,
                                      None, 0))
            keys: list[int] = []
            position = 0
            for intent_index, intent in enumerate(version.document.intents):
                for meter_index, meter in enumerate(intent.meters):
                    if version.document.engine == "aggregate":
                        self._aggregate_lines[(version.key, intent_index, meter_index)] = len(specs)
                    else:
                        keys.append(len(specs))
                    specs.append(LineSpec(len(specs), head[0], "rated", head[1], head[2],
                                          intent.feature_code, meter.meter_code, position))
                    position += 1
            self._rated[version.key] = keys
        return specs

    def priced_kinds(self) -> tuple[list[tuple[object, ...]], dict[int, int]]:
        """The kinds of `rating_lines` this plan can write, and their ids by line.

        Returns (rows for lake.rating_line_kinds: line_id, status, policy_id, policy_version,
        feature_code, meter_code, line_index, price_id, unit_price_xusd, unit_quantity_minor;
        ids), where `ids[line_key * (len(prices) + 1) + price_key + 1]` is the kind of a line
        (price_key -1 for a line without a price row; no entry for a pair no line can have:
        a line only meets its own realm and meter's price rows)."""
        width = len(self.prices) + 1
        ids: dict[int, int] = {}
        rows: list[tuple[object, ...]] = []
        for spec in self.lines:
            options: list[PlannedPrice | None] = [None]
            if spec.status == "rated":
                options += [p for p in self.prices
                            if (p.realm, p.meter_code) == (spec.realm, spec.meter_code)]
            for price in options:
                kind = priced_line_id(spec, price)
                ids[spec.key * width + (0 if price is None else price.key + 1)] = kind
                rows.append((kind, spec.status, spec.policy_id, spec.policy_version,
                             spec.feature_code, spec.meter_code, spec.line_index,
                             None if price is None else price.price_id,
                             None if price is None else price.unit_price_xusd,
                             None if price is None else price.unit_quantity_minor))
        return rows, ids

    def price_terms(self) -> list[tuple[int, int, int, int, int | None]]:
        """(unit_price, unit_quantity, a, b, d) of each price row, by price key."""
        return [(p.unit_price_xusd, p.unit_quantity_minor, *_rounding_terms(p)) for p in self.prices]

    def aggregate_line_key(self, version: int, intent_index: int, meter_index: int) -> int:
        return self._aggregate_lines[(version, intent_index, meter_index)]

    def install(self, conn: duckdb.DuckDBPyConnection) -> None:
        """Create the line catalog and the prices per line as temp tables on `conn`."""
        conn.execute(
            f"CREATE OR REPLACE TEMP TABLE {LINE_CATALOG} (line_key INTEGER, status VARCHAR,"
            " policy_id VARCHAR, policy_version VARCHAR, feature_code VARCHAR,"
            " meter_code VARCHAR, line_index INTEGER, line_id BIGINT)")
        insert_rows(conn, LINE_CATALOG,
                     [(s.key, s.status, s.policy_id, s.policy_version, s.feature_code,
                       s.meter_code, s.line_index, line_id(s)) for s in self.lines])
        conn.execute(
            f"CREATE OR REPLACE TEMP TABLE {PRICE_ROWS} (price_key INTEGER, price_id VARCHAR,"
            " unit_price_xusd BIGINT, unit_quantity_minor BIGINT, _a BIGINT, _b BIGINT, _d BIGINT)")
        insert_rows(conn, PRICE_ROWS,
                     [(p.key, p.price_id, p.unit_price_xusd, p.unit_quantity_minor,
                       *_rounding_terms(p)) for p in self.prices])
        conn.execute(
            f"CREATE OR REPLACE TEMP TABLE {LINE_PRICES} (line_key INTEGER, price_key INTEGER,"
            " effective_at TIMESTAMPTZ, effective_until TIMESTAMPTZ)")
        rows = [(spec.key, price.key, price.effective_at, price.effective_until)
                for spec in self.lines if spec.status == "rated"
                for price in self.prices
                if (price.realm, price.meter_code) == (spec.realm, spec.meter_code)]
        insert_rows(conn, LINE_PRICES, rows)
        # The latest row is in force for ever: an open end would turn the join's range
        # condition into an OR, which DuckDB can only run as a nested loop.
        conn.execute(f"UPDATE {LINE_PRICES} SET effective_until = {_FAR_FUTURE}"
                     " WHERE effective_until IS NULL")

    # ---- policies -------------------------------------------------------------------------
    def policies(self) -> dict[tuple[str, str], list[PlannedVersion]]:
        """Versions per (realm, policy), in ascending effective_at."""
        grouped: dict[tuple[str, str], list[PlannedVersion]] = {}
        for version in self.versions:
            grouped.setdefault((version.realm, version.policy_id), []).append(version)
        for versions in grouped.values():
            versions.sort(key=lambda v: v.effective_at)
        return grouped

    def _matched(self, realm: str, versions: list[PlannedVersion], reads: _JsonReads) -> str:
        """The key of the policy's version in force at occurred_at when it matches, else NULL."""
        types = {v.document.match.event_type for v in versions}
        branches = []
        for version in sorted(versions, key=lambda v: v.effective_at, reverse=True):
            match = compile_match(version.document, self.params,
                                  reads.reader(version.document.match.event_type))
            branches.append(f"WHEN occurred_ts >= {sql_instant(version.effective_at)}"
                            f" THEN CASE WHEN {match} THEN {version.key} END")
        return (f"CASE WHEN realm <> {sql_text(realm)} OR NOT ({_type_in(types)}) THEN NULL"
                f" {' '.join(branches)} END")

    def _price_case(self, line_key: int) -> str:
        """The key of the price row of rated line `line_key` in force at occurred_ts (NULL
        before the first): `priced_sql`'s interval join, as a CASE over the meter's rows."""
        spec = self.lines[line_key]
        rows = sorted((p for p in self.prices if (p.realm, p.meter_code) == (spec.realm, spec.meter_code)),
                      key=lambda p: p.effective_at, reverse=True)
        if not rows:
            return "NULL"
        branches = " ".join(f"WHEN occurred_ts >= {sql_instant(p.effective_at)} THEN {p.key}"
                            for p in rows)
        return f"CASE {branches} END"

    def _line_items(self, version: PlannedVersion, reads: _JsonReads) -> list[tuple[str, str, str]]:
        """(line key, quantity, price key) SQL of each line an event matched by `version` gets."""
        if version.document.engine == "aggregate":
            return [(str(self._deferred[version.key]), "NULL", "NULL")]
        keys = iter(self._rated[version.key])
        items = []
        reader = reads.reader(version.document.match.event_type)
        for intent in compile_intents(version.document, self.params, reader):
            for _, quantity in intent.meters:
                key = next(keys)
                items.append((str(key), quantity, self._price_case(key)))
        return items

    def _rated_layer(self, source: str, reads: _JsonReads,
                     items: Callable[[_JsonReads], str]) -> tuple[str, str]:
        """(the innermost layers of a rating query over `source`, up to `_choice`: the key of
        the one version that matched, `_NO_POLICY` or `_SEVERAL`; `items(reads)`). Both the
        matches and the items are compiled before the layers are built: the layers extract
        the paths their reads allocated in `reads`."""
        policies = self.policies()
        names = {key: f"_m{i}" for i, key in enumerate(policies)}
        matched = {key: self._matched(key[0], versions, reads) for key, versions in policies.items()}
        if names:
            count = " + ".join(f"CAST({n} IS NOT NULL AS INTEGER)" for n in names.values())
            choice = (f"CASE WHEN ({count}) = 0 THEN {_NO_POLICY} WHEN ({count}) > 1"
                      f" THEN {_SEVERAL} ELSE coalesce({', '.join(names.values())}) END")
        else:
            choice = str(_NO_POLICY)
        rated = items(reads)
        # The text of occurred_at is computed only when a policy reads {event: occurred_at}:
        # formatting it for every event cost a sixth of a sweep.
        wants_text = "occurred_at" in reads.fields
        occurred_text = (", strftime(occurred_at AT TIME ZONE 'UTC', '%Y-%m-%dT%H:%M:%S.%fZ')"
                         " AS occurred_at" if wants_text else "")
        layer = (
            "SELECT event_id, realm, billing_account_id, semantic_kind, event_type,"
            f" occurred_at AS occurred_ts{occurred_text},"
            " subject_ref, CAST(payload AS VARCHAR) AS payload, CAST(labels AS VARCHAR) AS labels"
            f" FROM {source}"
        )
        for select in reads.layers():
            layer = f"SELECT *, {select} FROM ({layer})"
        if names:
            columns = ", ".join(f"{matched[key]} AS {name}" for key, name in names.items())
            layer = f"SELECT *, {columns} FROM ({layer})"
        return f"SELECT *, {choice} AS _choice FROM ({layer})", rated

    def _several(self) -> str:
        """The `_SEVERAL` events' list of matched version keys."""
        names = [f"_m{i}" for i in range(len(self.policies()))]
        return f"list_filter([{', '.join(names)}], v -> v IS NOT NULL)"

    def _quarantine_case(self, value: str) -> str:
        keys = " ".join(f"WHEN {key} THEN {line}" for key, line in self._quarantined.items())
        return f"CASE {value} {keys} END"

    def slot_count(self) -> int:
        """The most lines one event can get from `slots_sql`."""
        most = max((len(self._rated[v.key]) if v.document.engine != "aggregate" else 1
                    for v in self.versions), default=1)
        policies = len(self.policies())
        return max(most, policies if policies > 1 else 1, 1)

    def slot_columns(self) -> list[str]:
        """The slot columns of `slots_sql`, in order: `k{j}` for every slot; `q{j}` only when
        some policy can put a quantity in slot j, `p{j}` only when such a line's meter has
        prices (a column that would always be NULL is left out: the sweep stages them all)."""
        names: list[str] = []
        for j in range(self.slot_count()):
            names.append(f"k{j}")
            rated = [self._rated[v.key][j] for v in self.versions
                     if v.document.engine != "aggregate" and len(self._rated[v.key]) > j]
            if rated:
                names.append(f"q{j}")
            if any(self._price_case(key) != "NULL" for key in rated):
                names.append(f"p{j}")
        return names

    def _slot_types(self) -> dict[str, tuple[str, int]]:
        """(SQL type, bytes) of the `k`, `q` and `p` slot columns: keys are SMALLINT while the
        plan has fewer than 2^15 lines and prices."""
        def key(count: int) -> tuple[str, int]:
            return ("SMALLINT", 2) if count < 2 ** 15 else ("INTEGER", 4)
        return {"k": key(len(self.lines)), "q": ("BIGINT", 8), "p": key(len(self.prices))}

    def slot_bytes(self) -> int:
        """The width in bytes of one event's `slot_columns()` as `slots_sql` types them."""
        types = self._slot_types()
        return sum(types[name[0]][1] for name in self.slot_columns())

    def slots_sql(self, source: str) -> str:
        """One row per event of `source`: event_id, realm, billing_account_id, occurred_at,
        then the `slot_columns()`: for each slot j < `slot_count()` the j-th line of the
        event, if it has one: `k{j}` line_key (NULL: no such line), `q{j}` quantity_minor,
        `p{j}` price key (the row in force at occurred_at, what `priced_sql` adds to a line;
        NULL without one). Lines fill slots in order from 0. Plain columns, not a list: they
        cost less to compute, to stage and to hand to Arrow. Keys are narrow while they can
        be (`_slot_types`: a staged event of the benchmark's mix is 12 bytes smaller)."""
        slots = self.slot_count()
        wanted = set(self.slot_columns())
        types = self._slot_types()
        reads = _JsonReads()

        def columns(reads: _JsonReads) -> str:
            per_slot: list[list[tuple[str, str, str, str]]] = [[] for _ in range(slots)]
            for version in self.versions:
                for j, item in enumerate(self._line_items(version, reads)):
                    per_slot[j].append((str(version.key), *item))
            several = self._several()
            out = []
            for j in range(slots):
                branches = per_slot[j]
                k = [f"WHEN {v} THEN {key}" for v, key, _, _ in branches]
                q = [f"WHEN {v} THEN {quantity}" for v, _, quantity, _ in branches if quantity != "NULL"]
                p = [f"WHEN {v} THEN {price}" for v, _, _, price in branches if price != "NULL"]
                if j == 0:
                    k.insert(0, f"WHEN {_NO_POLICY} THEN {SKIPPED_LINE}")
                if self.versions and len(self.policies()) > 1:
                    k.insert(0, f"WHEN {_SEVERAL} THEN {self._quarantine_case(f'{several}[{j + 1}]')}")
                out.append(f"CAST(CASE _choice {' '.join(k)} END AS {types['k'][0]}) AS k{j}")
                if f"q{j}" in wanted:
                    out.append(f"CAST(CASE _choice {' '.join(q)} END AS {types['q'][0]}) AS q{j}")
                if f"p{j}" in wanted:
                    out.append(f"CAST(CASE _choice {' '.join(p)} END AS {types['p'][0]}) AS p{j}")
            return ", ".join(out)

        layer, rated = self._rated_layer(source, reads, columns)
        return (f"SELECT event_id, realm, billing_account_id, occurred_ts AS occurred_at, {rated}"
                f" FROM ({layer})")

    def lines_sql(self, source: str) -> str:
        """Rating lines of the events of `source` (columns event_id, realm, billing_account_id,
        semantic_kind, event_type, occurred_at TIMESTAMPTZ, subject_ref, payload, labels):
        event_id, realm, billing_account_id, occurred_at, line_key, quantity_minor. The sweep
        reads `slots_sql` instead, one row per event."""
        reads = _JsonReads()

        def line_list(reads: _JsonReads) -> str:
            # No price key: callers join the prices in force (`priced_sql`).
            cases = [f"WHEN {_NO_POLICY} THEN [{{'k': {SKIPPED_LINE}, 'q': NULL}}]"]
            if self.versions:
                cases.append(
                    f"WHEN {_SEVERAL} THEN list_transform({self._several()},"
                    f" v -> {{'k': {self._quarantine_case('v')}, 'q': NULL}})")
            for version in self.versions:
                items = ", ".join(f"{{'k': {k}, 'q': {q}}}"
                                  for k, q, _ in self._line_items(version, reads))
                cases.append(f"WHEN {version.key} THEN [{items}]")
            return ("CAST(CASE _choice " + " ".join(cases) + " END"
                    " AS STRUCT(k INTEGER, q BIGINT)[])")

        layer, lines = self._rated_layer(source, reads, line_list)
        unnested = (f"SELECT event_id, realm, billing_account_id, occurred_ts,"
                    f" unnest({lines}) AS _line FROM ({layer})")
        return (
            "SELECT event_id, realm, billing_account_id, occurred_ts AS occurred_at,"
            f" _line.k AS line_key, _line.q AS quantity_minor FROM ({unnested})"
        )


def insert_rows(conn: duckdb.DuckDBPyConnection, table: str, rows: Sequence[tuple[object, ...]],
                columns: str | None = None) -> None:
    """INSERT the rows (into `columns` when given) in statements of up to 200 rows
    (executemany runs one statement a row, a few milliseconds each)."""
    target = f"{table} ({columns})" if columns else table
    for first in range(0, len(rows), 200):
        batch = rows[first:first + 200]
        marks = ", ".join("(" + ", ".join("?" for _ in batch[0]) + ")" for _ in batch)
        conn.execute(f"INSERT INTO {target} VALUES {marks}", [v for row in batch for v in row])


# ---- prices ---------------------------------------------------------------------------------
def priced_sql(lines: str) -> str:
    """The lines of relation `lines` (columns line_key, occurred_at, quantity_minor, and any
    others, which are kept) plus `price_key`: the price row of their line in force at
    occurred_at (NULL without one). `amounts_sql` brings the row's terms."""
    return (
        "SELECT l.*, p.price_key"
        f" FROM {lines} AS l LEFT JOIN {LINE_PRICES} AS p ON p.line_key = l.line_key"
        " AND l.occurred_at >= p.effective_at AND l.occurred_at < p.effective_until"
    )


def _rounding_terms(price: PlannedPrice) -> tuple[int, int, int | None]:
    """(a, b, d) with R(x / u) = (a * x + b) // d: (1, 0, u) floor, (1, u - 1, u) ceil and
    (2, u, 2u) nearest; d is None when it would not fit BIGINT (the SQL then divides in
    HUGEINT)."""
    u = price.unit_quantity_minor
    a, b = {"floor": (1, 0), "ceil": (1, u - 1)}.get(price.rounding, (2, u))
    return a, b, (a * u if u < 2 ** 61 else None)


def amounts_sql(priced: str, order: str) -> str:
    """`priced` (a relation from `priced_sql`, with billing_account_id) plus the price row's
    price_id, unit_price_xusd, unit_quantity_minor, and amount_xusd.

    `order` lists the columns that order lines inside an (account, price row) after
    occurred_at, e.g. "event_id, line_key"."""
    # One window over every line, with only the lines' own columns: the price row's terms
    # are joined after it, so the sort carries no strings it does not need. Lines of a
    # one-unit block need no running sum (A is linear there), but splitting them off took
    # materializing the lines for two branches, which cost more than sorting them with the
    # rest (for 1.6 M lines: 1.41-1.48 s now, 1.93-1.98 s split, 1.70-1.74 s joined first).
    after = ("sum(quantity_minor) OVER (PARTITION BY billing_account_id, price_key"
             f" ORDER BY occurred_at, {order} ROWS UNBOUNDED PRECEDING)")
    # Below 2^61 everything fits BIGINT, whose division is far cheaper than HUGEINT's;
    # beyond, the same formula runs in HUGEINT.
    small = ("CAST(r.unit_price_xusd AS HUGEINT) * ((r._a * CAST(w._after AS BIGINT) + r._b) // r._d"
             " - (r._a * CAST(w._after - w.quantity_minor AS BIGINT) + r._b) // r._d)")
    d = "(r._a * CAST(r.unit_quantity_minor AS HUGEINT))"
    big = (f"CAST(r.unit_price_xusd AS HUGEINT) * ((r._a * w._after + r._b) // {d}"
           f" - (r._a * (w._after - w.quantity_minor) + r._b) // {d})")
    amount = (
        "CASE WHEN w.quantity_minor IS NULL THEN NULL WHEN w.price_key IS NULL THEN 0"
        " WHEN r.unit_quantity_minor <= 1 THEN CAST(r.unit_price_xusd AS HUGEINT) * w.quantity_minor"
        f" WHEN r._d IS NOT NULL AND w._after < {2 ** 61} THEN {small} ELSE {big} END"
    )
    return (
        "SELECT w.* EXCLUDE (_after), r.price_id, r.unit_price_xusd, r.unit_quantity_minor,"
        f" CAST({amount} AS BIGINT) AS amount_xusd"
        f" FROM (SELECT *, {after} AS _after FROM {priced}) AS w"
        f" LEFT JOIN {PRICE_ROWS} AS r ON r.price_key = w.price_key"
    )


def described_sql(lines: str) -> str:
    """`lines` (with line_key) plus the line catalog's status, policy_id, policy_version,
    feature_code, meter_code and line_index."""
    return (
        "SELECT l.*, c.status, c.policy_id, c.policy_version, c.feature_code, c.meter_code,"
        f" c.line_index FROM {lines} AS l JOIN {LINE_CATALOG} AS c ON c.line_key = l.line_key"
    )
