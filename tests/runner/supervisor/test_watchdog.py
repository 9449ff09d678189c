"""A trainer that goes silent (held by its reward function, a wedged collective, a driver) is not
left billing the GPU: past its watchdog's bound the attempt ends as a hang, under the crash
restart limit, and the run goes on from its last durable step."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import yaml

from grpo_run.runner.supervisor.watchdog import HANG_FLOOR_S, HANG_STEP_FACTOR, Watchdog, configured_bound_s
from grpo_run.trainer.config import GRPOParams
from tests.tiny_models import seed_home
from tests.faults.harness import fault_env
from tests.runner.jobs.test_resume import REPO, write_job

pytestmark = pytest.mark.trust


def test_a_trainer_silent_past_the_bound_is_killed_as_a_hang_and_the_run_goes_on(tmp_path, figures):
    from grpo_run.state.record import Record

    job = write_job(tmp_path)
    home = tmp_path / "home"
    # a bound far under the hold (300 s) and far over any step here, even on 2 busy cores
    env = {**os.environ, "GRPO_RUN_HOME": str(seed_home(home)), "GRPO_RUN_HANG_SECONDS": "15",
           **fault_env("hold:backward@2", tmp_path / "held")}        # silent in step 2, once, for up to 300 s
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "grpo_run.runner.cli", "apply", "-f", str(job)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=200)
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "held").exists()
    with Record(home / "runs" / "resumable" / "state.db") as record:
        attempts = record.attempts()
    assert [a["reason"] for a in attempts] == ["Crashed", "Succeeded"]
    assert attempts[0]["message"].startswith("hung: the trainer reported nothing for ")
    assert "restart 1 of 3 (crashes)" in proc.stderr and took < 170, took
    figures.add("trust", actor="reward author", tried="hold the trainer without a word (no step, no event)",
                protection="the supervisor's watchdog: a hang past the bound", outcome=f"killed, run done in {took:.0f} s",
                held=True)


def test_the_bound_is_what_a_steps_rewards_may_take_or_a_multiple_of_the_slowest_wait():
    now = [0.0]
    params = GRPOParams(promptsPerStep=8, numGenerations=8, evalBatchSize=16, rewardTimeoutSeconds=10)
    dog = Watchdog(params, functions=2, clock=lambda: now[0])
    assert dog.bound_s == 64 * 2 * (10 + 4) * 3                  # 5,376 s: every completion, both functions, 3 tries
    assert dog.overdue() is None                                  # not armed before the first event
    dog.seen()
    small = Watchdog(GRPOParams(promptsPerStep=1, numGenerations=2, evalBatchSize=1, rewardTimeoutSeconds=1),
                     functions=1, clock=lambda: now[0])
    assert small.bound_s == HANG_FLOOR_S
    small.seen()
    now[0] = 400.0
    small.seen()                                                  # a 400 s step
    assert small.bound_s == HANG_STEP_FACTOR * 400
    now[0] += HANG_STEP_FACTOR * 400 + 1
    assert small.overdue() == HANG_STEP_FACTOR * 400 + 1
    assert Watchdog(params, 1, fixed_s=3, clock=lambda: now[0]).bound_s == 3
    judge = SimpleNamespace(timeout_s=30.0, retries=3, concurrency=4)     # a slow judge API is not a hang
    assert Watchdog(params, 0, judges=[judge]).bound_s == 64 * (10 + 4) * 3 + 64 * 30 * 4 / 4


def test_a_bound_that_is_no_number_is_said_and_the_derived_one_holds(caplog):
    assert configured_bound_s({"GRPO_RUN_HANG_SECONDS": "soon"}) is None
    assert "GRPO_RUN_HANG_SECONDS='soon' is not a number of seconds > 0" in caplog.text
    assert configured_bound_s({"GRPO_RUN_HANG_SECONDS": "90"}) == 90.0


@pytest.mark.slow
def test_a_trainer_held_past_max_cost_is_stopped_by_the_supervisor(tmp_path, figures):
    """Its own budget check runs between steps: a trainer held inside a step (by its reward, say)
    never reaches it. The watchdog's bound is set long here, so the budget alone ends it."""
    from grpo_run.state.record import Record

    job = write_job(tmp_path, maxSteps=100000, saveSteps=1)
    doc = yaml.safe_load(job.read_text())
    doc["spec"].update(maxCostUSD=3.0, pricing={"usdPerHour": 360.0})      # $0.10 a second: 30 s, past the
    # model's load and the baseline (5.3 s to the hold beside a two-process run), so the trainer reaches its first
    # step; not `alone`: the 30 s charged by the second hold 5x that, and the bound checked is 150 s
    job.write_text(yaml.safe_dump(doc))
    home = tmp_path / "home"
    env = {**os.environ, "GRPO_RUN_HOME": str(seed_home(home)), "GRPO_RUN_HANG_SECONDS": "600",
           **fault_env("hold:backward@1", tmp_path / "held")}             # held in its first step, for 300 s
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "grpo_run.runner.cli", "apply", "-f", str(job)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=200)
    took = time.monotonic() - started
    assert proc.returncode == 4, proc.stderr[-3000:]
    with Record(home / "runs" / "resumable" / "state.db") as record:
        (attempt,) = record.attempts()
    assert attempt["reason"] == "BudgetExceeded" and "so the supervisor stopped it after step" in attempt["message"]
    assert (tmp_path / "held").exists()
    assert took < 150, took
    figures.add("trust", actor="reward author", tried="hold the trainer inside a step past maxCostUSD",
                protection="the supervisor's own budget check", outcome=f"BudgetExceeded in {took:.0f} s", held=True)


def test_an_episodes_environment_calls_count_in_the_bound_as_reward_functions_do():
    from grpo_run.runner.supervisor.watchdog import sandboxed_calls
    from grpo_run.trainer.envs.catalog import EpisodeSettings, Reward, user_environment

    tasks = [{"prompt": "1"}]
    rewards = (Reward("a", "a.py:a"), Reward("m", "org/rm", model=True))
    plain = user_environment(name="x", rewards=rewards, tasks=tasks, eval_tasks=tasks)
    talking = user_environment(name="x", rewards=rewards, tasks=tasks, eval_tasks=tasks,
                               episodes=EpisodeSettings("env.py:Guess", max_turns=6))
    assert sandboxed_calls(plain, 10) == 1                             # the reward model runs outside the sandbox
    assert sandboxed_calls(talking, 10) == 1 + 6 + 2                   # its object, reset, 6 steps
    tooled = user_environment(name="x", rewards=rewards, tasks=tasks, eval_tasks=tasks,
                              episodes=EpisodeSettings("env.py:Guess", max_turns=6, tools=("t.py:add",),
                                                       tool_timeout_s=25))
    assert sandboxed_calls(tooled, 10) == 1 + 6 + 2 + 6 * 8 * 3        # 8 calls a reply, each up to 25 s: 3 x 10 s
