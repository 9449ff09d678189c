"""The trainer's process reports its phases by the names the run's record uses."""

from __future__ import annotations

from grpo_run.state.phases import Phase
from grpo_run.trainer import recipe as run


def test_every_phase_the_trainer_reports_is_a_phase_of_the_record():
    # The trainer cannot import state (STYLE: arrows point down), so it names the phases itself;
    # the supervisor turns each into Phase(name), which would raise on a name the record lacks.
    reported = (run.BASELINE_EVAL, run.TRAINING, run.FINAL_EVAL)
    assert [Phase(name) for name in reported] == [Phase.BASELINE_EVAL, Phase.TRAINING, Phase.FINAL_EVAL]
