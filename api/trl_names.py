"""TRL's GRPOConfig names that grpo_run.train() does not take, each with what grpo-run has instead.

train() refuses an unknown keyword with a hint; for these the hint is this table's line, never the
nearest spelling (difflib took num_train_epochs for num_iterations, GRPO's inner iterations, and
per_device_train_batch_size for eval_batch_size). TRL names that train() takes as they are
(num_generations, beta, epsilon, num_iterations, loss_type, learning_rate, max_steps,
max_completion_length, temperature, top_p, top_k, repetition_penalty, save_steps, eval_steps,
seed, warmup_steps, weight_decay, max_grad_norm, gradient_checkpointing, mask_truncated_completions)
need no line. docs/python-api.md shows the table (a test keeps the two the same).
"""

from __future__ import annotations

TRL_NAMES: dict[str, str] = {
    "num_train_epochs": "grpo-run counts steps, not epochs: max_steps (one step is prompts_per_step prompts, each "
                        "sampled num_generations times)",
    "per_device_train_batch_size": "TRL's counts completions per device; grpo-run counts prompts: prompts_per_step "
                                   "(a step's completions are prompts_per_step x num_generations), and "
                                   "micro_batch_size bounds the memory of the update",
    "gradient_accumulation_steps": "grpo-run has none to set: a step is prompts_per_step prompts, updated in "
                                   "micro-batches of micro_batch_size whose gradients add up",
    "generation_batch_size": "grpo-run samples a step's prompts_per_step x num_generations completions at once: "
                             "set prompts_per_step",
    "steps_per_generation": "grpo-run updates num_iterations times on each step's completions",
    "max_prompt_length": "grpo-run takes prompts whole (no prompt limit: keep them short); max_completion_length "
                         "bounds what the model writes",
    "per_device_eval_batch_size": "eval_batch_size",
    "lr_scheduler_type": "lr_scheduler (constant, linear or cosine)",
    "scale_rewards": "advantages are divided by the group's std, advantage_std='sample' (n-1, as TRL) or "
                     "'population'; loss_type='dr_grpo' is Dr. GRPO's, without it",
    "reward_weights": "give each reward with its weight: rewards=[(correct, 1.0), (length_penalty, 0.1)]",
    "use_vllm": "sampler='vllm' (or 'auto', the default: vLLM where it serves the job; docs/sampling.md)",
    "vllm_mode": "vllm={'mode': 'colocate'} or {'mode': 'server', 'server': 'http://HOST:PORT'}",
    "vllm_gpu_memory_utilization": "vllm={'gpuMemoryUtilization': 0.3}",
    "vllm_server_host": "vllm={'mode': 'server', 'server': 'http://HOST:PORT'}",
    "vllm_server_port": "vllm={'mode': 'server', 'server': 'http://HOST:PORT'}",
    "peft_config": "lora={'r': 8, ...} and method='LoRA', 'QLoRA' or 'Full'",
    "output_dir": "a job writes under $GRPO_RUN_HOME/runs/NAME (and storage=URL); export() writes the adapter "
                  "where you say",
    "logging_steps": "grpo-run logs a progress line every 5% of the steps; every step's metrics go to the record "
                     "(grpo-run report) and the trackers",
    "eval_strategy": "eval_steps=N evaluates the held-out tasks every N steps (a baseline and a final evaluation "
                     "always run)",
    "save_strategy": "save_steps=N (a checkpoint every N steps, and at a spot notice)",
    "model_init_kwargs": "grpo-run loads the model itself: method picks LoRA, QLoRA (4-bit) or Full",
}


def trl_hint(name: str) -> str | None:
    """The hint for TRL's GRPOConfig `name`, in train()'s error ("TRL's NAME: ..."), or None."""
    advice = TRL_NAMES.get(name)
    return None if advice is None else f"TRL's {name}: {advice}"
