"""The gate's decisions, made in the writer process in queue order: the book of leases, holds,
funding, quota and budget usage, and idempotency records.

    book    authorize, commit and cancel against the book; rebuilding it from the file
    checks  the limits an authorize passes, in the contract's order
    state   the book's counts in memory: leases, usage per day, holds
"""
