"""The trainer's state as checkpoint files: written through the shared-buffer path
(`pack` + `write_files`) and read back, a run continues exactly where it would have."""

import json

import pytest
import torch

from grpo_run.checkpoint.writer import write_files
from tests.trainer.test_training import length_reward, make_trainer, small  # noqa: F401
from grpo_run.trainer.config import LoraParams
from grpo_run.trainer.checkpointing.snapshot import (TRAINER_STATE, TRAINING_STATE, load_state, pack, state_files)


def save(trainer, step, folder):
    layout, buffer = pack(state_files(trainer, step), bytearray)
    write_files(folder, layout, buffer)
    return folder


def test_a_restored_trainer_takes_the_same_next_step_as_the_original(make_trainer, tmp_path):
    a, b = make_trainer(small()), make_trainer(small())
    try:
        for step in range(2):
            a.train_step(step)
        folder = save(a, 2, tmp_path / "ckpt")
        torch.manual_seed(123)                # the global RNG must come back from the checkpoint
        assert load_state(b, folder) == 2
        ma, mb = a.train_step(2), b.train_step(2)
        after_a, after_b = save(a, 3, tmp_path / "a"), save(b, 3, tmp_path / "b")
    finally:
        a.close()
        b.close()
    assert ma["loss"] == mb["loss"] and ma["rewardMean"] == mb["rewardMean"]
    for name in ("adapter/adapter_model.safetensors", TRAINING_STATE, TRAINER_STATE):
        assert (after_a / name).read_bytes() == (after_b / name).read_bytes(), name


def test_the_checkpoint_holds_standard_peft_files_and_the_optimizer_state(make_trainer, tmp_path):
    from peft import PeftConfig
    from safetensors.torch import load_file

    tr = make_trainer(small())
    try:
        tr.train_step(0)
        folder = save(tr, 1, tmp_path / "ckpt")
        moments = torch.cat([tr.optimizer.state[p]["exp_avg"].reshape(-1)
                             for g in tr.optimizer.param_groups for p in g["params"]])
    finally:
        tr.close()
    assert PeftConfig.from_pretrained(folder / "adapter").r == 8
    assert set(load_file(folder / "adapter" / "adapter_model.safetensors")) == set(tr.adapter_state())
    state = load_file(folder / TRAINING_STATE)
    assert torch.equal(state["optimizer.exp_avg"], moments)
    assert json.loads((folder / TRAINER_STATE).read_text())["step"] == 1


def test_a_checkpoint_of_another_adapter_shape_is_refused_with_the_reason(make_trainer, tmp_path):
    a, b = make_trainer(small()), make_trainer(small(lora=LoraParams(r=4)))
    try:
        a.train_step(0)
        folder = save(a, 1, tmp_path / "ckpt")
        with pytest.raises(ValueError, match="(weights|optimizer state) do(es)? not fit this run's trainable parameters; the job's lora settings"):
            load_state(b, folder)
    finally:
        a.close()
        b.close()


def test_a_checkpoint_in_the_earlier_format_is_refused_with_what_to_do(make_trainer, tmp_path):
    tr = make_trainer(small())
    try:
        tr.train_step(0)
        folder = save(tr, 1, tmp_path / "ckpt")
        (folder / TRAINING_STATE).rename(folder / "optimizer.pt")
        with pytest.raises(ValueError, match="earlier grpo-run .* run the job again under a new metadata.name"):
            load_state(tr, folder)
    finally:
        tr.close()


def test_every_checkpoint_holds_the_metrics_so_far_also_those_from_before_a_resume(make_trainer, tmp_path):  # noqa: F811
    from grpo_run.trainer.checkpointing.checkpointer import Checkpointer
    from grpo_run.trainer.protocol import STEP_METRICS

    root, reported = tmp_path / "checkpoints", {}

    def train(trainer, steps):
        checkpoints = Checkpointer(root, interval=2)
        checkpoints.attach(trainer)
        start = checkpoints.load_latest()
        try:
            for step in range(start, start + steps):
                reported[step + 1] = trainer.train_step(step)
                checkpoints.add_metrics(step + 1, reported[step + 1])
                checkpoints.save(step + 1)
            checkpoints.sealed(wait_for=start + steps)
        finally:
            checkpoints.close()
            trainer.close()
        return start

    assert train(make_trainer(small()), 2) == 0
    assert train(make_trainer(small()), 2) == 2          # resumed from the checkpoint at step 2
    held = json.loads((root / "ckpt-00000004" / STEP_METRICS).read_text())
    assert [s["step"] for s in held] == [1, 2, 3, 4]
    assert all({k: v for k, v in s.items() if k != "step"} == reported[s["step"]] for s in held)
