"""Run by test_distributed.py under torchrun (1 or 2 processes): STEPS (default two) GRPO steps of
the tiny model (REWARD a reward function's ref, or episodes=FILE:CLASS) and a held-out evaluation (3 batches, the first 5 tasks' completions kept, so the
kept ones span two ranks' batches), then rank 0 writes the adapter, the steps' metrics and the
evaluation's scores and kept samples to OUT (safetensors + json)."""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def main(reward: str, loss_type: str, out: str, method: str = "LoRA", steps: str = "2") -> None:
    from safetensors.torch import save_file

    from grpo_run.trainer.config import GRPOParams
    from grpo_run.trainer.distributed import World
    from grpo_run.trainer.sharding import full_state
    from grpo_run.trainer.envs.catalog import catalog_environment, user_environment
    from grpo_run.trainer.trainer import GRPOTrainer
    from grpo_run.runner.home import ensure_model

    world = World.from_environment()
    params = GRPOParams(numGenerations=4, promptsPerStep=4, maxCompletionLength=4, maxSteps=4, evalTasks=8,
                        learningRate=2e-3 if method == "LoRA" else 1e-3, seed=0, lossType=loss_type, microBatchSize=3,
                        method=method, evalBatchSize=3, sampleEvalTasks=5)
    arith = catalog_environment("arithmetic", seed=0, n_eval=8)
    if reward.startswith("episodes="):   # an environment that talks back: reset(task, seed), step(reply)
        from grpo_run.trainer.envs.catalog import EpisodeSettings

        ref = reward.removeprefix("episodes=")
        env = user_environment(name="talk", tasks=list(arith.train_tasks), eval_tasks=list(arith.eval_tasks),
                               search_path=(str(Path(ref.rpartition(":")[0]).parent),),
                               episodes=EpisodeSettings(ref, 3))
    else:
        env = user_environment(name="length", reward_ref=reward, tasks=list(arith.train_tasks),
                               eval_tasks=list(arith.eval_tasks))
    tr = GRPOTrainer(ensure_model("tiny:char"), env, params, world=world)
    try:
        metrics, digests = [], []
        for step in range(int(steps)):
            metrics.append(tr.train_step(step))
            digests.append(tr.episode_digests)
        reported = []                   # what rank 0 sends the supervisor as Samples events
        ev = tr.evaluate(env.eval_tasks, on_samples=lambda groups: reported.extend(g.model_dump() for g in groups))
    finally:
        tr.close()
    if method == "Full":                 # a sharded model is gathered by every rank, onto rank 0
        weights = full_state(tr.model, tr.optimizer)[0] if tr.fsdp else dict(tr.model.state_dict())
    else:
        weights = dict(tr.adapter_state())
    if world.main:
        save_file({k: v.detach().clone().contiguous() for k, v in weights.items()}, out + ".safetensors")
        Path(out + ".json").write_text(json.dumps({"metrics": metrics, "eval": list(ev.rewards), "reported": reported,
                                                       "samples": [g.model_dump() for g in ev.samples],
                                                       "digests": digests}))
    world.barrier()
    world.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
