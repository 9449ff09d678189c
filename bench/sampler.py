"""Sampling alone, side by side: the model's own forward against the Llama-family decoder.

    .venv/bin/python bench/sampler.py                 # the shapes of bench/vs_trl.py's configs, ~1 min
    .venv/bin/python bench/sampler.py --compiled      # also the torch.compile'd static decoder (compiles first)

Each shape samples B x G completions of the arithmetic task's prompts with LoRA r=8 over the
model (adapter B random, as after training), EOS never drawn so every completion has the full
length, with the same seed through each decoder in turn, `--rounds` times; prints the median
milliseconds per token of each, their ratio, and whether the tokens drawn are identical.

Where the time went before the Llama-family decoder (py-spy, the demo job, 300 steps): 89% of
sampling was inside the model's forward call, of which 38% in PEFT's LoRA layer wrappers, 10% in
RMSNorm modules, 3% building attention masks, 2% in the cache object; sampling's own work
(softmax, draws, bookkeeping) was 10%.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {"A": ("tiny:char", 8, 8, 8), "B": ("tiny:char", 8, 4, 64), "C": ("bigger", 8, 4, 64)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--compiled", action="store_true", help="also time decode.CompiledDecoder")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import tempfile

    from transformers import AutoTokenizer

    from bench.vs_trl import build_bigger
    from grpo_run.trainer.sampling import decode
    from grpo_run.trainer.sampling import sampler
    from grpo_run.trainer.config import GRPOParams
    from grpo_run.trainer.envs.catalog import arithmetic_tasks
    from grpo_run.trainer.model.policy import fix_mmap_threshold, load_policy
    from grpo_run.runner.home import ensure_model

    fix_mmap_threshold()
    train, _ = arithmetic_tasks(0, None, None)
    folder = Path(tempfile.mkdtemp())
    print(f"{'shape':6} {'decoder':22} {'ms/token':>9} {'vs own forward':>15} {'same tokens':>12}")
    for name, (model_name, b, g, tokens) in SHAPES.items():
        path = build_bigger(folder) if model_name == "bigger" else ensure_model(model_name)
        model = load_policy(path, GRPOParams(lora={"r": 8}), torch.device("cpu")).eval()
        with torch.no_grad():
            gen = torch.Generator().manual_seed(1)
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        tok = AutoTokenizer.from_pretrained(path)
        enc = tok([t["prompt"] for t in train[:b] for _ in range(g)], return_tensors="pt", padding=True)
        decoders = {"model's own forward": lambda m: decode.TransformersDecoder(m),
                    "Llama-family": lambda m: decode.LlamaFamilyDecoder(m)}
        if args.compiled:
            decoders["compiled (static)"] = lambda m: decode.CompiledDecoder.of(m)
        times, outs = {}, {}
        original = sampler.decoder_for
        for label, make in decoders.items():
            sampler.decoder_for = lambda m, compiled=False, keep=False, make=make: make(m)
            try:
                runs = []
                for r in range(args.rounds + 1):                 # the first is a warm-up (compiles)
                    t0 = time.perf_counter()
                    out = sampler.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=tokens,
                                      temperature=1.0, eos_ids=(), pad_id=tok.pad_token_id,
                                      generator=torch.Generator().manual_seed(0))
                    if r:
                        runs.append((time.perf_counter() - t0) / tokens)
            finally:
                sampler.decoder_for = original
            times[label], outs[label] = statistics.median(runs), out.ids
        own = times["model's own forward"]
        for label in decoders:
            same = torch.equal(outs[label], outs["model's own forward"])
            print(f"{name:6} {label:22} {times[label] * 1000:9.3f} {own / times[label]:14.2f}x {str(same):>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
