"""The `tollgate` command line (cyclopts): serve, keys, catalog, call, sql, flows; one module
per subcommand, gathered by `cli.main`."""
