"""Which cases of the larger campaigns CI runs. The whole suite runs a seeded or chosen sample of
each campaign (the kill campaign, the notice matrix, the repeated fault and resume cases);
scripts/reliability sets GRPO_RUN_CAMPAIGN=full and runs every case (`-m campaign` selects the
ones CI leaves out). A case left out says so in pytest's skip line, with the command that runs it."""

from __future__ import annotations

import os

import pytest

FULL = os.environ.get("GRPO_RUN_CAMPAIGN") == "full"


def full_campaign_only(why: str) -> list:
    """The marks of a case only scripts/reliability runs: `why` names what CI runs instead."""
    return [pytest.mark.slow, pytest.mark.campaign,
            pytest.mark.skipif(not FULL, reason=f"{why}; every case: scripts/reliability (GRPO_RUN_CAMPAIGN=full)")]


def stores(*in_ci: str, among: tuple[str, ...] = ("s3", "gs", "az")) -> list:
    """Parameters for a store fixture (`store_env`, `private_store`) used indirectly: CI runs the
    stores `in_ci`, scripts/reliability every one of `among`. The cloud stores take turns across
    the fault tests, so CI meets each of them without running every fault on every store."""
    return [pytest.param(s, marks=() if s in in_ci else full_campaign_only(f"CI runs this fault on {', '.join(in_ci)}"))
            for s in among]
