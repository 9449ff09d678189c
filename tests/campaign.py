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
