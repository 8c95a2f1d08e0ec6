"""The batch rating engine: DuckDB over the lake, run by the flows (`flows/`).

    rating_plan     a catalog's policies compiled into the SQL of one sweep
    sweep           the scan of unrated events: its steps in order, its threads and commits
    chunks          pending events by account bucket: chunks (one run each) and passes
    staging         rated events held between the scan and their runs (Arrow or Parquet)
    run_writer      a chunk made one run: the carry in numpy, its lines in Parquet files
    carry           remainder carry over a run's lines (numpy)
    rating_runs     rating runs and their lines in the lake; the rating lock
    rerate          a backfill over an occurred_at range, accounts or policies
    aggregate_days  aggregate policies per account, event type and closed UTC day
    usage_reports   usage per day and month, from the current ratings and commit lines

The pure rules it applies (the rating DSL, pricing, the catalog) live in `pipelines/`.
"""
