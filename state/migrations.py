"""The record's schema, as migrations: append only, never edit an applied one."""

from __future__ import annotations

# Append only. Each entry runs once, in one transaction with its row in `migrations`.
MIGRATIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("0001_initial", (
        """CREATE TABLE job (
            id INTEGER PRIMARY KEY CHECK (id = 1),
            name TEXT NOT NULL,
            spec TEXT NOT NULL,
            phase TEXT NOT NULL,
            message TEXT NOT NULL DEFAULT '',
            created TEXT NOT NULL,
            updated TEXT NOT NULL)""",
        """CREATE TABLE transitions (
            id INTEGER PRIMARY KEY,
            at TEXT NOT NULL,
            from_phase TEXT,
            to_phase TEXT NOT NULL,
            message TEXT NOT NULL DEFAULT '')""",
        """CREATE TABLE attempts (
            id INTEGER PRIMARY KEY,
            node TEXT NOT NULL,
            started TEXT NOT NULL,
            ended TEXT,
            reason TEXT,
            message TEXT NOT NULL DEFAULT '')""",
        """CREATE TABLE steps (
            step INTEGER PRIMARY KEY,
            metrics TEXT NOT NULL,
            logged TEXT NOT NULL)""",
        """CREATE TABLE evals (
            kind TEXT PRIMARY KEY,
            result TEXT NOT NULL,
            runs INTEGER NOT NULL DEFAULT 0,
            fingerprint TEXT NOT NULL,
            source TEXT NOT NULL,
            updated TEXT NOT NULL)""",
        """CREATE TABLE checkpoints (
            step INTEGER PRIMARY KEY,
            durable INTEGER NOT NULL DEFAULT 0,
            created TEXT NOT NULL,
            updated TEXT NOT NULL)""",
        """CREATE TABLE kv (
            key TEXT PRIMARY KEY,
            value TEXT NOT NULL,
            updated TEXT NOT NULL)""",
    )),
    # where each attempt started (the checkpoint's step, 0 for none) and the last step it
    # completed: the steps a kill or a notice cost are the gap to the next attempt's start
    ("0002_attempt_steps", (
        "ALTER TABLE attempts ADD COLUMN from_step INTEGER",
        "ALTER TABLE attempts ADD COLUMN to_step INTEGER",
    )),
    # which spot notice ended a preempted attempt (aws, gcp, azure, signal): the report's labels
    ("0003_attempt_notice", (
        "ALTER TABLE attempts ADD COLUMN notice TEXT",
    )),
    # which layers of the reward sandbox were in force for the attempt's reward functions (JSON:
    # {"network": "netns", "filesystem": "landlock", ...}), as its trainer reported them
    ("0004_attempt_sandbox", (
        "ALTER TABLE attempts ADD COLUMN sandbox TEXT",
    )),
    # what the model wrote (runner.books.sample_books): a step's first groups, an evaluation's first
    # held-out tasks; one row per group or task, its JSON in `data`
    ("0005_samples", (
        """CREATE TABLE samples (
            kind TEXT NOT NULL,
            step INTEGER NOT NULL,
            item INTEGER NOT NULL,
            data TEXT NOT NULL,
            PRIMARY KEY (kind, step, item))""",
    )),
)
