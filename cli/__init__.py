"""The `tollgate` command line: serve, keys, catalog, call, sql, flows."""
