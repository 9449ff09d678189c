"""The run's record in SQLite. Imports neither `runner` nor `trainer`."""

from .record import ALLOWED_TRANSITIONS, EVAL_KINDS, MIGRATIONS, InvalidTransition, Phase, Record

__all__ = ["ALLOWED_TRANSITIONS", "EVAL_KINDS", "MIGRATIONS", "InvalidTransition", "Phase", "Record"]
