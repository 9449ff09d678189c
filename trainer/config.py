"""The trainer's parameters: frozen pydantic models that know their YAML names, defaults and limits.

`spec.parameters` of a TrainingJob is validated here (pydantic v2, strict types, unknown keys
forbidden). `problems_in` turns a ValidationError into the house error format, one line per
problem, each naming the field, what was given and what is allowed, e.g.
`spec.parameters.numGenerations: must be >= 2 (got 1): GRPO needs a group to compare`.
"""

from __future__ import annotations

import difflib
import typing
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

METHODS = ("LoRA", "QLoRA", "Full")
LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
STD_CONVENTIONS = ("sample", "population")
SCHEDULERS = ("constant", "linear", "cosine")
SAMPLERS = ("native", "vllm", "auto")
VLLM_MODES = ("colocate", "server")
# spec.parameters.staleness at most: each step in flight holds a batch of rollouts and, in every
# checkpoint, the adapter that drew it; past a few steps the correction's ratios mostly truncate
# (docs/sampling.md), so more lag buys no speed and costs learning
MAX_STALENESS = 8


# Elements of one chunk of logits upcast to fp32 at a time by the selective log-softmax (256 MB);
# with Qwen3's 151,936-token vocabulary that is ~440 token positions.
LOGPROB_CHUNK_ELEMENTS = 2**26
# The share of a device one micro-batch's logits and their gradient may take when
# microBatchSize is left to the trainer: a quarter of a GPU, 2 GiB of a CPU's memory.
GPU_LOGITS_SHARE = 0.25
CPU_LOGITS_BYTES = 2 * 1024**3


def default_micro_batch(completions: int, logit_positions: int, vocab: int, itemsize: int,
                        device_bytes: int | None) -> int:
    """Completions per forward/backward when the job leaves microBatchSize out: as many as keep
    one micro-batch's logits and their gradient (2 x positions x vocab x itemsize bytes per
    completion) within GPU_LOGITS_SHARE of a GPU of `device_bytes`, or CPU_LOGITS_BYTES on a CPU
    (device_bytes None). Depends on the device's size, not its free memory, so every node of the
    same kind picks the same size and a resumed run replays the same arithmetic."""
    budget = int(device_bytes * GPU_LOGITS_SHARE) if device_bytes else CPU_LOGITS_BYTES
    return max(1, min(completions, budget // (2 * logit_positions * vocab * itemsize)))


class Strict(BaseModel):
    """A frozen model whose fields take only their own types (YAML's `true` is never a count,
    "3" is never a number) and whose unknown keys are errors: a typo is never silently ignored."""
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


def problem(text: str) -> PydanticCustomError:
    """An error in the house format, raised from a validator: `text` is the whole message."""
    return PydanticCustomError("problem", "{text}", {"text": text})


def problems_at(title: str, found: list[tuple[tuple[str, ...], str]],
                also: list[Any] = ()) -> ValidationError:
    """Several problems at once from one validator, each at its own field (a location relative to
    the model being validated), after those pydantic already found (`also`, `ValidationError.errors()`)."""
    details: list[InitErrorDetails] = []
    for err in also:
        custom = err["type"] == "problem"
        detail = InitErrorDetails(type=problem(err["msg"]) if custom else err["type"], loc=err["loc"],
                                  input=err.get("input"))
        if "ctx" in err and not custom:
            detail["ctx"] = err["ctx"]
        details.append(detail)
    details += [InitErrorDetails(type=problem(text), loc=loc, input=None) for loc, text in found]
    return ValidationError.from_exception_data(title, details)


class LoraParams(Strict):
    r: int = Field(8, ge=1)
    alpha: float | None = None          # None: 2 x r
    dropout: float = Field(0.0, ge=0, le=0.99)
    targetModules: str | tuple[str, ...] = "all-linear"

    @field_validator("targetModules", mode="before")
    @classmethod
    def _modules(cls, v: Any) -> Any:
        if v == "all-linear":
            return v
        if isinstance(v, (list, tuple)) and v and all(isinstance(x, str) and x for x in v):
            return tuple(v)
        raise problem(f"must be \"all-linear\" or a list of module names like [q_proj, v_proj] (got {fmt(v)})")

    @property
    def scaling_alpha(self) -> float:
        return self.alpha if self.alpha is not None else 2.0 * self.r


class VllmParams(Strict):
    """`spec.parameters.vllm`: the vLLM engine's settings (docs/sampling.md)."""
    # colocate: the engine in the trainer's process, on its GPU (TRL's default); server: a
    # `grpo-run vllm-server` on another GPU or node, at `server`
    mode: Literal[VLLM_MODES] = "colocate"
    server: str | None = None                    # mode server: the server's address, http://HOST:PORT
    serverTimeoutSeconds: float = Field(600.0, gt=0)   # one call to the server (a step's sampling) at most
    # the share of the GPU the engine's weights and KV cache may take (on a CPU: of the machine's
    # memory, for its KV cache); TRL's colocate default
    gpuMemoryUtilization: float = Field(0.3, gt=0, lt=1)
    # truncated importance sampling: each token's loss weighted by min(p_trainer / p_engine, cap),
    # correcting the engine's and the trainer's differing log-probabilities (TRL's
    # vllm_importance_sampling_cap); 0 turns the correction off
    importanceSamplingCap: float = Field(3.0, ge=0)
    # the most the engine's log-probabilities of the tokens it drew may differ from the trainer's, on
    # average over a step's drawn tokens (nats), before the attempt fails as an infrastructure failure
    # (a failed reload, a server for another base or job); unset: trainer.sampling.engines.AGREEMENT
    # for the compute dtype (float32 0.05, bfloat16 and float16 0.3)
    maxLogprobMismatch: float | None = Field(None, gt=0, le=10)

    @field_validator("server")
    @classmethod
    def _server(cls, v: str | None) -> str | None:
        from urllib.parse import urlsplit

        if v is None:
            return v
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
            raise problem(f"must be the server's address, http://HOST:PORT, as `grpo-run vllm-server` prints it "
                          f"(got {fmt(v)})")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _server_for_mode(self) -> "VllmParams":
        if self.mode == "server" and self.server is None:
            raise problems_at("VllmParams", [(("server",), "required with mode: server: the address "
                                              "`grpo-run vllm-server` prints (http://HOST:PORT)")])
        if self.mode == "colocate" and self.server is not None:
            raise problems_at("VllmParams", [(("mode",), "is colocate, and server is given: set mode: server to "
                                              "sample on that server, or remove server")])
        return self


class GRPOParams(Strict):
    """`spec.parameters`. Names are the YAML names (camelCase), as users write them."""
    numGenerations: int = Field(4, ge=2, json_schema_extra={"why": "GRPO needs a group to compare"})  # G
    beta: float = Field(0.0, ge=0)     # KL coefficient; 0 loads/computes no reference at all
    maxCompletionLength: int = Field(64, ge=1)   # tokens per completion
    maskTruncatedCompletions: bool = False       # DAPO: completions cut at maxCompletionLength get no loss (still scored)
    systemPrompt: str | None = Field(None, min_length=1)  # prepended as a system message (unless a task has its own)
    chatTemplateKwargs: dict[str, Any] = Field(default_factory=dict, json_schema_extra={"like": "{enable_thinking: false}"})
    lora: LoraParams = Field(default_factory=LoraParams, json_schema_extra={"like": "{r: 8}"})
    method: Literal[METHODS] = "LoRA"
    saveSteps: int = Field(25, ge=1)   # checkpoint every N steps
    maxSteps: int = Field(200, ge=1)   # training steps
    learningRate: float = Field(1e-5, gt=0, le=1, json_schema_extra={
        "why": "Adam moves each weight by about the learning rate a step; LoRA trains at 1e-5 to 1e-4"})
    temperature: float = Field(1.0, gt=0)        # sampling temperature during training
    topP: float = Field(1.0, gt=0, le=1)         # nucleus sampling: the most likely tokens up to this mass (1 = off)
    topK: int = Field(0, ge=0)                   # sample among the K most likely tokens (0 = off)
    repetitionPenalty: float = Field(1.0, gt=0)  # > 1 discourages tokens already in the prompt or completion (HF's)
    stopStrings: tuple[str, ...] = ()            # a completion ends at the token that completes one (kept in the text)
    compileDecode: bool = False                  # decode step compiled with static shapes (CUDA graphs on a GPU)
    sampler: Literal[SAMPLERS] = "auto"          # the engine that samples: native | vllm | auto (vLLM where it serves the job)
    vllm: VllmParams = Field(default_factory=VllmParams, json_schema_extra={"like": "{gpuMemoryUtilization: 0.3}"})
    promptsPerStep: int = Field(8, ge=1)         # B, prompts per step (B x G completions)
    # asynchronous GRPO: step k trains on rollouts the policy of step k-N drew (sampled while
    # steps k-N..k-1 updated; trainer.ahead); 0: sample, then train (the synchronous run)
    staleness: int = Field(0, ge=0, le=MAX_STALENESS, json_schema_extra={
        "why": "steps the sampling policy may lag the trained one (0: synchronous)"})
    # staleness > 0: each token's loss weighted by min(p_trained / p_drawing, cap) (truncated
    # importance sampling against the drawing version's log-probabilities, recorded as it sampled)
    stalenessImportanceCap: float = Field(2.0, gt=0, le=100)
    microBatchSize: int | None = Field(None, ge=1)  # completions per forward/backward (None: from the model and device)
    epsilon: float = Field(0.2, ge=0, le=1)      # PPO clip range
    numIterations: int = Field(1, ge=1)          # updates per generated batch (mu); >1 makes clipping bite
    lossType: Literal[LOSS_TYPES] = "grpo"
    advantageStd: Literal[STD_CONVENTIONS] = "sample"   # sample (n-1, as TRL) | population (n)
    seed: int = 0
    trainTasks: int | None = Field(None, ge=1)   # catalog environments: train tasks (None: the environment's default)
    evalTasks: int | None = Field(None, ge=1)    # catalog environments: held-out tasks (None: the environment's default)
    evalTemperature: float = Field(0.0, ge=0)    # 0 = greedy decoding for evaluation
    evalSteps: int | None = Field(None, ge=1)    # held-out evaluation every N training steps too (None: only before and after)
    evalBatchSize: int = Field(64, ge=1)         # held-out tasks per evaluation batch (a stopped evaluation resumes by batch)
    sampleGroups: int = Field(2, ge=0, le=8)     # groups of every step kept in the record for `grpo-run samples` (0: none)
    sampleEvalTasks: int = Field(8, ge=0, le=32)   # held-out tasks whose completions every evaluation keeps (0: none)
    gradientCheckpointing: bool = True
    maxGradNorm: float = Field(1.0, gt=0)
    weightDecay: float = Field(0.0, ge=0)
    warmupSteps: int = Field(0, ge=0)
    lrScheduler: Literal[SCHEDULERS] = "constant"
    # Upper bounds: the hang watchdog's bound grows with the timeout (an unbounded one never fires),
    # and the reward's processes share the node's memory with the trainer.
    rewardTimeoutSeconds: float = Field(10.0, gt=0, le=3600, json_schema_extra={   # per completion, in the grader
        "why": "seconds one reward call may take, up to an hour (the hang watchdog waits as long per call)"})
    rewardMemoryMB: int = Field(2048, ge=64, le=65536, json_schema_extra={         # grader process memory limit
        "why": "MiB for one reward call's processes, up to 64 GiB (they share the node with the trainer)"})
    rewardRetries: int = Field(2, ge=0)               # extra tries after a reward-function failure

    @field_validator("stopStrings", mode="before")
    @classmethod
    def _stop_strings(cls, v: Any) -> Any:
        if isinstance(v, (list, tuple)) and all(isinstance(x, str) and x for x in v):
            return tuple(v)
        raise problem(f"must be a list of non-empty strings like [\"</answer>\"] (got {fmt(v)})")

    @field_validator("chatTemplateKwargs", mode="before")
    @classmethod
    def _template_kwargs(cls, v: Any) -> Any:
        # They travel to the trainer as JSON (trainer.protocol.Plan): only what JSON keeps as it is.
        if not isinstance(v, dict):
            return v                                  # pydantic's own "must be a mapping"
        for key, value in v.items():
            if not isinstance(key, str):
                raise problem(f"keys must be strings (got {fmt(key)})")
            if key in TEMPLATE_OWN_ARGUMENTS:
                raise problem(f"{key} is set by the trainer itself; remove it (template arguments only, "
                              "e.g. {enable_thinking: false})")
            if not _json_like(value):
                raise problem(f"{key}: must be text, a number, true/false, null, or a list or mapping of "
                              f"those (got {fmt(value)})")
        return {k: _plain(x) for k, x in v.items()}

    @model_validator(mode="after")
    def _staleness_engine(self) -> "GRPOParams":
        reason = staleness_refusal(self)
        if reason:
            raise problems_at("GRPOParams", [(("staleness",), reason)])
        return self


def staleness_refusal(params: "GRPOParams") -> str | None:
    """Why this job cannot sample asynchronously (spec.parameters.staleness > 0), or None. Only the
    native decoder overlaps here: its producer (a process on a CPU, a thread on a GPU) samples with
    a copy of the adapter, on cores of its own (trainer.ahead)."""
    if params.staleness == 0:
        return None
    if params.method == "Full":
        return (f"is {params.staleness}, and method Full cannot sample asynchronously: every policy version in "
                "flight would be a whole second model, in memory and in every checkpoint; use method LoRA, or "
                "staleness: 0")
    if params.sampler == "vllm":
        mode = params.vllm.mode
        why = ("a colocated engine shares the trainer's GPU and its memory with the update, so nothing would "
               "overlap" if mode == "colocate" else
               "grpo-run does not sample a server asynchronously yet (the server holds one adapter of the job, "
               "which the held-out evaluations also sample)")
        return (f"is {params.staleness}, and sampler: vllm ({mode}) cannot sample asynchronously: {why}; use "
                "sampler: native (or auto), or staleness: 0")
    return None


# Arguments of tokenizer.apply_chat_template that the trainer sets (or that change what it returns).
TEMPLATE_OWN_ARGUMENTS = ("conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
                          "return_dict", "return_tensors", "return_assistant_tokens_mask", "padding", "truncation",
                          "max_length", "tokenizer_kwargs")


def _json_like(v: Any) -> bool:
    if v is None or isinstance(v, (str, bool, int)):
        return True
    if isinstance(v, float):
        return v == v and abs(v) != float("inf")
    if isinstance(v, (list, tuple)):
        return all(_json_like(x) for x in v)
    return isinstance(v, dict) and all(isinstance(k, str) and _json_like(x) for k, x in v.items())


def _plain(v: Any) -> Any:
    """A JSON-like value with tuples as lists: as it comes back from JSON or YAML."""
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


# --- errors in the house format ---------------------------------------------------------------------

_TYPES = {"int_type": "must be an integer", "float_type": "must be a number", "bool_type": "must be true or false",
          "string_type": "must be a string"}


def fmt(v: Any) -> str:
    """A value as the user wrote it: strings quoted, YAML's booleans lower-case."""
    return repr(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v)


def _num(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    for t in (annotation, *typing.get_args(annotation)):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def _field(root: type[BaseModel], loc: tuple) -> tuple[type[BaseModel] | None, Any]:
    """The model holding the field at `loc` (under `root`) and that field's FieldInfo (or None)."""
    model: type[BaseModel] | None = root
    info = None
    for i, part in enumerate(loc):
        if isinstance(part, int):            # an item of a list field: the item's model holds the rest
            continue
        if model is None or part not in model.model_fields:
            return model if i == len(loc) - 1 else None, None
        info = model.model_fields[part]
        if i < len(loc) - 1:
            model = _model_of(info.annotation)
    return model, info


def _choices(annotation: Any) -> list[str]:
    """The values a Literal (or an optional Literal) allows, in order."""
    if typing.get_origin(annotation) is Literal:
        return [str(a) for a in typing.get_args(annotation)]
    return [c for a in typing.get_args(annotation) for c in _choices(a)]


def _extra(info: Any, key: str) -> str | None:
    extra = info.json_schema_extra if info is not None and isinstance(info.json_schema_extra, dict) else {}
    return extra.get(key)


def _bounds(info: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for m in info.metadata if info is not None else ():
        for name in ("ge", "gt", "le", "lt"):
            if isinstance(m, getattr(annotated_types, name.capitalize())):
                found[name] = getattr(m, name)
    return found


def _message(err: dict[str, Any], root: type[BaseModel]) -> str | None:
    kind, loc, got = err["type"], tuple(err["loc"]), err.get("input")
    holder, info = _field(root, loc)
    if kind == "problem":
        return err["msg"]
    if kind == "extra_forbidden":
        known = list(holder.model_fields) if holder is not None else []
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        return "unknown field" + (f"; did you mean {close[0]}?" if close else "; allowed: " + ", ".join(known))
    if kind == "missing":
        return "required" + (f": {_extra(info, 'required')}" if _extra(info, "required") else "")
    if kind in _TYPES:
        text = _TYPES[kind]
        if kind == "float_type" and isinstance(got, str):
            try:
                float(got)
                text += f" (got {fmt(got)}): YAML reads {got} as text; write it with a dot, e.g. 1.0e-5"
                return text
            except ValueError:
                pass
    elif kind == "literal_error":
        text = "must be one of " + ", ".join(_choices(info.annotation if info is not None else None))
    elif kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        b = _bounds(info)
        if "ge" in b and "le" in b:
            text = f"must be between {_num(b['ge'])} and {_num(b['le'])}"
        else:
            op, bound = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
                         "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}[kind]
            text = f"must be {op} {_num(err['ctx'][bound])}"
    elif kind in ("model_type", "model_attributes_type", "dict_type"):
        like = _extra(info, "like")
        text = "must be a mapping" + (f" like {like}" if like else "")
    else:
        text = err["msg"][0].lower() + err["msg"][1:]
    why = _extra(info, "why")
    return f"{text} (got {fmt(got)})" + (f": {why}" if why else "")


def problems_in(error: ValidationError, where: str, root: type[BaseModel]) -> list[str]:
    """`error` (from validating `root` at `where`) as one line per problem, in the house format."""
    out: list[str] = []
    for err in error.errors(include_url=False):
        path = ".".join([where, *map(str, err["loc"])] if where else map(str, err["loc"]))
        line = f"{path}: {_message(err, root)}"
        if line not in out:
            out.append(line)
    return out


def parse_parameters(raw: Any, where: str, problems: list[str]) -> GRPOParams:
    """`spec.parameters` -> GRPOParams; problems are appended, never raised (the defaults stand in
    for fields that had one, so later checks still see the rest)."""
    if raw is None:
        return GRPOParams()
    if not isinstance(raw, dict):
        problems.append(f"{where}: must be a mapping of parameters (got {fmt(raw)})")
        return GRPOParams()
    try:
        return GRPOParams.model_validate(raw)
    except ValidationError as e:
        problems += problems_in(e, where, GRPOParams)
        bad = {err["loc"][0] for err in e.errors()}
        return GRPOParams.model_validate({k: v for k, v in raw.items() if k not in bad})


def to_yaml_dict(params: GRPOParams) -> dict[str, Any]:
    """The parameters as a user would write them (every default filled in)."""
    out = params.model_dump(exclude_none=True)   # None: "the environment's default", written by leaving it out
    lora = params.lora
    out["lora"] = {"r": lora.r, "alpha": lora.scaling_alpha, "dropout": lora.dropout,
                   "targetModules": lora.targetModules if isinstance(lora.targetModules, str) else list(lora.targetModules)}
    out["stopStrings"] = list(params.stopStrings)
    return out
