"""Asynchronous GRPO (spec.parameters.staleness, trainer.ahead): the schedule fixes which policy
draws each step, a checkpoint carries what is in flight, and a stop or a kill plus a resume ends
at the uninterrupted run's adapter bytes, with every task trained once per epoch."""

from __future__ import annotations

import hashlib
import threading

import pytest
import torch

from grpo_run.trainer.ahead import drawing_version, split_threads
from grpo_run.trainer.checkpointing.snapshot import load_state
from grpo_run.trainer.sampling.sampler import GenerationInterrupted
from tests.trainer.checkpointing.test_snapshot import save
from tests.trainer.test_training import length_reward, make_trainer, small  # noqa: F401

STEPS = 6


def adapter_bytes(folder) -> bytes:
    return (folder / "adapter" / "adapter_model.safetensors").read_bytes()


def digest(tensors) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode() + tensors[name].detach().cpu().numpy().tobytes())
    return h.hexdigest()


def test_the_schedule_draws_step_k_with_the_policy_of_step_k_minus_n():
    assert [drawing_version(k, 2) for k in range(5)] == [0, 0, 0, 1, 2]
    assert [drawing_version(k, 0) for k in range(3)] == [0, 1, 2]
    assert split_threads(2) == (1, 1) and split_threads(1) == (1, 1) and split_threads(5) == (3, 2)


def test_each_step_is_drawn_by_the_version_the_schedule_names_and_its_ratios_start_at_one(make_trainer):
    tr = make_trainer(small(maxSteps=STEPS, staleness=2))
    drawn, versions = {}, {}
    send = tr.ahead._send

    def recording(step, weights):
        drawn[step] = digest(weights)
        return send(step, weights)

    tr.ahead._send = recording
    try:
        metrics = []
        for step in range(STEPS):
            versions[step] = digest(tr.adapter_state())       # version `step`: the weights as it starts
            metrics.append(tr.train_step(step))
    finally:
        tr.close()
    assert drawn == {k: versions[drawing_version(k, 2)] for k in range(STEPS)}
    assert [m["staleness"] for m in metrics] == [0, 1, 2, 2, 2, 2]
    # step 1 is drawn and trained by version 0: the draft's log-probabilities are the trainer's
    assert abs(metrics[0]["isRatioMean"] - 1) < 1e-4 and metrics[0]["isTruncated"] == 0
    assert all(m["isRatioMin"] <= m["isRatioMean"] <= m["isRatioMax"] for m in metrics)
    assert tr.sampler_status()["staleness"] == 2


def run_through(make, folder, params, start_from=None):
    tr = make(params)
    try:
        start = load_state(tr, start_from) if start_from is not None else 0
        for step in range(start, STEPS):
            tr.train_step(step)
        return adapter_bytes(save(tr, STEPS, folder))
    finally:
        tr.close()


def test_a_kill_after_a_checkpoint_resumes_to_the_uninterrupted_adapter_bytes(make_trainer, tmp_path):
    params = small(maxSteps=STEPS, staleness=2)
    reference = run_through(make_trainer, tmp_path / "ref", params)
    for at in (1, 3):                 # before the schedule's lag is reached, and after
        tr = make_trainer(params)
        try:
            for step in range(at):
                tr.train_step(step)
            ckpt = save(tr, at, tmp_path / f"ckpt-{at}")     # the producer is drawing steps at..at+1 meanwhile
        finally:
            tr.close()                                        # killed: what it drew is lost
        assert run_through(make_trainer, tmp_path / f"resumed-{at}", params, start_from=ckpt) == reference, at


class Tripwire(threading.Event):
    """The run's stop request, set at its first look while the trainer waits for step `at`'s
    rollouts (the producer process is drawing step at+1 then): a notice that lands mid-draw."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.current = at, -1

    def is_set(self) -> bool:
        if self.current == self.at:
            self.set()
        return super().is_set()


def test_a_notice_while_the_producer_draws_aborts_it_and_the_resume_ends_byte_identical(length_reward, tmp_path):  # noqa: F811
    from grpo_run.runner.home import ensure_model
    from grpo_run.trainer.envs.catalog import catalog_environment, user_environment
    from grpo_run.trainer.trainer import GRPOTrainer

    params = small(maxSteps=STEPS, staleness=1)
    arith = catalog_environment("arithmetic", seed=0, n_eval=params.evalTasks)
    env = user_environment(name="length", reward_ref=length_reward, tasks=list(arith.train_tasks),
                           eval_tasks=list(arith.eval_tasks))

    def make(p, stop=None):
        return GRPOTrainer(ensure_model("tiny:char"), env, p, stop=stop)

    reference = run_through(make, tmp_path / "ref", params)
    stop = Tripwire(at=2)
    tr = make(params, stop)
    completed = 0
    try:
        while completed < STEPS and not stop.is_set():       # the recipe looks before every step
            stop.current = completed
            try:
                tr.train_step(completed)
            except GenerationInterrupted:
                break
            completed += 1
        assert stop.is_set() and completed == 2
        assert tr.ahead.process.abort.is_set(), "the notice did not reach the producer process"
        ckpt = save(tr, completed, tmp_path / "stopped")
    finally:
        tr.close()
    assert not tr.ahead.process.child.is_alive()
    assert run_through(make, tmp_path / "resumed", params, start_from=ckpt) == reference


def test_the_producer_process_gives_up_its_draw_between_two_tokens_once_aborted(make_trainer):
    tr = make_trainer(small(maxSteps=3, staleness=1))
    try:
        tr.ahead.process.abort.set()       # before it draws: its first look between two tokens gives up
        drawn = tr.ahead.process.submit(0, tr.adapter_state(), *tr._step_group(0)[2:], tr.params.temperature)
        with pytest.raises(GenerationInterrupted):
            drawn.result()
        assert drawn.done() and isinstance(drawn.exception(), GenerationInterrupted)
    finally:
        tr.close()


def test_a_failing_or_dead_producer_process_fails_the_step_with_its_reason_never_hangs(make_trainer):
    from grpo_run.trainer.producer import ProducerFailed

    tr = make_trainer(small(maxSteps=3, staleness=1))
    try:
        broken = {k: t for k, t in list(tr.adapter_state().items())[1:]}     # one adapter tensor missing
        drawn = tr.ahead.process.submit(0, broken, *tr._step_group(0)[2:], tr.params.temperature)
        with pytest.raises(ProducerFailed, match="the producer process .* failed: .*KeyError"):
            drawn.result()
        tr.ahead.process.child.kill()
        tr.ahead.process.child.join()
        with pytest.raises(ProducerFailed, match="died with exit code -9"):
            tr.train_step(0)
    finally:
        tr.close()


def test_every_task_is_trained_exactly_once_per_epoch_across_a_resume(length_reward, tmp_path):  # noqa: F811
    from grpo_run.runner.home import ensure_model
    from grpo_run.trainer.envs.catalog import catalog_environment, user_environment
    from grpo_run.trainer.trainer import GRPOTrainer

    params = small(maxSteps=STEPS, staleness=2, promptsPerStep=2)
    arith = catalog_environment("arithmetic", seed=0, n_eval=params.evalTasks)
    tasks = list(arith.train_tasks)[:STEPS * 2]                # one epoch: every task once in STEPS steps
    env = user_environment(name="length", reward_ref=length_reward, tasks=tasks, eval_tasks=list(arith.eval_tasks))
    trained: list[str] = []

    def make():
        tr = GRPOTrainer(ensure_model("tiny:char"), env, params)
        run = tr.update.run

        def counting(step, batch, *args, **kw):
            trained.extend(batch.prompts[::params.numGenerations])
            return run(step, batch, *args, **kw)
        tr.update.run = counting
        return tr

    tr = make()
    try:
        for step in range(3):
            tr.train_step(step)
        ckpt = save(tr, 3, tmp_path / "ckpt")
    finally:
        tr.close()
    tr = make()
    try:
        for step in range(load_state(tr, ckpt), STEPS):
            tr.train_step(step)
    finally:
        tr.close()
    assert sorted(trained) == sorted(t["prompt"] for t in tasks)


def test_the_drawing_policys_log_probabilities_are_recorded_as_it_samples(make_trainer):
    from grpo_run.trainer import grpo

    tr = make_trainer(small(maxSteps=2, staleness=1))
    try:
        batch, version = tr.ahead.take(0)
        assert version == 0 and batch.engine_logprobs is not None
        with torch.no_grad():
            mine = grpo.completion_logprobs(tr.model.eval(), batch.prompt_ids, batch.prompt_mask, batch.ids,
                                            batch.mask, tr.params.temperature)
        drawn = batch.mask.bool()
        assert torch.allclose(mine[drawn], batch.engine_logprobs[drawn], atol=1e-4)
    finally:
        tr.close()


def test_a_producer_that_does_not_sample_the_trained_policy_fails_the_first_step_before_it_is_applied(make_trainer):
    from grpo_run.trainer.sampling.engines import EngineDisagrees

    tr = make_trainer(small(maxSteps=3, staleness=1))
    live = tr.ahead.live

    def wrong():             # the snapshot the producer draws with is not the trained adapter
        return {k: t + torch.randn_like(t) * 3 for k, t in live().items()}

    tr.ahead.live = wrong
    before = digest(tr.adapter_state())
    try:
        with pytest.raises(EngineDisagrees, match="step 1: the sampling engine's log-probabilities"):
            tr.train_step(0)
        assert digest(tr.adapter_state()) == before
    finally:
        tr.close()


def test_a_held_out_evaluation_while_the_producer_draws_changes_nothing_of_the_training(make_trainer, tmp_path):
    params = small(maxSteps=STEPS, staleness=1)
    reference = run_through(make_trainer, tmp_path / "ref", params)
    tr = make_trainer(params)
    try:
        for step in range(STEPS):
            tr.train_step(step)
            if step in (1, 3):                      # the producer is drawing the next step meanwhile
                assert tr.ahead.pending and tr.evaluate(tr.env.eval_tasks).tasks == len(tr.env.eval_tasks)
        assert adapter_bytes(save(tr, STEPS, tmp_path / "evaluated")) == reference
    finally:
        tr.close()


KILLED_TRAINER = """
import os, signal, sys
from grpo_run.runner.home import ensure_model
from grpo_run.trainer.producer import ProducerProcess
from tests.trainer.test_training import small

params = small(staleness=1)
p = ProducerProcess(model_path=ensure_model("tiny:char"), params=params, settings=None, pad_id=0, eos_ids=[0],
                    compiled=False, threads=1, stop=lambda: False)
print(p.child.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)       # the trainer lost: no close(), no exit handlers
"""


def test_the_producer_process_dies_with_a_killed_trainer(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.faults.harness import wait_until

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", KILLED_TRAINER], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    child = int(proc.stdout.split()[0])

    def gone() -> bool:
        try:
            return Path(f"/proc/{child}/stat").read_text().split()[2] == "Z"     # reaped soon, or a zombie
        except FileNotFoundError:
            return True
    wait_until("the producer process ended with its trainer", gone, timeout=120)
