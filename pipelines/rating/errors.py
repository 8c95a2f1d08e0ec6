"""Owns the faults the rating DSL reports: one fault with its path, and a batch of them."""

from __future__ import annotations


class DslError(ValueError):
    """One fault in a policy document, at a JSONPath-like path such as `$.emit.intents[0]`."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


class DslErrors(ValueError):
    """Every fault found in one document; `errors` is never empty and keeps document order."""

    def __init__(self, errors: list[DslError]) -> None:
        super().__init__("\n".join(str(error) for error in errors))
        self.errors = tuple(errors)
