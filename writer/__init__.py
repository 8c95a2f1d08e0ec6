"""The writer process (`python -m writer.host`, started by `tollgate serve`): the one process
that opens the operational DuckDB file.

It takes ops from the HTTP process (`writer.ops`), applies them in group-commit
transactions through `warehouse.writer`, and answers each after its commit:
`writer.gate` decides authorize, commit and cancel against the gate book (leases, holds,
funding, quotas, budgets, idempotency records); `writer.events` stages events in the outbox
and rates single events inline.
"""
