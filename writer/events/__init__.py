"""Events in the writer process: the ingest handler (outbox, dedupe by content) and the inline
rating of single events."""
