"""The cost ledger and the budget: every attempt's wall time at the GPU's rate, kept in the
record (values.LEDGER), plus the priced calls of the run's LLM judges (values.JUDGE_USD, which
the trainer reports); spec.maxCostUSD turned into what the trainer's next attempt may spend."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from grpo_run.state import values
from grpo_run.state.record import Record
from grpo_run.trainer.protocol import Budget

CHECKPOINT_RESERVE_S = 5.0   # budget held back for the last checkpoint, its upload and the exit


class Ledger:
    """The spend of the job's attempts: earlier ones from the record, the running one live; the
    judges' calls as the record has them."""

    def __init__(self, record: Record, *, usd_per_hour: float | None, max_cost_usd: float | None) -> None:
        self.record = record
        self.usd_per_hour = usd_per_hour
        self.max_cost_usd = max_cost_usd
        self.attempt: int | None = None
        self.running = False       # an attempt of this process is running (its entry grows)
        self._t0 = time.monotonic()
        self._earlier_usd = 0.0

    def start(self, attempt: int) -> None:
        """Attempt `attempt` starts now; what earlier ones spent is counted once, here."""
        self._earlier_usd = values.gpu_usd(self.record)
        self._t0 = time.monotonic()
        self.attempt = attempt
        self.running = True

    def write(self) -> None:
        """The running attempt's entry as of now."""
        ledger = dict(values.LEDGER.get(self.record))
        ledger[str(self.attempt)] = {"seconds": round(time.monotonic() - self._t0, 3),
                                     "usd": round(self.attempt_usd(), 6), "usdPerHour": self.usd_per_hour}
        values.LEDGER.set(self.record, ledger)

    def charge_lost(self, attempt: dict[str, Any]) -> None:
        """An attempt a lost node left open: its spend runs at least to the newest step it logged
        (the ledger in storage may be older than that step)."""
        ledger = dict(values.LEDGER.get(self.record))
        entry = ledger.get(str(attempt["id"]))
        steps = [s for s in self.record.steps(logged=True) if s["logged"] >= attempt["started"]]
        if steps and entry:
            seconds = _time(steps[-1]["logged"]) - _time(attempt["started"])
            if seconds > entry["seconds"]:
                rate = entry.get("usdPerHour") or 0.0
                ledger[str(attempt["id"])] = {**entry, "seconds": round(seconds, 3), "usd": round(seconds * rate / 3600, 6)}
        values.LEDGER.set(self.record, ledger)

    def attempt_usd(self) -> float:
        return (time.monotonic() - self._t0) * (self.usd_per_hour or 0.0) / 3600

    def spent_usd(self) -> float:
        """Every attempt's wall time at the GPU's rate (earlier attempts from the ledger, this one
        live) and the judges' priced calls so far."""
        return self._earlier_usd + self.attempt_usd() + values.judges_usd(self.record)

    def budget(self) -> Budget | None:
        """maxCostUSD as what the trainer starting now may spend: the limit less every earlier
        attempt's spend and the judges' calls so far, less what the stop itself costs — the last
        checkpoint, its upload, the exit: CHECKPOINT_RESERVE_S at the rate. None without a limit."""
        limit, rate = self.max_cost_usd, self.usd_per_hour
        if not limit:
            return None
        reserve = CHECKPOINT_RESERVE_S * (rate or 0.0) / 3600
        return Budget(usd_left=limit - self._earlier_usd - values.judges_usd(self.record) - reserve, usd_per_hour=rate,
                      since=self._t0)


def _time(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()
