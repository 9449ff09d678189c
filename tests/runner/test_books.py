"""The run's books in storage: what a node lost at the worst moment leaves for the next one."""

import pytest

from checkpoint.store import Store
from runner.books import BASELINE, Books

RESULT = {"meanReward": 0.25, "rewards": [0.0, 0.5], "tasks": 2, "solved": 0, "batches": 1, "reusedBatches": 0}


def books(store: Store, work) -> Books:
    return Books(store, work, name="job", manifest={"kind": "TrainingJob", "metadata": {"name": "job"}},
                 usd_per_hour=None, max_cost_usd=None)


def test_a_node_lost_between_its_baseline_and_the_cache_file_leaves_the_baseline_counted(tmp_path):
    store = Store(str(tmp_path / "store"))

    class NodeLost(Exception):
        pass

    put_bytes = store.put_bytes

    def dies_at_the_cache(key, data, *args, **kwargs):
        if key == BASELINE:
            raise NodeLost()
        return put_bytes(key, data, *args, **kwargs)

    a = books(store, tmp_path / "node-a")
    store.put_bytes = dies_at_the_cache
    with pytest.raises(NodeLost):
        a.record_eval("baseline", RESULT, "fp", no_signal=False)
    a.close()
    store.put_bytes = put_bytes

    b = books(store, tmp_path / "node-b")                      # a fresh node: the record from storage
    try:
        assert b.cached_baseline("fp") == RESULT               # reused, not computed again
        assert b.record.eval("baseline")["runs"] == 1          # and the one computation still counted
    finally:
        b.close()
