"""The pure domain of tollgate, with no I/O: canonical hashing, event validation, the catalog,
pricing with remainder carry, and the rating DSL (parse, validate, compile to SQL, evaluate
one event). The batch engine that runs the DSL's SQL over the lake is `batch/`."""
