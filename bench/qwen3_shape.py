"""Two GRPO-LoRA steps of a model shaped like Qwen3-0.6B (its real config, random weights).

    .venv/bin/python bench/qwen3_shape.py                       # CPU, 64-token completions, ~10 min on 2 cores
    .venv/bin/python bench/qwen3_shape.py --tokens 1024 --gpu H100-SXM-80GB   # on a GPU node

Nothing is downloaded: the model is built from Qwen3-0.6B's config.json values alone (28 layers,
hidden 1024, 16 heads / 8 KV heads of 128, vocabulary 151,936, tied embeddings) with the local
byte-level BPE chat tokenizer (trainer.tinymodel.build_chat_model), saved, and loaded back
through `from_pretrained` as a hub model would be. It runs B x G = 2 x 4 completions per step,
LoRA r=8 on every linear layer, and prints each step's time, the peak memory (the process's
resident set on a CPU, torch's peak allocation on a GPU) and, beside it, the dry-run estimate
for the same job (`--gpu` picks the card the estimate sizes for).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Qwen/Qwen3-0.6B config.json: the values that shape the network.
QWEN3_0_6B = dict(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40_960,
                  rope_theta=1_000_000, rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.02)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="maxCompletionLength (default 64)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--gpu", default="RTX-4090", help="the GPU the dry-run estimate sizes for")
    ap.add_argument("--model", help="a folder built by an earlier run (skips building)")
    args = ap.parse_args()

    import torch

    from grpo_run.runner.estimate.memory import memory_estimate
    from grpo_run.trainer.config import GRPOParams
    from grpo_run.trainer.envs.catalog import catalog_environment
    from grpo_run.trainer.trainer import GRPOTrainer
    from grpo_run.trainer.model.policy import fix_mmap_threshold
    from grpo_run.trainer.model.tinymodel import build_chat_model

    fix_mmap_threshold()                 # as the trainer process of `grpo-run apply` does

    t0 = time.perf_counter()
    model = args.model or str(build_chat_model(Path(tempfile.mkdtemp()) / "qwen3-0.6b-shaped", config=QWEN3_0_6B))
    built = time.perf_counter() - t0
    # gsm8k-shaped prompts without the data set: questions in words, the answer to box
    arith = catalog_environment("arithmetic", seed=0)
    env = type(arith)(name="words", rewards=arith.rewards, eval_tasks=arith.eval_tasks[:2], train_tasks=tuple(
        {"prompt": f"What is {t['prompt'][0]} plus {t['prompt'][2]}? Put the answer in \\boxed{{}}.",
         "answer": t["answer"]} for t in arith.train_tasks))
    params = GRPOParams(numGenerations=4, promptsPerStep=2, maxCompletionLength=args.tokens, maxSteps=args.steps,
                        learningRate=1e-4, seed=0, chatTemplateKwargs={"enable_thinking": False})
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model, env, params)
    loaded = time.perf_counter() - t0
    cuda = trainer.device.type == "cuda"
    steps = []
    try:
        for step in range(args.steps):
            m = trainer.train_step(step)
            steps.append({k: m[k] for k in ("stepSeconds", "sampleSeconds", "completionLength", "microBatches")})
            print(f"step {step + 1}: {m['stepSeconds']:.1f} s ({m['sampleSeconds']:.1f} s sampling), "
                  f"{m['completionLength']:.0f} tokens per completion, {m['microBatches']} micro-batch(es)", flush=True)
    finally:
        trainer.close()
    peak = (torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    config = json.loads((Path(model) / "config.json").read_text())
    est = memory_estimate(config, method="LoRA", lora_r=8, beta=0.0, num_generations=4, prompts_per_step=2,
                          max_completion_length=args.tokens, prompt_tokens=40, gpu=args.gpu).to_dict()
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu", "buildSeconds": round(built, 1),
              "loadSeconds": round(loaded, 1), "steps": steps,
              ("peakAllocatedGB" if cuda else "peakRssGB"): round(peak / 1e9, 2),
              "estimate": {k: est[k] for k in ("parameters", "totalGB", "samplingGB", "updateGB", "neededGB",
                                               "microBatchSize", "fits")}, "estimateGpu": args.gpu}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
