"""The producer of an asynchronous run on a CPU (trainer.ahead) as a process of its own.

Why a process: the tiny models' kernels last microseconds, so a producer *thread* and the update
take turns holding Python's interpreter lock and a second core buys nothing (docs/sampling.md's
measurements). A spawned process has its own interpreter: it samples on its own threads
(`split_threads`) while the trainer updates.

The child loads the model folder the trainer loaded (trainer.model.policy.load_policy: the same
dtype and adapter layout), its own tokenizer, and the native decoder with the trainer's settings
(recording each drawn token's log-probability). A request is (step, the drawing version's adapter
tensors, the step's prompts each G times, their seeds, the temperature); the reply is the step's
Rollouts, what the producer thread returns. Requests are served in order, one at a time: what a
step draws depends on its request alone, so the schedule and the bytes never depend on timing.

Messages cross as bytes of the standard pickle (copies): torch's own pickler would move the
tensors to shared memory, whose lifetime is the sender's. A stop request reaches the child through
a shared event it asks between two tokens, as the thread asked the run's stop request; closing
kills it (what it was drawing is drawn again on resume). A child that fails replies its
traceback; one that dies without a word is noticed while the trainer waits (never a hang): both
raise ProducerFailed, an infrastructure failure (the attempt is restarted as a crash).
"""

from __future__ import annotations

import os
import pickle
import queue
import traceback
from typing import Any, Callable, Mapping, Sequence

import torch

from grpo_run.trainer.sampling.engines import EngineUnavailable
from grpo_run.trainer.sampling.sampler import GenerationInterrupted

POLL_S = 0.02       # how often a waiting trainer asks its stop request and whether the child lives


class ProducerFailed(EngineUnavailable):
    """The producer process failed or died: an infrastructure failure (the attempt restarts)."""


def _serve(setup: bytes, requests: Any, replies: Any, abort: Any) -> None:
    """The child's body: load, then draw each request's step until told to end (None)."""
    from grpo_run.checkpoint.procs import die_with_parent

    s = pickle.loads(setup)
    # killed with the trainer (SIGKILL, a lost node): `daemon` covers only a trainer that exits; a
    # trainer gone before this line is seen by its pid (this process was handed to another parent)
    die_with_parent()
    if os.getppid() != s["parent"]:
        return
    try:
        torch.set_num_threads(s["threads"])
        from peft import get_peft_model_state_dict

        from grpo_run.trainer.model.policy import load_policy, load_tokenizer
        from grpo_run.trainer.rollout import build_rollout
        from grpo_run.trainer.sampling.engines import NativeSampler
        from grpo_run.trainer.sampling.start import stop_strings_check

        device = torch.device("cpu")
        tokenizer = load_tokenizer(s["model_path"])
        model = load_policy(s["model_path"], s["params"], device)
        model.requires_grad_(False)
        model.eval()
        adapter = get_peft_model_state_dict(model, save_embedding_layers=False)
        sampler = NativeSampler(model, s["settings"], pad_id=s["pad_id"], device=device,
                                finished=stop_strings_check(tokenizer, s["params"].stopStrings),
                                compiled=s["compiled"], keep_decoder=True, logprobs=True)
        rollout = build_rollout(sampler, tokenizer, s["eos_ids"], system_prompt=s["params"].systemPrompt,
                                template_kwargs=s["params"].chatTemplateKwargs, host=None, max_turns=1,
                                context=2**31 - 1, device=device, stop=abort)
    except BaseException:                 # noqa: BLE001 -- whatever it is, the trainer says it
        replies.put(pickle.dumps(("error", None, traceback.format_exc())))
        return
    while True:
        message = requests.get()
        if message is None:
            return
        step, weights, group, seeds, temperature = pickle.loads(message)
        try:
            with torch.no_grad():
                for name, tensor in adapter.items():
                    tensor.copy_(weights[name])
            reply = ("ok", step, rollout.play(group, seeds, temperature))
        except GenerationInterrupted:
            reply = ("interrupted", step, None)
        except BaseException:              # noqa: BLE001
            reply = ("error", step, traceback.format_exc())
        replies.put(pickle.dumps(reply))


class Drawn:
    """One step's rollouts as the child draws them: `result()` waits for them (asking the run's
    stop request while it waits), `done()`/`exception()` as a Future's."""

    def __init__(self, process: "ProducerProcess", step: int) -> None:
        self.process, self.step = process, step
        self.value: Any = None
        self.error: BaseException | None = None
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def exception(self) -> BaseException | None:
        return self.error

    def result(self) -> Any:
        self.process.wait(self)
        if self.error is not None:
            raise self.error
        return self.value


class ProducerProcess:
    """The parent's side: the spawned child, its two queues and the shared abort event.

    `stop`: the run's stop request, asked (looked up at every call) while the trainer waits for a
    step; once it answers true the child's draw is aborted and the wait raises
    GenerationInterrupted."""

    def __init__(self, *, model_path: str, params: Any, settings: Any, pad_id: int, eos_ids: Sequence[int],
                 compiled: bool, threads: int, stop: Callable[[], bool]) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        self.stop = stop
        self.requests, self.replies, self.abort = ctx.Queue(), ctx.Queue(), ctx.Event()
        self.waiting: dict[int, Drawn] = {}
        setup = pickle.dumps({"model_path": model_path, "params": params, "settings": settings, "pad_id": pad_id,
                              "eos_ids": list(eos_ids), "compiled": compiled, "threads": threads,
                              "parent": os.getpid()})
        # daemon: it never outlives the trainer's process, even one that ends without close()
        self.child = ctx.Process(target=_serve, args=(setup, self.requests, self.replies, self.abort),
                                 name="grpo-run-producer", daemon=True)
        self.child.start()

    def submit(self, step: int, weights: Mapping[str, torch.Tensor], group: Sequence[Any], seeds: Sequence[int],
               temperature: float) -> Drawn:
        drawn = self.waiting[step] = Drawn(self, step)
        plain = {k: t.detach().cpu().clone() for k, t in weights.items()}
        self.requests.put(pickle.dumps((step, plain, list(group), list(seeds), temperature)))
        return drawn

    def wait(self, drawn: Drawn) -> None:
        """Until `drawn` has its reply, its abort, or the child's failure."""
        while not drawn.finished:
            if self.stop():
                self.abort.set()          # the child gives up between two tokens; a resume draws again
                self._finish(drawn, error=GenerationInterrupted())
                return
            try:
                raw = self.replies.get(timeout=POLL_S)
            except queue.Empty:
                if not self.child.is_alive():
                    self._fail(f"the producer process (spawned to sample ahead) died with exit code "
                               f"{self.child.exitcode} without a reply")
                continue
            kind, step, value = pickle.loads(raw)
            if kind == "error":
                reason = value.strip().splitlines()[-1]          # the exception; its traceback follows
                self._fail(f"the producer process (sampling ahead) failed: {reason}\n{value.strip()}")
            target = self.waiting.pop(step, None)
            if target is not None:
                if kind == "ok":
                    self._finish(target, value=value)
                else:
                    self._finish(target, error=GenerationInterrupted())

    def _finish(self, drawn: Drawn, *, value: Any = None, error: BaseException | None = None) -> None:
        drawn.value, drawn.error, drawn.finished = value, error, True
        self.waiting.pop(drawn.step, None)

    def _fail(self, message: str) -> None:
        error = ProducerFailed(message)
        for drawn in list(self.waiting.values()):
            self._finish(drawn, error=error)
        raise error

    def close(self) -> None:
        """Ends the child at once (what it draws is drawn again on resume) and its queues."""
        self.abort.set()
        if self.child.is_alive():
            self.child.kill()
        self.child.join(timeout=30)
        for q in (self.requests, self.replies):
            q.cancel_join_thread()     # a request the dead child never read must not hold our exit
            q.close()
