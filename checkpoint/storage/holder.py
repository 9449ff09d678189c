"""A lease's body: who holds it (name, host, boot id, pid namespace, pid), how it is read and
written. The body is what a node shows others and what a taker reads; the decisions about it
(acquire, renew, take over) are in lease.py; its two errors, which name a holder, are here."""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
from pathlib import Path

log = logging.getLogger("grpo_run.checkpoint.storage.lease")


def describe_holder(body: dict) -> str:
    """`i-0abc (host ip-10-0-0-5, boot 5f1c2a9e, pid 4242) since 2025-01-01T00:00:00Z` -- for
    messages and `grpo-run get`. The times are the holder's own wall clock."""
    boot = body.get("boot_id")
    boot = f", boot {str(boot)[:8]}" if boot else ""
    return (f"{body.get('holder', '?')} (host {body.get('host', '?')}{boot}, "
            f"pid {body.get('pid', '?')}) since {body.get('since', '?')}")



def boot_id() -> str | None:
    """This machine's boot id: new at every boot, and different on every other machine (and
    VM) even when they share a host name. None where the kernel does not offer one (then no
    lease of ours is ever retaken early)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def pid_namespace() -> str | None:
    """Our pid namespace (`pid:[4026531836]`): containers on one machine share its boot id but
    not this, and a pid number names the same process only inside one namespace."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def time_namespace() -> str | None:
    """Our time namespace (`time:[4026531834]`): processes of one boot read one CLOCK_BOOTTIME
    unless a time namespace offsets it. "time:[none]" on a kernel without time namespaces (before
    5.6: one clock for the whole boot); None where /proc says nothing."""
    try:
        return os.readlink("/proc/self/ns/time")
    except FileNotFoundError:
        return "time:[none]" if os.path.isdir("/proc/self/ns") else None
    except OSError:
        return None


def pid_alive(pid: object) -> bool:
    """Whether a process with this pid exists in our pid namespace (someone else's counts)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def parse_body(data: bytes) -> dict:
    """A lease body; an unreadable one may be taken over at once (it cannot be renewed either)."""
    try:
        body = json.loads(data)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        log.warning("lease body is not a JSON object (%r...); treating it as expired", data[:80])
        return {"holder": "?", "unreadable": True}
    return body


def ttl_of(body: dict, default: float) -> float:
    """The ttl the holder promised to renew within (its body's ttl_s); `default` for a body that
    does not say or says nonsense."""
    value = body.get("ttl_s")
    if isinstance(value, (int, float)) and not isinstance(value, bool) \
            and math.isfinite(value) and value > 0:
        return float(value)
    return default


def count(value: object) -> int:
    """A body's counter (renewals); 0 for anything that is not an int."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def public(body: dict) -> dict:
    """The body as anyone may see it: without the holder's token."""
    return {k: v for k, v in body.items() if k != "token"}


def dump(body: dict) -> bytes:
    """The bytes written to storage."""
    return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()


def iso(epoch: float) -> str:
    """A wall-clock time for people to read (UTC)."""
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class LeaseHeld(RuntimeError):
    """Another live holder has the job. `holder` is its lease body (without the token); the
    message names it (holder, host, pid, since), how long it has gone unrenewed, and how long
    unrenewed it must stay before another node takes over."""

    def __init__(self, url: str, holder: dict, *, unrenewed_s: float | None = None,
                 ttl_s: float | None = None) -> None:
        self.holder = public(holder)
        if unrenewed_s is None or ttl_s is None:
            when = "it is taken over only once it stays unrenewed for its ttl"
        else:
            when = (f"last renewed {max(0.0, unrenewed_s):.0f}s ago; another node takes it over "
                    f"once it stays unrenewed for {ttl_s:.0f}s")
        super().__init__(f"job at {url} is held by {describe_holder(holder)}; {when}")


class LeaseLost(RuntimeError):
    """Our lease was taken over, removed, or could not be renewed before it expired: stop
    training at once. `holder` is the new holder's lease body when there is one."""

    def __init__(self, message: str, holder: dict | None = None) -> None:
        self.holder = public(holder) if holder is not None else None
        super().__init__(message)
