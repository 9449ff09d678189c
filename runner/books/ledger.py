"""The cost ledger and the budget: every attempt's wall time at the GPU's rate, kept in the
record (values.LEDGER), and spec.maxCostUSD turned into a time the trainer must stop by."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from grpo_run.state import values
from grpo_run.state.record import Record

CHECKPOINT_RESERVE_S = 5.0   # budget held back for the last checkpoint, its upload and the exit


class Ledger:
    """The spend of the job's attempts: earlier ones from the record, the running one live."""

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
        self._earlier_usd = sum(v["usd"] for v in values.LEDGER.get(self.record).values())
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
        """Every attempt's wall time at the GPU's rate: earlier attempts from the ledger, this one live."""
        return self._earlier_usd + self.attempt_usd()

    def stop_by(self) -> float | None:
        """maxCostUSD as a time: the time.monotonic() past which no training step may end, so the
        spend (every attempt's wall time x the rate) stays within it. What the stop itself costs
        — the last checkpoint, its upload, the exit — is held back (CHECKPOINT_RESERVE_S)."""
        limit, rate = self.max_cost_usd, self.usd_per_hour
        if not limit or not rate:
            return None
        return self._t0 + (limit - self._earlier_usd) * 3600 / rate - CHECKPOINT_RESERVE_S


def _time(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()
