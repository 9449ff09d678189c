"""The trainer's CPU threads: one core left to the rest of the job, sleeping waits when several."""

from runner.supervisor import trainer_threads


def test_on_two_cores_the_trainer_runs_one_thread_and_needs_no_wait_policy():
    assert trainer_threads(2) == {"OMP_NUM_THREADS": "1"}
    assert trainer_threads(1) == {"OMP_NUM_THREADS": "1"}


def test_on_a_bigger_node_one_core_is_left_and_the_threads_sleep_while_they_wait():
    assert trainer_threads(16) == {"OMP_NUM_THREADS": "15", "OMP_WAIT_POLICY": "PASSIVE"}
