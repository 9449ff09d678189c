"""The trainer's CPU threads: a pool from the node's cores, short spins, and a user's own setting kept."""

from grpo_run.runner.supervisor.threads import SPIN_ROUNDS, trainer_threads
from grpo_run.trainer.protocol import SHARE_ENV


def test_on_two_cores_the_pool_is_both_cores_and_waits_spin_briefly():
    assert trainer_threads(2, {}) == {"OMP_NUM_THREADS": "2", SHARE_ENV: "2", "GOMP_SPINCOUNT": str(SPIN_ROUNDS)}
    assert trainer_threads(1, {}) == {"OMP_NUM_THREADS": "1", SHARE_ENV: "1"}


def test_on_a_bigger_node_one_core_is_left_to_the_rest_of_the_job():
    assert trainer_threads(16, {})["OMP_NUM_THREADS"] == "15"


def test_a_users_own_thread_settings_are_kept_and_nothing_is_shared():
    assert trainer_threads(16, {"OMP_NUM_THREADS": "4"}) == {}
    assert "GOMP_SPINCOUNT" not in trainer_threads(16, {"OMP_WAIT_POLICY": "PASSIVE"})


def test_a_later_attempt_runs_with_the_count_the_first_one_took():
    assert trainer_threads(2, {}, kept=1) == {"OMP_NUM_THREADS": "1"}
    assert trainer_threads(16, {}, kept=8) == {"OMP_NUM_THREADS": "8", "GOMP_SPINCOUNT": str(SPIN_ROUNDS)}
    assert trainer_threads(16, {"OMP_NUM_THREADS": "4"}, kept=8) == {}
