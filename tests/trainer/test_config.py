"""The job's parameters bounded above where a value past the bound is a typo or a hazard: a reward's
time and memory (the hang watchdog and the node's memory) and the learning rate."""

from __future__ import annotations

import math

import pytest

from grpo_run.trainer.config import parse_parameters


def problems_of(**raw):
    found: list[str] = []
    parse_parameters(raw, "spec.parameters", found)
    return found


@pytest.mark.parametrize("field, value, said", [
    ("rewardTimeoutSeconds", 86_400, "spec.parameters.rewardTimeoutSeconds: must be <= 3600 (got 86400): seconds one "
                                     "reward call may take, up to an hour"),
    ("rewardTimeoutSeconds", math.inf, "spec.parameters.rewardTimeoutSeconds: must be <= 3600 (got inf)"),
    ("rewardMemoryMB", 1_000_000, "spec.parameters.rewardMemoryMB: must be between 64 and 65536 (got 1000000): MiB "
                                  "for one reward call's processes"),
    ("learningRate", 1e5, "spec.parameters.learningRate: must be <= 1 (got 100000.0): Adam moves each weight by "
                          "about the learning rate a step; LoRA trains at 1e-5 to 1e-4"),
])
def test_a_value_past_its_upper_bound_is_refused_naming_field_value_and_fix(field, value, said):
    found = problems_of(**{field: value})
    assert len(found) == 1 and found[0].startswith(said), found


def test_the_bounds_themselves_are_allowed():
    assert problems_of(rewardTimeoutSeconds=3600, rewardMemoryMB=65536, learningRate=1.0) == []
