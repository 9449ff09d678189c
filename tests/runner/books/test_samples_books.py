"""What the model wrote, in the run's record: replaced when redone, bounded over a long run."""

import os

from grpo_run.checkpoint.storage.store import Store
from grpo_run.runner.books.books import Books
from grpo_run.runner.books.sample_books import OLDER_STEPS, RECENT_STEPS, steps_to_drop
from grpo_run.state.record import Record
from grpo_run.trainer.kept_samples import MAX_CHARS, capped


def books(store: Store, work) -> Books:
    return Books(store, work, name="job", manifest={"kind": "TrainingJob", "metadata": {"name": "job"}},
                 usd_per_hour=None, max_cost_usd=None)


def group(item: int, text: str, g: int = 4) -> dict:
    return {"item": item, "prompt": capped("3+5=" * 400), "completions": [
        {"text": capped(text), "rewards": {"correct": 1.0, "format": 0.5}, "reward": 1.5, "advantage": 0.87,
         "length": 64, "truncated": True} for _ in range(g)], "solved": True}


def test_a_redone_step_replaces_its_samples_and_an_evaluation_keeps_one_set(tmp_path):
    b = books(Store(str(tmp_path / "store")), tmp_path / "node")
    try:
        b.add_samples("step", 5, [group(0, "first try"), group(1, "first try")])
        b.add_samples("step", 5, [group(0, "redone")])            # the step again, after a preemption
        assert [(s["step"], s["item"], s["completions"][0]["text"]) for s in b.record.samples("step", [5])] == \
            [(5, 0, "redone")]
        b.add_samples("final", 8, [group(0, "a"), group(1, "b")])  # batch 0
        b.add_samples("final", 8, [group(2, "c")])                  # batch 1: added, not replacing
        b.add_samples("final", 8, [group(0, "a again")])           # batch 0 computed again
        assert [s["completions"][0]["text"] for s in b.record.samples("final", [8])] == ["a again", "b", "c"]
        b.add_samples("final", 12, [group(0, "after more steps")])  # the job went on: one final set
        assert b.record.sample_steps("final") == [12]
    finally:
        b.close()


def test_the_samples_go_to_storage_with_the_record(tmp_path):
    store = Store(str(tmp_path / "store"))
    a = books(store, tmp_path / "node-a")
    a.add_samples("baseline", 0, [group(0, "7")])
    a.sync(wait=True)
    a.close()
    b = books(store, tmp_path / "node-b")                       # a fresh node: the record from storage
    try:
        assert b.record.samples("baseline", [0])[0]["completions"][0]["text"] == "7"
    finally:
        b.close()


def test_older_steps_thin_out_evenly_and_the_newest_stay_whole():
    assert steps_to_drop(list(range(1, 101)), 100) == []                        # all within the newest 100
    kept = list(range(1, 1501))
    for newest in range(1, 1501):
        kept = [s for s in kept if s <= newest and s not in steps_to_drop([s for s in kept if s <= newest], newest)] \
            + [s for s in kept if s > newest]
    assert kept[-RECENT_STEPS:] == list(range(1401, 1501))
    older = kept[:-RECENT_STEPS]
    assert len(older) <= OLDER_STEPS and older == list(range(16, 1401, 16))     # every 16th step


def test_a_long_run_s_samples_stay_bounded_in_the_record(tmp_path):
    """1,500 steps of 2 groups of 4 completions, every text at the cap: the record's size."""
    b = books(Store(str(tmp_path / "store")), tmp_path / "node")
    try:
        for step in range(1, 1501):
            b.add_samples("step", step, [group(0, "9" * 5000), group(1, "9" * 5000)])
        steps = b.record.sample_steps("step")
        b.record.snapshot(tmp_path / "copy.db")
    finally:
        b.close()
    assert len(steps) <= RECENT_STEPS + OLDER_STEPS and steps[-1] == 1500
    size = os.path.getsize(tmp_path / "copy.db")
    per_step = 2 * (MAX_CHARS + 4 * (MAX_CHARS + 200))          # prompts and completions at the cap, plus numbers
    print(f"record after 1,500 steps of samples: {size:,} bytes, {len(steps)} steps kept")
    assert size < (RECENT_STEPS + OLDER_STEPS) * per_step * 1.5
    with Record(tmp_path / "copy.db") as r:
        assert r.samples("step", [1500])[0]["completions"][0]["text"].endswith(f"[{5000 - MAX_CHARS} more characters]")


def test_tensorboard_gets_each_step_s_samples_once_as_text(tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    store = Store(str(tmp_path / "store"))
    b = Books(store, tmp_path / "node", name="job", manifest={"kind": "TrainingJob", "metadata": {"name": "job"}},
              usd_per_hour=None, max_cost_usd=None, tracking={"tensorboard": True})
    try:
        b.start_attempt("node", from_step=0)
        b.add_samples("step", 3, [group(0, "8", g=2)])
        b.add_samples("step", 3, [group(0, "8", g=2)])           # redone: already there
        b.add_samples("final", 4, [group(0, "8|`x`", g=1)])
        b.sync(wait=True)
    finally:
        b.close()
    texts = [(v.tag, e.step, v.tensor.string_val[0].decode()) for f in sorted((tmp_path / "store" / "tensorboard").glob("events*"))
             for e in EventFileLoader(str(f)).Load() for v in e.summary.value if v.metadata.plugin_data.plugin_name == "text"]
    assert [(tag, step) for tag, step, _ in texts] == [("samples/step", 3), ("samples/final/from-task-1", 4)]
    step_text, final_text = texts[0][2], texts[1][2]
    assert "**step 3, group 1**" in step_text and "| `8` | 1.500 | correct 1.000, format 0.500 | +0.87 |" in step_text
    assert "| `8\\|'x'` | 1.500 |" in final_text                  # a table cell cannot be broken out of
