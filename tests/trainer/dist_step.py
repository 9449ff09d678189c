"""Run by test_distributed.py under torchrun (1 or 2 processes): two GRPO steps of the tiny model,
then rank 0 writes the adapter and the steps' metrics to OUT (safetensors + json)."""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def main(reward: str, loss_type: str, out: str) -> None:
    from safetensors.torch import save_file

    from trainer.config import GRPOParams
    from trainer.distributed import World
    from trainer.envs import catalog_environment, user_environment
    from trainer.loop import GRPOTrainer
    from trainer.tinymodel import ensure_model

    world = World.from_environment()
    params = GRPOParams(numGenerations=4, promptsPerStep=4, maxCompletionLength=4, maxSteps=4, evalTasks=8,
                        learningRate=2e-3, seed=0, lossType=loss_type, microBatchSize=3)
    arith = catalog_environment("arithmetic", seed=0, n_eval=8)
    env = user_environment(name="length", reward_ref=reward, tasks=list(arith.train_tasks),
                           eval_tasks=list(arith.eval_tasks))
    tr = GRPOTrainer(ensure_model("tiny:char"), env, params, world=world)
    try:
        metrics = [tr.train_step(step) for step in range(2)]
        ev = tr.evaluate(env.eval_tasks)
    finally:
        tr.close()
    if world.main:
        save_file({k: v.contiguous() for k, v in tr.adapter_state().items()}, out + ".safetensors")
        Path(out + ".json").write_text(json.dumps({"metrics": metrics, "eval": list(ev.rewards)}))
    world.barrier()
    world.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
