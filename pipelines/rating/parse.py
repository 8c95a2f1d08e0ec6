"""Owns loading a rating policy: a JSON document (dict or text) in, a typed `PolicyDoc` out.

API, one rule for every caller:
- `validate_policy(doc)` returns every fault found, in document order (empty list = valid);
- `parse_policy(doc)` returns the tree, or raises `DslErrors` carrying that same list;
- `bind_params(policy, params)` lays rating-time params over the document's defaults.

The parser keeps going after a fault so one load reports all of them; a subtree with a fault
yields None and the tree is only built when there were none.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import TypeVar, cast

from core.constants import INT64_MAX, INT64_MIN
from pipelines.rating.errors import DslError, DslErrors
from pipelines.rating.tree import (
    AGG_OPS,
    CODE_PATTERN,
    COMPARE_OPS,
    ENGINES,
    EVENT_FIELDS,
    ROUNDINGS,
    Agg,
    AggOp,
    AllOf,
    AnyOf,
    Compare,
    CompareOp,
    Const,
    Div,
    Engine,
    EventField,
    EventValue,
    Exists,
    In,
    IntentSpec,
    IntExpr,
    LabelInt,
    LabelValue,
    LiteralValue,
    Match,
    Meter,
    Mul,
    Not,
    ParamValue,
    PayloadInt,
    PayloadValue,
    PolicyDoc,
    Predicate,
    Rounding,
    Scalar,
    Value,
)

__all__ = ["bind_params", "parse_policy", "validate_policy"]

# Deeper documents are refused rather than risking Python's recursion limit in every back end.
MAX_DEPTH = 32
# DuckDB refuses JSONPath array indexes it cannot hold; nine digits is far beyond any payload.
_MAX_INDEX_DIGITS = 9

_INT_FORMS: dict[str, tuple[str, ...]] = {
    "payload_int": ("default",),
    "label_int": ("default",),
    "const": (),
    "mul": (),
    "div": ("rounding",),
    "agg": (),
}
_DEFAULTED_AGG_OPS = ("sum", "avg", "min", "max")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DIGITS = re.compile(r"[0-9]+")
_INTEGER_TEXT = re.compile(r"[+-]?[0-9]+")

T = TypeVar("T")


def _key(path: str, key: object) -> str:
    text = str(key)  # a dict built in Python may carry non-string keys; JSON never does
    return f"{path}.{text}" if _IDENTIFIER.fullmatch(text) else f"{path}[{json.dumps(text)}]"


def _present(items: list[T | None]) -> tuple[T, ...] | None:
    return None if any(item is None for item in items) else tuple(cast(list[T], items))


def _choices(options: tuple[str, ...]) -> str:
    return ", ".join(options)


def _unicode(text: str) -> bool:
    # JSON text may escape a lone surrogate, which no UTF-8 consumer (DuckDB's SQL) accepts.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _Parser:
    def __init__(self) -> None:
        self.errors: list[DslError] = []
        self.engine: Engine | None = None
        # None while $.params is unusable, so {param} references are not flagged a second time.
        self.params: dict[str, Scalar] | None = {}
        # Declared params whose value was refused: their references are not flagged again.
        self.refused_params: set[object] = set()

    def fault(self, path: str, message: str) -> None:
        self.errors.append(DslError(path, message))

    def keys(
        self,
        node: dict[str, object],
        path: str,
        allowed: tuple[str, ...],
        required: tuple[str, ...],
    ) -> None:
        for key in node:
            if key not in allowed:
                self.fault(_key(path, key), f"unknown key; expected one of {_choices(allowed)}")
        for key in required:
            if key not in node:
                self.fault(_key(path, key), "required")

    def policy(self, doc: object) -> PolicyDoc | None:
        if not isinstance(doc, dict):
            self.fault("$", "a policy document must be a JSON object")
            return None
        self.keys(
            doc,
            "$",
            ("dsl_version", "engine", "params", "match", "emit"),
            ("dsl_version", "engine", "match", "emit"),
        )
        if "dsl_version" in doc and doc["dsl_version"] != "v1":
            self.fault("$.dsl_version", "must be 'v1'")
        engine = doc.get("engine")
        if engine in ENGINES:
            self.engine = cast(Engine, engine)
        elif "engine" in doc:
            self.fault("$.engine", f"must be one of {_choices(ENGINES)}")
        if "params" in doc:
            self.params = self.param_defaults(doc["params"])
        match = self.match(doc["match"]) if "match" in doc else None
        intents = self.emit(doc["emit"]) if "emit" in doc else None
        if self.errors or self.engine is None or match is None or intents is None:
            return None
        return PolicyDoc(self.engine, tuple((self.params or {}).items()), match, intents)

    def param_defaults(self, node: object) -> dict[str, Scalar] | None:
        if not isinstance(node, dict):
            self.fault("$.params", "must be an object of name to literal")
            return None
        values = {name: self.literal(value, _key("$.params", name)) for name, value in node.items()}
        self.refused_params = {name for name, literal in values.items() if literal is None}
        return {name: literal.value for name, literal in values.items() if literal is not None}

    def match(self, node: object) -> Match | None:
        path = "$.match"
        if not isinstance(node, dict):
            self.fault(path, "must be an object")
            return None
        self.keys(node, path, ("event_type", "where"), ("event_type",))
        event_type = node.get("event_type")
        if "event_type" in node and not (isinstance(event_type, str) and event_type):
            self.fault(f"{path}.event_type", "must be a non-empty string")
        elif isinstance(event_type, str) and not self.text(event_type, f"{path}.event_type"):
            event_type = None
        where = self.predicate(node["where"], f"{path}.where", 1) if "where" in node else None
        if not isinstance(event_type, str) or ("where" in node and where is None):
            return None
        return Match(event_type, where)

    def emit(self, node: object) -> tuple[IntentSpec, ...] | None:
        path = "$.emit"
        if not isinstance(node, dict):
            self.fault(path, "must be an object")
            return None
        self.keys(node, path, ("intents",), ("intents",))
        intents = node.get("intents")
        if "intents" in node and not (isinstance(intents, list) and intents):
            self.fault(f"{path}.intents", "must be a non-empty list")
        if not isinstance(intents, list):
            return None
        return _present(
            [self.intent(item, f"{path}.intents[{i}]") for i, item in enumerate(intents)]
        )

    def intent(self, node: object, path: str) -> IntentSpec | None:
        if not isinstance(node, dict):
            self.fault(path, "must be an object")
            return None
        self.keys(
            node,
            path,
            ("feature_code", "feature_quantity_minor", "meters", "labels"),
            ("feature_code", "meters"),
        )
        feature_code = self.code(node, "feature_code", path)
        feature_quantity = (
            self.quantity(node["feature_quantity_minor"], f"{path}.feature_quantity_minor", 1)
            if "feature_quantity_minor" in node
            else None
        )
        meters = self.meters(node["meters"], f"{path}.meters") if "meters" in node else None
        labels = self.labels(node.get("labels", {}), f"{path}.labels")
        if (
            feature_code is None
            or meters is None
            or labels is None
            or ("feature_quantity_minor" in node and feature_quantity is None)
        ):
            return None
        return IntentSpec(feature_code, feature_quantity, meters, labels)

    def meters(self, node: object, path: str) -> tuple[Meter, ...] | None:
        if not (isinstance(node, list) and node):
            self.fault(path, "must be a non-empty list")
            return None
        meters = _present([self.meter(item, f"{path}[{i}]") for i, item in enumerate(node)])
        # One line per meter of an intent: the single engine would write two lines for a meter
        # named twice, where the aggregate engine's day sums them into one.
        seen: set[str] = set()
        for i, item in enumerate(node):
            code = item.get("meter_code") if isinstance(item, dict) else None
            if isinstance(code, str) and code in seen:
                self.fault(f"{path}[{i}].meter_code", f"meter {code!r} appears twice in this intent")
                meters = None
            elif isinstance(code, str):
                seen.add(code)
        return meters

    def meter(self, node: object, path: str) -> Meter | None:
        if not isinstance(node, dict):
            self.fault(path, "must be an object")
            return None
        self.keys(node, path, ("meter_code", "quantity_minor"), ("meter_code", "quantity_minor"))
        meter_code = self.code(node, "meter_code", path)
        quantity = (
            self.quantity(node["quantity_minor"], f"{path}.quantity_minor", 1)
            if "quantity_minor" in node
            else None
        )
        if meter_code is None or quantity is None:
            return None
        return Meter(meter_code, quantity)

    def code(self, node: dict[str, object], key: str, path: str) -> str | None:
        if key not in node:
            return None  # already reported as required
        value = node[key]
        if isinstance(value, str) and re.fullmatch(CODE_PATTERN, value):
            return value
        self.fault(f"{path}.{key}", f"must match ^{CODE_PATTERN}$")
        return None

    def labels(self, node: object, path: str) -> tuple[tuple[str, str], ...] | None:
        if isinstance(node, dict) and all(
            isinstance(key, str) and key and isinstance(value, str) for key, value in node.items()
        ):
            return tuple(node.items())
        self.fault(path, "must be an object of non-empty string keys to string values")
        return None

    def predicate(self, node: object, path: str, depth: int) -> Predicate | None:
        if depth > MAX_DEPTH:
            self.fault(path, f"nested deeper than {MAX_DEPTH}")
            return None
        if not (isinstance(node, dict) and len(node) == 1):
            self.fault(path, "a predicate is an object with exactly one operator")
            return None
        ((op, args),) = node.items()
        at = _key(path, op)
        if op in ("all", "any"):
            if not isinstance(args, list):
                self.fault(at, "expects a list of predicates")
                return None
            items: tuple[Predicate, ...] | None = _present(
                [self.predicate(item, f"{at}[{i}]", depth + 1) for i, item in enumerate(args)]
            )
            if items is None:
                return None
            return AllOf(items) if op == "all" else AnyOf(items)
        if op == "not":
            item = self.predicate(args, at, depth + 1)
            return None if item is None else Not(item)
        if op == "exists":
            value = self.value(args, at)
            return None if value is None else Exists(value)
        if op == "in":
            return self.membership(args, at)
        if op in COMPARE_OPS:
            if not (isinstance(args, list) and len(args) == 2):
                self.fault(at, "expects a list of 2 values")
                return None
            left, right = self.value(args[0], f"{at}[0]"), self.value(args[1], f"{at}[1]")
            if left is None or right is None:
                return None
            return Compare(cast(CompareOp, op), left, right)
        known = ("all", "any", "not", "in", "exists", *COMPARE_OPS)
        self.fault(at, f"unknown predicate; expected one of {_choices(known)}")
        return None

    def membership(self, args: object, path: str) -> In | None:
        if not (isinstance(args, list) and len(args) == 2 and isinstance(args[1], list)):
            self.fault(path, "expects [value, [literal, ...]]")
            return None
        value = self.value(args[0], f"{path}[0]")
        options = _present(
            [self.literal(item, f"{path}[1][{i}]") for i, item in enumerate(args[1])]
        )
        if value is None or options is None:
            return None
        return In(value, options)

    def value(self, node: object, path: str) -> Value | None:
        if not isinstance(node, dict):
            return self.literal(node, path)
        if len(node) != 1:
            self.fault(path, "a value object has exactly one key: payload, label, event or param")
            return None
        ((form, arg),) = node.items()
        at = _key(path, form)
        if form == "payload":
            dot_path = self.dot_path(arg, at)
            return None if dot_path is None else PayloadValue(dot_path)
        if form == "label":
            key = self.label_key(arg, at)
            return None if key is None else LabelValue(key)
        if form == "event":
            if arg in EVENT_FIELDS:
                return EventValue(cast(EventField, arg))
            self.fault(at, f"must be one of {_choices(EVENT_FIELDS)}")
            return None
        if form == "param":
            if not isinstance(arg, str):
                self.fault(at, "must be a param name")
                return None
            if arg in self.refused_params:
                return None  # its value is already reported at $.params
            if self.params is not None and arg not in self.params:
                self.fault(at, f"param {arg!r} is not defined in $.params")
                return None
            return ParamValue(arg)
        self.fault(at, "unknown value form; expected payload, label, event or param")
        return None

    def text(self, node: str, path: str) -> bool:
        if _unicode(node):
            return True
        self.fault(path, "must be valid Unicode text (a lone surrogate cannot be stored)")
        return False

    def literal(self, node: object, path: str) -> LiteralValue | None:
        if isinstance(node, str):
            return LiteralValue(node) if self.text(node, path) else None
        if isinstance(node, bool):
            return LiteralValue(node)
        if isinstance(node, int):
            if INT64_MIN <= node <= INT64_MAX:
                return LiteralValue(node)
            self.fault(path, "integer literal outside signed 64-bit")
            return None
        if isinstance(node, float):
            if math.isfinite(node):
                return LiteralValue(node)
            self.fault(path, "number literal must be finite")
            return None
        self.fault(path, "expected a literal (string, number or boolean) or a value object")
        return None

    def dot_path(self, arg: object, path: str) -> tuple[str | int, ...] | None:
        if not (isinstance(arg, str) and arg):
            self.fault(path, "must be a non-empty dot path")
            return None
        if not self.text(arg, path):
            return None
        parts: list[str | int] = []
        for part in arg.split("."):
            if not part or part == "*":
                self.fault(path, f"{arg!r} has an empty or '*' segment, which cannot be addressed")
                return None
            if not _DIGITS.fullmatch(part):
                parts.append(part)
            elif len(part) <= _MAX_INDEX_DIGITS:
                parts.append(int(part))
            else:
                self.fault(
                    path, f"{arg!r} has an array index longer than {_MAX_INDEX_DIGITS} digits"
                )
                return None
        return tuple(parts)

    def label_key(self, arg: object, path: str) -> str | None:
        # A lone '*' would read as a JSONPath wildcard in DuckDB.
        if isinstance(arg, str) and arg and arg != "*":
            return arg if self.text(arg, path) else None
        self.fault(path, "must be a non-empty label key other than '*'")
        return None

    def quantity(self, node: object, path: str, depth: int) -> IntExpr | None:
        if depth > MAX_DEPTH:
            self.fault(path, f"nested deeper than {MAX_DEPTH}")
            return None
        if not isinstance(node, dict):
            self.fault(path, 'an integer expression is an object such as {"const": 1}')
            return None
        forms = [key for key in node if key in _INT_FORMS]
        if not forms:
            expected = f"expected one of {_choices(tuple(_INT_FORMS))}"
            for key in node:
                self.fault(_key(path, key), f"unknown integer expression; {expected}")
            if not node:
                self.fault(path, f"empty integer expression; {expected}")
            return None
        if len(forms) > 1:
            self.fault(path, f"use exactly one of {_choices(tuple(forms))}")
            return None
        form = forms[0]
        for key in node:
            if key != form and key not in _INT_FORMS[form]:
                self.fault(_key(path, key), f"unknown key for {form}")
        at = _key(path, form)
        arg = node[form]
        if form in ("payload_int", "label_int"):
            if self.engine == "aggregate":
                self.fault(at, "not allowed in the aggregate engine; read events through agg")
            default = self.integer(node.get("default", 0), f"{path}.default")
            if form == "payload_int":
                dot_path = self.dot_path(arg, at)
                return (
                    None if dot_path is None or default is None else PayloadInt(dot_path, default)
                )
            key = self.label_key(arg, at)
            return None if key is None or default is None else LabelInt(key, default)
        if form == "const":
            value = self.integer(arg, at, allow_text=True)
            return None if value is None else Const(value)
        if form == "agg":
            return self.aggregate(arg, at)
        if not (isinstance(arg, list) and len(arg) == 2):
            self.fault(at, "expects a list of 2 integer expressions")
            return None
        left = self.quantity(arg[0], f"{at}[0]", depth + 1)
        right = self.quantity(arg[1], f"{at}[1]", depth + 1)
        if form == "mul":
            return None if left is None or right is None else Mul(left, right)
        rounding = node.get("rounding")
        if rounding not in ROUNDINGS:
            self.fault(f"{path}.rounding", f"required: one of {_choices(ROUNDINGS)}")
            return None
        if left is None or right is None:
            return None
        return Div(left, right, cast(Rounding, rounding))

    def aggregate(self, node: object, path: str) -> Agg | None:
        if self.engine == "single":
            self.fault(path, "agg is only allowed in the aggregate engine")
            return None
        if not isinstance(node, dict):
            self.fault(path, "must be an object {op, of, default}")
            return None
        self.keys(node, path, ("op", "of", "default"), ("op",))
        op = node.get("op")
        if "op" in node and op not in AGG_OPS:
            self.fault(f"{path}.op", f"must be one of {_choices(AGG_OPS)}")
        if op in AGG_OPS and op != "count" and "of" not in node:
            self.fault(f"{path}.of", f"required for op {op}")
        of = self.value(node["of"], f"{path}.of") if "of" in node else None
        if "default" in node and op in AGG_OPS and op not in _DEFAULTED_AGG_OPS:
            self.fault(f"{path}.default", f"only {_choices(_DEFAULTED_AGG_OPS)} take a default")
        default = self.integer(node.get("default", 0), f"{path}.default")
        if op not in AGG_OPS or default is None or ("of" in node and of is None):
            return None
        return Agg(cast(AggOp, op), of, default)

    def integer(self, node: object, path: str, *, allow_text: bool = False) -> int | None:
        value: int | None = None
        if isinstance(node, int) and not isinstance(node, bool):
            value = node
        elif allow_text and isinstance(node, str) and _INTEGER_TEXT.fullmatch(node):
            # int() refuses text of more than 4300 digits; past 19 it is out of range anyway.
            digits = node.lstrip("+-").lstrip("0") or "0"
            if len(digits) <= 19:
                value = -int(digits) if node.startswith("-") else int(digits)
        if value is not None and INT64_MIN <= value <= INT64_MAX:
            return value
        kind = "an integer or an integer string" if allow_text else "an integer"
        self.fault(path, f"must be {kind} within signed 64-bit")
        return None


def _load(doc: Mapping[str, object] | str) -> tuple[PolicyDoc | None, list[DslError]]:
    if isinstance(doc, str):
        try:
            doc = json.loads(doc)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
            return None, [DslError("$", f"not valid JSON: {exc}")]
    parser = _Parser()
    policy = parser.policy(doc)
    return policy, parser.errors


def validate_policy(doc: Mapping[str, object] | str) -> list[DslError]:
    """Every fault in `doc`, in document order; an empty list means the document is valid."""
    return _load(doc)[1]


def parse_policy(doc: Mapping[str, object] | str) -> PolicyDoc:
    """The typed tree of `doc` (a dict, or JSON text); raises `DslErrors` listing every fault."""
    policy, errors = _load(doc)
    if policy is None:
        raise DslErrors(errors)
    return policy


def bind_params(policy: PolicyDoc, params: Mapping[str, object] | None) -> dict[str, Scalar]:
    """The document's param defaults overridden by `params`; a fault's path is `params.<name>`.

    Only declared params may be overridden, and only with a literal, so a typo cannot silently
    leave a default in force.
    """
    bound = dict(policy.params)
    checker = _Parser()
    for name, value in (params or {}).items():
        path = _key("params", name)
        if name not in bound:
            raise DslError(path, "not declared in the policy's params")
        literal = checker.literal(value, path)
        if literal is None:
            raise checker.errors[0]
        bound[name] = literal.value
    return bound
