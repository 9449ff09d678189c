"""Many hard kills in one run: SIGKILL of the trainer, of the supervisor, of the checkpoint
writer, or of all three at once, at random moments, over real S3; the node resumes after each
(the supervisor restarts a killed trainer itself; a killed supervisor is started again, as its
systemd unit would, now and then on a fresh node), on each store: S3 (SeaweedFS), GCS
(fake-gcs-server) and Azure Blob (Azurite). The final adapter must be byte-identical to
an uninterrupted run's, and each kill may cost at most `saveSteps` completed steps plus the
ones whose checkpoint was still with the writer (or, for a fresh node, not yet uploaded) at that
instant; counted from each node's record (the last step its attempt completed, the step the next
attempt resumed from) and reported, and each resume must start from the newest checkpoint the
node could have had.

The schedule comes from a seed, printed, so a failure can be replayed:
    GRPO_RUN_KILL_SEED=1234 GRPO_RUN_KILLS=60 .venv/bin/pytest tests/faults/test_kill_campaign.py
The whole suite (CI) runs a seeded sample of 8 kills on S3 (the clouds' stores meet a kill and
a resume in tests/faults/test_cloud_runs.py); scripts/reliability runs 50 on S3 and 12 on each
other store (GRPO_RUN_CLOUD_KILLS) for docs/reliability.md.
"""

from __future__ import annotations

import os
import random
import signal
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from grpo_run.checkpoint.manifest import MANIFEST_NAME, newest_sealed, step_of
from grpo_run.checkpoint.storage.by_url import open_store
from grpo_run.state.record import Record
from tests.checkpoint.test_corrupt_resume import JOB
from tests.campaign import stores
from tests.cloud_stores import STORE_NAMES
from tests.faults.harness import children, cmdline, start_node, wait_until
from tests.once import once
from tests.runner.jobs.test_resume import exported_bytes, grpo_run, status, write_job

pytestmark = [pytest.mark.fault, pytest.mark.slow]
KILLS = int(os.environ.get("GRPO_RUN_KILLS", "8"))      # a seeded sample (two of each target); the full campaign: 50
CLOUD_KILLS = int(os.environ.get("GRPO_RUN_CLOUD_KILLS", "12"))   # on GCS and Azure (the full campaign only)
SEED = int(os.environ.get("GRPO_RUN_KILL_SEED", "20261201"))
STEPS, SAVE = 1400, 4
TARGETS = ("trainer", "writer", "supervisor", "all")
CRASH_RESTARTS = 2        # trainer/writer kills per supervisor: the supervisor gives up after 3


def job(folder: Path, storage: str | None) -> Path:
    return write_job(folder, storage, maxSteps=STEPS, saveSteps=SAVE)


def processes(supervisor: int) -> dict[str, list[int]]:
    """The node's processes under its supervisor: the trainer and the trainer's checkpoint writer."""
    trainers = [p for p in children(supervisor) if "grpo_run.trainer.child" in cmdline(p)]
    writers = [w for t in trainers for w in children(t) if "grpo_run.checkpoint.writer" in cmdline(w)]
    return {"supervisor": [supervisor], "trainer": trainers, "writer": writers}


def last_step(home: Path) -> int:
    db = home / "runs" / "resumable" / "state.db"
    if not db.exists():
        return 0
    with Record(db) as record:
        steps = record.steps(last=1)
    return steps[-1]["step"] if steps else 0


def stored(env) -> bool:
    """Whether the job's record is in storage yet."""
    return open_store(f"{env.url}/{JOB}").exists("state.db")


def newest_durable(env) -> int:
    """The newest step whose checkpoint manifest is in storage (it goes up last: a whole checkpoint)."""
    keys = open_store(f"{env.url}/{JOB}").list("checkpoints")
    return max((step_of(k.split("/")[-2]) or 0 for k in keys if k.endswith("/" + MANIFEST_NAME)), default=0)


def node_attempts(home: Path) -> list[dict]:
    db = home / "runs" / "resumable" / "state.db"
    if not db.exists():
        return []
    with Record(db) as record:
        return record.attempts()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    def build(folder: Path) -> dict[str, bytes]:
        grpo_run(folder / "home", "apply", "-f", str(job(folder, None)))
        return exported_bytes(folder / "home", None, folder / "export")

    return once(tmp_path_factory, "kill-campaign-reference", build)


@pytest.mark.parametrize("store_env", stores("s3"), indirect=True)     # GCS and Azure: scripts/reliability
def test_hard_kills_at_random_moments_end_byte_identical_and_resume_from_the_newest_checkpoint(
        tmp_path, store_env, reference, figures):
    env = store_env
    rng = random.Random(SEED)
    wanted = KILLS if env.scheme == "s3" else CLOUD_KILLS
    count = "GRPO_RUN_KILLS" if env.scheme == "s3" else "GRPO_RUN_CLOUD_KILLS"
    print(f"\nkill campaign on {STORE_NAMES[env.scheme]}: seed {SEED}, {wanted} kills "
          f"(replay: GRPO_RUN_KILL_SEED={SEED} {count}={wanted})")
    path = job(tmp_path, env.url)
    kills: list[dict] = []
    node, fresh_nodes = tmp_path / "node-0", 0
    log = tmp_path / "nodes.log"          # every node's output, in order: what to read when it fails
    proc = start_node(node, "apply", "-f", str(path), GRPO_RUN_NOTICES="none", log=log)
    crash_kills = 0
    cost: dict | None = None      # the kills since the node last made progress, and the step reached

    def account() -> None:
        """The kills since the last progress cost the steps their attempt completed past where
        the next attempt resumed, which must be the newest checkpoint the node could have had:
        sealed on its disk (the same node) or durable in storage (a fresh one). Progress may
        still be the killed attempt's own (a trainer whose writer died trains on to its next
        checkpoint): then it waits for the next attempt."""
        nonlocal cost
        if cost is None:
            return
        now = node_attempts(node)
        if not now or now[-1]["started"] <= cost["at"]:
            return
        kill = kills[cost["kill"]]
        killed = [a for a in now if (a["id"], a["started"]) == cost["attempt"]]
        ended_at = killed[0]["to_step"] if killed and killed[0]["to_step"] is not None else 0
        kill["resumed"] = now[-1]["from_step"]
        kill["redone"] = max(cost["reached"], ended_at) - kill["resumed"]
        newest = max(cost["durable"], cost["sealed"] if node.name == kill["node"] else 0)
        assert kill["resumed"] >= newest, (f"kill {cost['kill']} ({kill}): a newer checkpoint, {newest}, was "
                                           f"there; the nodes' log ends:\n{log.read_text()[-6000:]}")
        cost = None

    while len(kills) < wanted:
        before = last_step(node)
        # a random moment: mostly mid-training (after the node made progress, plus up to 0.4 s),
        # sometimes early in a node's life (imports, restore, baseline, the trainer's start)
        early = rng.random() < 0.15
        delay = rng.uniform(0.0, 2.5) if early else rng.uniform(0.0, 0.4)
        target = rng.choice(TARGETS if crash_kills < CRASH_RESTARTS else ("supervisor", "all"))
        if not early:
            try:
                wait_until("progress", lambda: last_step(node) > before, proc, timeout=120)
            except AssertionError:
                if proc.poll() == 0:        # the run finished before this kill came
                    break
                raise
            account()
        time.sleep(delay)
        if proc.poll() is not None:
            assert proc.returncode == 0, log.read_text()[-3000:]
            break
        found = processes(proc.pid)
        victims = [p for name in (("supervisor", "trainer", "writer") if target == "all" else (target,))
                   for p in found[name]]
        if not victims:                     # not started yet (or between restarts): the node instead
            target, victims = "supervisor", [proc.pid]
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        at = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        reached = last_step(node)
        current = node_attempts(node)
        local = newest_sealed(node / "runs" / "resumable" / "checkpoints") if target != "writer" else None
        sealed, durable = (local[0] if local else 0), newest_durable(env)
        kills.append({"target": target, "reached": reached, "early": early, "node": node.name, "redone": 0,
                      "sealed": sealed, "durable": durable})
        if cost is None or reached > cost["reached"]:
            cost = {"kill": len(kills) - 1, "reached": reached, "sealed": sealed, "durable": durable,
                    "attempt": (current[-1]["id"], current[-1]["started"]) if current else None}
        cost["at"] = at                     # the next attempt to count from starts after this kill
        with open(log, "a") as f:
            f.write(f"---- kill {len(kills) - 1}: {target} at step {reached} (sealed here {sealed}, durable {durable})\n")
        if target in ("trainer", "writer"):
            crash_kills += 1
            continue                        # the supervisor restarts its trainer
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        crash_kills = 0
        if rng.random() < 0.2:              # now and then the node is gone: a fresh one resumes
            fresh_nodes += 1
            node = tmp_path / f"node-{fresh_nodes}"
        # `resume` once the job is in storage; a node killed before it got there is simply run again
        again = ("resume", "resumable", "--storage", env.url) if stored(env) else ("apply", "-f", str(path))
        with open(log, "a") as f:
            f.write(f"---- kill {len(kills) - 1}: {target}; now {' '.join(again[:2])} on {node.name}\n")
        proc = start_node(node, *again, GRPO_RUN_NOTICES="none", log=log)
    proc.wait(timeout=600)
    assert proc.returncode == 0, log.read_text()[-3000:]
    account()

    st = status(tmp_path / "node-x", env.url)
    final = exported_bytes(tmp_path / "node-y", env.url, tmp_path / "export")
    identical = final == reference
    attempts = st["attempts"]
    for i, k in enumerate(kills):
        print(f"  kill {i:2d}: {k['target']:10s} on {k['node']}{' (early)' if k['early'] else '':8s} at step "
              f"{k['reached']:4d}; sealed there {k['sealed']:4d}, durable {k['durable']:4d}; resumed from "
              f"{k.get('resumed', '-')}; redone {k['redone']}")
    redone = [k["redone"] for k in kills]
    same_node = [k["redone"] for i, k in enumerate(kills)
                 if i + 1 == len(kills) or kills[i + 1]["node"] == k["node"]]
    by_target = {t: sum(k["target"] == t for k in kills) for t in TARGETS}
    print(f"kills: {len(kills)} {by_target}; fresh nodes: {fresh_nodes}; attempts: {len(attempts)}; "
          f"steps redone: total {sum(redone)}, max {max(redone, default=0)} per kill; identical: {identical}")
    figures.add("kills", store=STORE_NAMES[env.scheme], seed=SEED, kills=len(kills), by_target=by_target,
                fresh_nodes=fresh_nodes,
                attempts=len(attempts), redone_total=sum(redone), redone_max=max(redone, default=0),
                redone_max_same_node=max(same_node, default=0),
                save_steps=SAVE, steps=STEPS, identical=identical,
                bytes_differing=sum(final.get(k) != v for k, v in reference.items()))
    assert st["phase"] == "Succeeded" and st["step"] == STEPS
    assert len(kills) >= wanted, f"the run finished after {len(kills)} kills: make STEPS larger"
    assert identical
    assert st["baseline"]["runs"] == 1           # never paid for twice
    # On its own node a kill costs the steps since the newest sealed checkpoint: one interval,
    # plus up to two checkpoints still with the writer (one being read from the buffer, one being
    # hashed and renamed; the writer runs at nice 10 and lags on a busy node). A fresh node
    # continues from what was durable. account() checked each resume took the newest there was.
    assert max(same_node, default=0) <= 3 * SAVE, same_node
