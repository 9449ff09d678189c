"""The run's record in SQLite: `phases` (the status enum and its transitions), `record` (the
record itself), `migrations` (its schema), `values` (what its small-values table holds, each key
with its type). Imports neither `runner` nor `trainer`."""
