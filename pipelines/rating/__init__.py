"""Rating DSL v1, a compiler in miniature: parse -> validate -> compile to DuckDB SQL | evaluate.

`parse` loads a policy document into the typed tree of `tree`; `evaluate` is the reference
semantics in Python; `compile_sql` produces DuckDB SQL that agrees with it on every input.
Loading: `validate_policy(doc)` returns every fault (empty = valid), `parse_policy(doc)` raises
`DslErrors` carrying that list; each `DslError` has a path such as `$.match.where.all[1].gt[0]`.

Decisions taken where the wire contract (section 5) is silent:

Document
- `engine` is required. `params` maps names to literals (string, finite number, boolean); a
  `{param}` must be declared there, and params passed at rating time may only override declared
  names, with literals. Nesting deeper than 32 predicates or integer expressions is refused.
- `emit.intents` and each intent's `meters` are non-empty lists; a meter appears at most once
  in an intent. Intent `labels` are static
  string-to-string objects, copied onto each intent. Codes match
  `^[a-z0-9][a-z0-9._/@:-]{0,126}[a-z0-9]$|^[a-z0-9]$`.
- The single engine refuses `agg`; the aggregate engine reads events only through `agg`
  (`payload_int`/`label_int` are refused there; `const`, `mul`, `div` combine aggregates).

Values
- Strings (literals, paths, label keys, event types, params) must be valid Unicode: a lone
  surrogate, which JSON text can escape, is refused.
- Literals are strings, finite numbers (integers within signed 64-bit) and booleans; JSON null
  is not a literal (use `not exists`). JSON null and a missing path are the same: absent.
- `{payload: "a.b.0"}` splits on dots; an all-digit part (at most 9 digits) indexes an array and
  never names an object key, any other part names a key and never indexes (JSONPath semantics).
  Empty parts and a lone `*` part (a DuckDB wildcard) are refused, as is the label key `*`;
  payload keys containing dots cannot be addressed.
- `{event: ...}` yields the column's string (occurred_at in its RFC 3339 form); a None
  subject_ref is absent.

Predicates
- `{"all": [p...]}` (empty: true), `{"any": [p...]}` (empty: false), `{"not": p}`,
  `{"<op>": [a, b]}` for eq, ne, gt, gte, lt, lte, prefix (a starts with b), contains (a contains
  b), `{"in": [a, [literal...]]}`, `{"exists": a}` (present and not null).
- eq is strict: the JSON types must match; numbers compare by value as IEEE doubles (1 == 1.0;
  exact for integers up to 2^53), strings and booleans by value; "1" != 1, true != 1. An absent
  value, an object or an array is equal to nothing. ne is exactly `not eq`, so ne with an absent
  value is true. `in` is eq against each literal.
- prefix and contains need two strings, otherwise false.
- Ordering predicates coerce both sides to doubles: numbers as they are, booleans to 1/0, strings
  matching `[+-]?digits(.digits)?([eE][+-]?digits)?` after trimming ASCII space, tab, CR and LF;
  anything else (absent, object, array, other strings, non-finite results) makes them false.

Integer expressions (no float touches a quantity)
- `payload_int`/`label_int` read the value as an integer: integers, booleans (1/0) and integer
  strings exactly; numbers with a fraction or exponent (JSON or string) through an IEEE double
  truncated toward zero (12.7 -> 12; exact for magnitudes below 2^53). A value that is not numeric
  gives `default`, which is 0 when omitted.
- `{const: n}` is an integer or an integer string. `{mul: [a, b]}` multiplies.
  `{div: [a, b], rounding}` with rounding floor, ceil, or nearest (floor(a/b + 1/2): halves go
  toward +infinity, so 2.5 -> 3 and -2.5 -> -2); division by zero gives 0.
- Every intermediate result saturates to signed 64-bit; the final quantity (meters and
  `feature_quantity_minor`) is clamped to [0, 2^63-1].

Aggregate engine (groups: billing_account_id, event_type, UTC day of occurred_at)
- `{agg: {op, of?, default?}}`: count without `of` counts matched events, with `of` the events
  where it is present; count_distinct counts distinct present scalars under eq's equality (1 and
  1.0 are one value, "1" another; objects, arrays and numbers beyond the double range are
  skipped); sum, avg, min, max read each
  `of` as `payload_int` does, skip non-numeric values, and give `default` (0 when omitted) when
  none is numeric; avg truncates toward zero. Only sum, avg, min and max take a default.
- A group with no matching event yields no intents (no SQL rows).
"""

from __future__ import annotations

from pipelines.rating.compile_sql import (
    INLINE,
    CompiledIntent,
    InlineReader,
    JsonColumn,
    JsonPath,
    Reader,
    SqlValue,
    compile_aggregate_sql,
    compile_intents,
    compile_match,
    json_path_sql,
    rate_sql,
)
from pipelines.rating.errors import DslError, DslErrors
from pipelines.rating.evaluate import EventFacts, Intent, evaluate, evaluate_aggregate
from pipelines.rating.parse import bind_params, parse_policy, validate_policy
from pipelines.rating.tree import PolicyDoc

__all__ = [
    "INLINE",
    "CompiledIntent",
    "DslError",
    "DslErrors",
    "EventFacts",
    "InlineReader",
    "Intent",
    "JsonColumn",
    "JsonPath",
    "PolicyDoc",
    "Reader",
    "SqlValue",
    "bind_params",
    "compile_aggregate_sql",
    "compile_intents",
    "compile_match",
    "evaluate",
    "evaluate_aggregate",
    "json_path_sql",
    "parse_policy",
    "rate_sql",
    "validate_policy",
]
