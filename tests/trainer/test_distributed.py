"""Data parallelism inside the trainer (trainer.distributed): how a step is shared among
processes, and that two processes (gloo) take the step one process takes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_run.trainer.sampling import sampler
from grpo_run.trainer.distributed import World
from grpo_run.trainer.seeds import prompt_seed
from grpo_run.runner.home import ensure_model

HERE = Path(__file__).resolve().parent


def test_the_ranks_shards_cover_the_steps_prompts_in_order_without_overlap():
    for n, size in [(8, 2), (8, 3), (5, 4), (4, 4), (7, 1)]:
        shards = [list(World(rank=r, size=size).shard(n)) for r in range(size)]
        assert sum(shards, []) == list(range(n)), (n, size)
        assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_one_process_agrees_and_gathers_without_a_process_group():
    alone = World()
    assert alone.agree(True, False) == (True, False)
    assert alone.total(2, 3.5) == (2.0, 3.5)
    assert alone.gather({"a": 1}) == [{"a": 1}]
    assert not torch.distributed.is_initialized()


@pytest.fixture(scope="module")
def policy():
    from grpo_run.trainer.config import GRPOParams
    from grpo_run.trainer.model.policy import load_policy, load_tokenizer

    path = ensure_model("tiny:char")
    return load_policy(path, GRPOParams(), torch.device("cpu")), load_tokenizer(path)


def test_a_groups_draws_do_not_depend_on_the_groups_sampled_beside_it(policy):
    """One generator per prompt: prompt 1's group draws the same tokens sampled alone or after
    prompt 0's group in one batch (as on one process, or as the second rank's only prompt)."""
    model, tok = policy
    G = 4

    def sample(prompts, positions):
        enc = tok([p for p in prompts for _ in range(G)], return_tensors="pt", padding=True)
        gens = [torch.Generator().manual_seed(prompt_seed(0, 3, j)) for j in positions]
        return sampler.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=6, temperature=1.0,
                           eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id, generator=gens)

    both = sample(["3+5=", "2+2="], [0, 1])
    alone = sample(["2+2="], [1])
    width = alone.ids.size(1)
    assert torch.equal(both.ids[G:, :width], alone.ids)
    assert not torch.equal(both.ids[:G, :width], alone.ids)          # another prompt, another stream


def _steps(tmp_path: Path, processes: int, reward: str, loss_type: str, method: str = "LoRA",
           steps: int = 2) -> tuple[dict, dict]:
    out = str(tmp_path / f"p{processes}-{loss_type}-{method}-{steps}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
                    str(HERE / "dist_step.py"), reward, loss_type, out, method, str(steps)], check=True, env=env, timeout=240,
                   capture_output=True)
    from safetensors.torch import load_file

    return load_file(out + ".safetensors"), json.loads(Path(out + ".json").read_text())


def test_two_processes_keep_the_evaluation_samples_one_process_keeps(tmp_path):
    """The held-out batches are dealt to the ranks (3 tasks a batch, 8 tasks: rank 0 computes
    batches 0 and 2, rank 1 batch 1), the first 5 tasks' completions kept: rank 0 reports the same
    tasks, once each, with the same completions and rewards as one process."""
    reward = tmp_path / "length_reward.py"
    reward.write_text("def score(completion, task):\n    return float(len(completion))\n")
    _, one = _steps(tmp_path, 1, f"{reward}:score", "grpo", steps=0)
    _, two = _steps(tmp_path, 2, f"{reward}:score", "grpo", steps=0)
    assert [g["item"] for g in one["samples"]] == [0, 1, 2, 3, 4]
    assert two["samples"] == one["samples"]
    assert sorted(two["reported"], key=lambda g: g["item"]) == one["reported"] == one["samples"]
    assert {len(g["completions"]) for g in two["samples"]} == {1}


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_two_processes_take_the_steps_one_process_takes(tmp_path, loss_type):
    """The same prompts, the same draws, the gradient of the same loss (each rank's part
    normalised by the whole step's completions or tokens, averaged by DDP): the adapter after two
    steps equals the one-process adapter up to float rounding, and so do the metrics."""
    reward = tmp_path / "length_reward.py"
    reward.write_text("def score(completion, task):\n    return float(len(completion))\n")
    one, m1 = _steps(tmp_path, 1, f"{reward}:score", loss_type)
    two, m2 = _steps(tmp_path, 2, f"{reward}:score", loss_type)
    assert one.keys() == two.keys() and one
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(one[n], torch.zeros_like(one[n])) for n in one if "lora_B" in n)   # it learned
    for a, b in zip(m1["metrics"], m2["metrics"]):
        assert a["rewardMean"] == b["rewardMean"] and a["learningCompletions"] == b["learningCompletions"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
        assert a["gradNorm"] == pytest.approx(b["gradNorm"], rel=1e-4)
    assert m1["eval"] == m2["eval"]        # evaluation batches dealt to the ranks: the same scores


@pytest.mark.slow
def test_two_processes_play_and_train_the_episodes_one_process_does(tmp_path):
    """Episodes on several processes: each rank plays its share of the step's groups (G episodes of
    a task, seeded by the task's place in the step), and the adapter after two steps, the metrics,
    every episode's digests and the held-out scores are those of one process."""
    env = tmp_path / "talk.py"
    env.write_text("from grpo_run import Step\n\n\nclass Echo:\n"
                   "    def reset(self, task, seed):\n        self.turns = 0\n        return task['prompt']\n\n"
                   "    def step(self, reply):\n        self.turns += 1\n"
                   "        return Step(observation=None if self.turns == 2 else '=' + reply[:2], "
                   "reward=float(len(reply) % 3), done=self.turns == 2)\n")
    one, m1 = _steps(tmp_path, 1, f"episodes={env}:Echo", "grpo")
    two, m2 = _steps(tmp_path, 2, f"episodes={env}:Echo", "grpo")
    assert one.keys() == two.keys() and one
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6)
    assert m2["digests"] == m1["digests"] and len(m1["digests"][0]) == 16        # 4 prompts x 4 episodes
    for a, b in zip(m1["metrics"], m2["metrics"]):
        assert a["rewardMean"] == b["rewardMean"] and a["episodeTurns"] == b["episodeTurns"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    assert m1["eval"] == m2["eval"]


@pytest.mark.slow
def test_a_full_fine_tune_sharded_over_two_processes_takes_the_steps_one_process_takes(tmp_path):
    """Method Full on two processes: FSDP shards the weights, their gradients and Adam's moments;
    after two steps the whole model, gathered, equals the one-process model up to float rounding."""
    reward = tmp_path / "length_reward.py"
    reward.write_text("def score(completion, task):\n    return float(len(completion))\n")
    one, m1 = _steps(tmp_path, 1, f"{reward}:score", "grpo", "Full")
    two, m2 = _steps(tmp_path, 2, f"{reward}:score", "grpo", "Full")
    assert set(one) - set(two) <= {"lm_head.weight"} and two      # the gathered model leaves out tied copies
    from grpo_run.runner.home import ensure_model
    from safetensors.torch import load_file

    start = load_file(Path(ensure_model("tiny:char")) / "model.safetensors")
    assert any(not torch.equal(one[n], start[n]) for n in start if n in one)           # it learned
    for name in two:
        # Adam divides each gradient by its own running size, so an element whose gradient is
        # near 0 turns a rounding difference of the sharded sum into a visible one (CI saw one of
        # 4,096 elements 5.8e-6 apart). Held instead: what the steps changed, as a whole, is the
        # same up to rounding (a tensor's difference is under 0.1% of its update), and at most
        # one element in 1,000 is further apart than 1e-6.
        update = (one[name] - start[name]).float() if name in start else one[name].float()
        apart = (two[name] - one[name]).float()
        assert apart.norm() <= 1e-3 * update.norm() + 1e-7, name
        assert (apart.abs() > 1e-6).float().mean() <= 1e-3, name
    for a, b in zip(m1["metrics"], m2["metrics"]):
        assert a["rewardMean"] == b["rewardMean"]
        assert a["gradNorm"] == pytest.approx(b["gradNorm"], rel=1e-4)
    assert m1["eval"] == m2["eval"]


# --- what crosses between ranks (trainer.distributed, "What a peer can send") ---------------------

def _wire(tmp_path: Path, rank1_secret: str) -> list[dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "wire"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(HERE / "dist_wire.py"), str(out), rank1_secret],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=240, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]


def test_ranks_exchange_json_never_pickles_and_refuse_file_names_outside_their_folder(tmp_path):
    zero, one = _wire(tmp_path, "s3cret")
    for seen in (zero, one):         # unpickling is forbidden in both processes: all of it came as JSON
        assert seen["gathered"] == [{"rank": 0, "loss": 0.1, "pairs": [[0, "d"]]},
                                    {"rank": 1, "loss": 0.2, "pairs": [[1, "d"]]}]
        assert seen["broadcast"] == {"plan": "rank 0's", "n": 3}
    assert zero["rng same"]
    assert one["received"] == ["adapter/weights.bin", "state.json"] and one["bytes same"]
    assert len(one["forged"]) == 3 and all("refused" in e for e in one["forged"]), one["forged"]
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "outside" / "escaped").exists()
    assert not (tmp_path / "absolute").exists()


def test_a_failure_in_the_store_counts_only_with_this_attempts_node_signature(tmp_path):
    zero, _ = _wire(tmp_path, "s3cret")
    assert zero["admitted"] is True
    assert zero["told"] == "reward function failed on node 1: no nines"
    assert zero["planted"] is None and zero["forged mac"] is None      # a stranger's text: a lost rank


def test_a_rank_without_the_node_secret_is_refused_before_anything_is_sent(tmp_path):
    for secret in ("", "another"):
        zero, one = _wire(tmp_path / (secret or "none"), secret)
        for seen in (zero, one):
            assert "rank(s) [1] did not prove the job's node secret" in seen["admitted"], seen["admitted"]


def test_only_json_crosses_between_ranks():
    from grpo_run.trainer.distributed import to_wire

    assert to_wire({"a": [1, 2.5, None, True, ("x",)]}) == b'{"a":[1,2.5,null,true,["x"]]}'
    with pytest.raises(TypeError, match="key 3 is a int"):
        to_wire({"digests": {3: "d"}})            # JSON would turn it into "3": said, not silently changed
    with pytest.raises(TypeError, match="ranks exchange JSON values only"):
        to_wire({"state": torch.zeros(2)})


def test_a_received_file_name_must_stay_in_the_receiving_folder(tmp_path):
    from grpo_run.trainer.distributed import UnsafeName, checked_listing, received_path

    into = tmp_path / "into"
    into.mkdir()
    (into / "out").symlink_to(tmp_path)
    assert received_path(into, "adapter/adapter_model.safetensors") == into.resolve() / "adapter/adapter_model.safetensors"
    for bad in ("../x", "/etc/passwd", "a/../../x", "", ".", "a//b", "out/x", 3):
        with pytest.raises(UnsafeName):
            received_path(into, bad)
    with pytest.raises(UnsafeName):
        checked_listing([["ok", 1], ["../x", 0]], into)


def test_a_ranks_rng_state_goes_to_json_and_back_unchanged():
    import numpy as np
    import random

    from grpo_run.trainer.checkpointing.snapshot import rng_from_json, rng_state, rng_to_json

    torch.manual_seed(3), np.random.seed(4), random.seed(5)
    np.random.standard_normal()                 # numpy's cached gaussian is part of its state
    state = rng_state(torch.device("cpu"))
    back = rng_from_json(json.loads(json.dumps(rng_to_json(state))))
    assert torch.equal(back["torch"], state["torch"])
    assert back["python"] == state["python"]
    assert back["numpy"][0] == state["numpy"][0] and (back["numpy"][1] == state["numpy"][1]).all()
    assert back["numpy"][2:] == tuple(state["numpy"][2:])
    with pytest.raises(ValueError, match="not one"):
        rng_from_json({"torch": "x"})
