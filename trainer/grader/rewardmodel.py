"""A reward model: a sequence-classification model with one logit that scores prompt + completion,
in the trainer's process on its device (a model, not user code: no sandbox), loaded once, in
bf16 on a GPU, without gradients and outside the optimizer. The reward is the raw logit.

The text is the prompt and the completion as a chat (the prompt's messages, or one user message,
then the completion as the assistant's) through the reward model's own chat template; a
tokenizer without one gets the prompt's text followed by the completion. Each `score` call is
one batch: a training step's completions, or an evaluation batch.

Never imported by the grader's worker (torch).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from grpo_run.trainer.grader.grader import RewardFunctionError
from grpo_run.trainer.model.missing import loading


class RewardModel:
    """Owns one loaded reward model and its tokenizer. Raises ValueError when the model is not a
    one-logit sequence classifier; ModelMissing when it is not there to load; what from_pretrained
    raises for any other failure to load it."""

    def __init__(self, path: str, device: Any = "cpu") -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.path = path
        self.device = torch.device(device)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        with loading("reward model", path):
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModelForSequenceClassification.from_pretrained(path, torch_dtype=dtype).to(self.device)
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward model {path}: has {self.model.config.num_labels} outputs (num_labels); a reward "
                             "model has one logit, the reward (num_labels=1)")
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        self.model.config.pad_token_id = self.tokenizer.pad_token_id     # where each row's last token is
        self.model.eval().requires_grad_(False)
        self.max_length = getattr(self.model.config, "max_position_embeddings", None)

    def text(self, prompt: Any, completion: str) -> str:
        """What the reward model reads: the chat through its template, else prompt then completion."""
        messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": completion}],
                                                      tokenize=False)
        return "\n".join(m["content"] for m in messages) + completion

    def score(self, completions: Sequence[str], tasks: Sequence[Mapping[str, Any]]) -> list[float]:
        """The raw logit for each (task's prompt, completion), one batch. Raises
        RewardFunctionError when a logit is not finite (never a reward)."""
        import torch

        texts = [self.text(task.get("prompt", ""), c) for c, task in zip(completions, tasks)]
        templated = bool(getattr(self.tokenizer, "chat_template", None))    # the template writes its own specials
        batch = self.tokenizer(texts, return_tensors="pt", padding=True, truncation=self.max_length is not None,
                               max_length=self.max_length, add_special_tokens=not templated).to(self.device)
        with torch.inference_mode():
            logits = self.model(**batch).logits[:, 0].float().cpu().tolist()           # [N]
        for i, value in enumerate(logits):
            if not math.isfinite(value):
                raise RewardFunctionError(f"reward model {self.path} gave {value} for completion {i} of {len(logits)}",
                                          ref=self.path, index=i, kind="invalid")
        return logits

    def close(self) -> None:
        self.model = None
