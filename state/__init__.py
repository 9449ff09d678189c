"""The run's record in SQLite: `phases` (the status enum and its transitions), `record` (the
record itself), `migrations` (its schema). Imports neither `runner` nor `trainer`."""
