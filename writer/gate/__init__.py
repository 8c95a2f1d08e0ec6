"""The gate's decisions, made in the writer process in queue order: the book of leases, holds,
funding, quota and budget usage, and idempotency records."""
