"""The writers behind `spec.tracking` (its schema: runner/spec/tracking.py): the run in the experiment trackers users already have, written by the
supervisor from what the trainer reports (the same events the record gets), off by default.

    tracking:
      tensorboard: true                # event files in the job's storage, under tensorboard/
      tensorboard: runs/tb             # ... or in this folder or URL, one sub-folder per job
      mlflow: {trackingURI: file:///srv/mlruns, experiment: grpo}
      wandb: {project: grpo, entity: my-team}          # WANDB_MODE=offline works as usual

What the model wrote (the samples the record keeps) goes to each tracker too: TensorBoard's text
tab, an MLflow artifact per step (samples/step/0000042.md), a W&B Table.

A resumed run continues the same tracker run: TensorBoard's folder is the job's, MLflow's and
W&B's run id is kept in the run's record. Every point is written once: a resume redoes the steps
after its checkpoint, and a step a tracker already holds is not written again (TensorBoard: read
back from its own event files, so even a node killed after writing is not duplicated).

A tracker that fails (a package missing at run time, a server away) is logged once and left
out; it never stops the training.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Protocol

from grpo_run.state.values import MLFLOW_RUN_ID, WANDB_STEPS   # by name: `values` is what write() is given

log = logging.getLogger(__name__)

TB_FOLDER = "tensorboard"               # the job's storage folder (and the node's work folder) for it
TB_PREFIX = "events.out.tfevents."      # tensorboard's own event file names


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """A step's metrics as tracker tags: train/<metric>, train/rewards/<reward>, cost/usd."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key == "rewards" and isinstance(value, dict):
            out.update({f"train/rewards/{name}": float(v) for name, v in value.items()
                        if isinstance(v, (int, float))})
        elif key == "costUSD" and isinstance(value, (int, float)):
            out["cost/usd"] = float(value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"train/{key}"] = float(value)
    return out


def eval_scalars(kind: str, result: dict[str, Any]) -> dict[str, float]:
    """An evaluation on the held-out tasks: eval/<kind>/meanReward (and solved, and each reward)."""
    out = {f"eval/{kind}/meanReward": float(result["meanReward"])}
    if isinstance(result.get("solved"), (int, float)):
        out[f"eval/{kind}/solved"] = float(result["solved"])
    by_reward = result.get("rewards")
    for name, v in (by_reward.items() if isinstance(by_reward, dict) else ()):
        if isinstance(v, (int, float)):
            out[f"eval/{kind}/rewards/{name}"] = float(v)
    return out


def samples_markdown(kind: str, step: int, groups: list[dict[str, Any]]) -> str:
    """What the model wrote (runner.books.sample_books) as Markdown: each prompt, then a table of its
    completions with their rewards by name (and advantage, for a training step's)."""
    def cell(text: Any) -> str:
        return "`" + str(text).replace("`", "'").replace("|", "\\|").replace("\n", " ") + "`"

    lines = []
    for g in groups:
        where = f"group {g['item'] + 1}" if kind == "step" else f"task {g['item'] + 1}"
        lines += [f"**{kind} {step}, {where}**: {cell(g['prompt'])}", "",
                  "| completion | reward | by name |" + (" advantage |" if kind == "step" else ""),
                  "|---|---|---|" + ("---|" if kind == "step" else "")]
        for c in g["completions"]:
            by_name = ", ".join(f"{k} {v:.3f}" for k, v in c["rewards"].items())
            row = f"| {cell(c['text'])} | {c['reward']:.3f} | {by_name} |"
            lines.append(row + (f" {c['advantage']:+.2f} |" if kind == "step" else ""))
        lines.append("")
    return "\n".join(lines)


class Tracker(Protocol):
    name: str

    def write(self, step: int, values: dict[str, float]) -> None:
        """Each (tag, step) once: what the tracker already holds is skipped."""

    def samples(self, kind: str, step: int, tag: str, groups: list[dict[str, Any]]) -> None:
        """What the model wrote (runner.books.sample_books) at `step`, under `tag`, once."""

    def flush(self) -> None: ...

    def close(self) -> None: ...


class TensorBoard:
    """Event files written on this node (work/tensorboard), copied into `store` under `prefix` at
    every sync of the record; a node that takes the run over fetches them first and reads back
    which (tag, step) pairs they hold."""
    name = "tensorboard"

    def __init__(self, local: Path, store, prefix: str, *, suffix: str) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.local, self.store, self.prefix = Path(local), store, prefix.strip("/")
        self.local.mkdir(parents=True, exist_ok=True)
        for key in store.list(self.prefix):
            name = key.rsplit("/", 1)[-1]
            if name.startswith(TB_PREFIX) and not (self.local / name).exists():
                store.get_file(key, self.local / name)
        self.written = written_pairs(self.local)
        self._writer = EventFileWriter(str(self.local), flush_secs=5, filename_suffix=suffix)
        self._sent: dict[str, int] = {}       # file name -> its size when last copied

    def samples(self, kind: str, step: int, tag: str, groups: list[dict[str, Any]]) -> None:
        """Markdown in TensorBoard's text tab, once per (tag, step)."""
        from tensorboard.compat.proto import types_pb2
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.plugins.text.metadata import create_summary_metadata

        if (tag, step) in self.written:
            return
        markdown = samples_markdown(kind, step, groups)
        tensor = TensorProto(dtype=types_pb2.DT_STRING, string_val=[markdown.encode()], tensor_shape=TensorShapeProto())
        value = Summary.Value(tag=tag, metadata=create_summary_metadata(display_name=None, description=None),
                              tensor=tensor)
        self._writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=[value])))
        self.written.add((tag, step))

    def write(self, step: int, values: dict[str, float]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        new = [Summary.Value(tag=tag, simple_value=v) for tag, v in values.items() if (tag, step) not in self.written]
        if not new:
            return
        self._writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=new)))
        self.written.update((v.tag, step) for v in new)

    def flush(self) -> None:
        self._writer.flush()
        for path in sorted(self.local.glob(TB_PREFIX + "*")):
            size = path.stat().st_size
            if self._sent.get(path.name) != size:
                self.store.put_file(path, f"{self.prefix}/{path.name}" if self.prefix else path.name)
                self._sent[path.name] = size

    def close(self) -> None:
        self._writer.close()
        self.flush()


def written_pairs(folder: Path) -> set[tuple[str, int]]:
    """Every (tag, step) of a scalar in the event files under `folder`, read with tensorboard's
    own loader (a record cut short by a kill at the end of a file is left out, as TensorBoard does)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    pairs: set[tuple[str, int]] = set()
    for path in sorted(Path(folder).glob(TB_PREFIX + "*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                pairs.add((value.tag, int(event.step)))
    return pairs


class Trackers:
    """Every tracker the job asked for, fed by the run's books; a failing one is logged once and dropped."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        if self.trackers:
            self._each("write", step, scalars(metrics))

    def evaluation(self, kind: str, step: int, result: dict[str, Any]) -> None:
        if self.trackers:
            self._each("write", step, eval_scalars(kind, result))

    def samples(self, kind: str, step: int, groups: list[dict[str, Any]]) -> None:
        """What the model wrote, to every tracker: one entry per step and kind, under `tag` (an
        evaluation's per batch, named by its first task)."""
        if self.trackers and groups:
            tag = (f"samples/{kind}" if kind in ("step", "heldOut")
                   else f"samples/{kind}/from-task-{groups[0]['item'] + 1}")
            self._each("samples", kind, step, tag, groups)

    def flush(self) -> None:
        self._each("flush")

    def close(self) -> None:
        self._each("close")

    def _each(self, method: str, *args: Any) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as e:          # a tracker never stops the training
                log.warning("tracker %s failed (%s: %s); the run goes on without it", tracker.name,
                            type(e).__name__, e)
                self.trackers.remove(tracker)


def open_trackers(tracking: dict[str, Any] | None, *, job_store, work: Path, name: str, run_id: str,
                  attempt: int, record) -> Trackers:
    """The trackers `tracking` (spec.tracking as a dict) names, opened for this attempt."""
    from grpo_run.checkpoint.storage.by_url import open_store

    opened: list[Tracker] = []
    tracking = tracking or {}
    makers = {
        "tensorboard": lambda spec: TensorBoard(
            work / TB_FOLDER, *((job_store, TB_FOLDER) if spec is True else (open_store(str(spec)), name)),
            suffix=f".{run_id[:8]}.attempt{attempt}"),
        "mlflow": lambda spec: MLflow(spec, name=name, run_id=run_id, record=record),
        "wandb": lambda spec: Wandb(spec, name=name, run_id=run_id, record=record),
    }
    for key, make in makers.items():
        spec = tracking.get(key)
        if spec in (None, False):
            continue
        try:
            opened.append(make(spec))
        except Exception as e:
            log.warning("tracker %s could not be opened (%s: %s); the run goes on without it", key,
                        type(e).__name__, e)
    return Trackers(opened)


class MLflow:
    """One MLflow run per job: created once, its id kept in the record (tracking.mlflowRunId), and
    continued by every later attempt; a step the run already has a value for is not logged again."""
    name = "mlflow"

    def __init__(self, spec: dict[str, Any], *, name: str, run_id: str, record) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=spec["trackingURI"])
        experiment = spec.get("experiment") or name
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run = MLFLOW_RUN_ID.get(record)
        if self.run is None:
            self.run = self.client.create_run(experiment_id, run_name=name,
                                              tags={"grpo-run.runId": run_id, "grpo-run.job": name}).info.run_id
            MLFLOW_RUN_ID.set(record, self.run)
        self.latest: dict[str, int] = {}      # tag -> newest step the run holds, asked once per tag

    def write(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = []
        for tag, v in values.items():
            if tag not in self.latest:
                history = self.client.get_metric_history(self.run, tag)
                self.latest[tag] = max((m.step for m in history), default=-1)
            if step > self.latest[tag]:
                batch.append(Metric(tag, v, now, step))
                self.latest[tag] = step
        if batch:
            self.client.log_batch(self.run, metrics=batch)

    def samples(self, kind: str, step: int, tag: str, groups: list[dict[str, Any]]) -> None:
        """A Markdown artifact, TAG/STEP.md: a redone step writes the same file again."""
        self.client.log_text(self.run, samples_markdown(kind, step, groups), f"{tag}/{step:07d}.md")

    def flush(self) -> None:
        pass                                  # log_batch is synchronous

    def close(self) -> None:
        pass                                  # the run stays open for the next attempt; its status is not ended


class Wandb:
    """One W&B run per job, its id the run's own (the record's runId), resumed by every attempt
    (resume="allow"). Charts are against the training step (`step`, defined as every metric's
    step metric), and the newest step written per tag is kept in the record (tracking.wandbSteps),
    so a redone step is not logged again."""
    name = "wandb"

    def __init__(self, spec: dict[str, Any], *, name: str, run_id: str, record) -> None:
        import wandb

        self.record = record
        self.latest: dict[str, int] = dict(WANDB_STEPS.get(record))
        # console off: W&B would otherwise wrap this process's stdout and stderr (the progress bar)
        self.run = wandb.init(project=spec["project"], entity=spec.get("entity"), id=run_id, name=name,
                              resume="allow", mode=spec.get("mode") or os.environ.get("WANDB_MODE") or None,
                              settings=wandb.Settings(quiet=True, console="off"))
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, step: int, values: dict[str, float]) -> None:
        new = {tag: v for tag, v in values.items() if step > self.latest.get(tag, -1)}
        if not new:
            return
        self.run.log({**new, "step": step})
        self.latest.update({tag: step for tag in new})
        WANDB_STEPS.set(self.record, self.latest)

    def samples(self, kind: str, step: int, tag: str, groups: list[dict[str, Any]]) -> None:
        """A W&B Table, one row per completion, once per (tag, step) as the metrics are."""
        import wandb

        if step <= self.latest.get(tag, -1):
            return
        columns = ["group" if kind == "step" else "task", "prompt", "completion", "reward", "rewards", "advantage"]
        rows = [[g["item"] + 1, g["prompt"], c["text"], c["reward"], json.dumps(c["rewards"]), c.get("advantage")]
                for g in groups for c in g["completions"]]
        self.run.log({tag: wandb.Table(columns=columns, data=rows), "step": step})
        self.latest[tag] = step
        WANDB_STEPS.set(self.record, self.latest)

    def flush(self) -> None:
        pass                                  # wandb sends in its own process

    def close(self) -> None:
        self.run.finish()
