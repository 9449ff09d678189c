"""`staleness=N` through grpo_run.train(): spec.parameters.staleness, checked as `apply` checks it,
and shown as status.sampler.staleness by a dry run."""

from __future__ import annotations

import pytest

import grpo_run
from tests.api.test_train import uses_its_module


def test_train_takes_staleness_and_its_dry_run_shows_it(tmp_path, capsys):
    doc = grpo_run.train(model="tiny:char", name="lagging", tasks=[{"prompt": "1+1=", "n": "2"}] * 4,
                         held_out_fraction=0.5, rewards=[uses_its_module], max_steps=5, staleness=2,
                         staleness_importance_cap=1.5, dry_run=True)
    assert doc["spec"]["parameters"]["staleness"] == 2 and doc["spec"]["parameters"]["stalenessImportanceCap"] == 1.5
    assert doc["status"]["sampler"]["staleness"] == 2


def test_a_bad_staleness_from_python_names_the_field():
    with pytest.raises(grpo_run.JobError, match=r"spec.parameters.staleness: must be between 0 and 8 \(got 9\)"):
        grpo_run.train(model="tiny:char", name="lagging", tasks=[{"prompt": "1+1=", "n": "2"}] * 4,
                       held_out_fraction=0.5, rewards=[uses_its_module], staleness=9, dry_run=True)
