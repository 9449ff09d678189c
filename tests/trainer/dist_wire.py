"""Run by test_distributed.py under torchrun (2 processes, gloo): what crosses between ranks.
Unpickling is forbidden in both processes; each rank writes what it saw to OUT.rank<R>.json.
argv: OUT, then rank 1's node secret ("" for none; rank 0's is always "s3cret")."""

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


class Forbidden:
    def __init__(self, *args, **kwargs):
        raise AssertionError("a rank unpickled a peer's bytes")


def main(out: str, rank1_secret: str) -> None:
    import numpy as np
    import torch
    import torch.distributed.distributed_c10d as c10d

    from grpo_run.trainer import distributed
    from grpo_run.trainer.checkpointing.snapshot import rng_from_json, rng_state, rng_to_json
    from grpo_run.trainer.distributed import NodesNotAdmitted, UnsafeName, World, admit

    c10d._unpickler = Forbidden              # torch's *_object collectives unpickle through this
    world = World.from_environment()
    seen: dict = {"rank": world.rank}

    # metrics-like values, gathered and broadcast
    seen["gathered"] = world.gather({"rank": world.rank, "loss": 0.1 * (world.rank + 1), "pairs": [(world.rank, "d")]})
    seen["broadcast"] = world.broadcast({"plan": "rank 0's", "n": 3} if world.main else None)

    # RNG states, as the checkpointer gathers them
    torch.manual_seed(10 + world.rank)
    np.random.seed(20 + world.rank)
    states = [rng_from_json(r) for r in world.gather(rng_to_json(rng_state(torch.device("cpu"))))]
    if world.main:
        theirs = states[1]
        torch.manual_seed(11)
        np.random.seed(21)
        seen["rng same"] = bool(torch.equal(theirs["torch"], torch.get_rng_state())) and \
            bool((theirs["numpy"][1] == np.random.get_state()[1]).all())

    # a checkpoint's files, then names that leave the receiving folder
    base = Path(out).parent
    sent = base / "sent"
    if world.main:
        (sent / "adapter").mkdir(parents=True, exist_ok=True)
        (sent / "adapter" / "weights.bin").write_bytes(bytes(range(256)) * 3)
        (sent / "state.json").write_text("{}")
    into = base / f"into{world.rank}"
    into.mkdir(exist_ok=True)
    world.share_files(sent if world.main else None, into if not world.main else None)
    if not world.main:
        seen["received"] = sorted(p.relative_to(into).as_posix() for p in into.rglob("*") if p.is_file())
        seen["bytes same"] = (into / "adapter" / "weights.bin").read_bytes() == bytes(range(256)) * 3
    outside = base / "outside"
    outside.mkdir(exist_ok=True)
    (into / "link").symlink_to(outside)
    for forged in (["../escaped", 0], [str(base / "absolute"), 0], ["link/escaped", 0]):
        distributed._listing = lambda folder, forged=forged: [forged]
        try:
            world.share_files(sent if world.main else None, into if not world.main else None)
            seen.setdefault("forged", []).append("written")
        except UnsafeName as e:
            seen.setdefault("forged", []).append(str(e))
    world.barrier()

    # the node secret: rank 0 holds "s3cret"; rank 1 what argv says
    try:
        admission = admit(world, "job", "s3cret" if world.main else rank1_secret or None)
        seen["admitted"] = True
    except NodesNotAdmitted as e:
        admission = None
        seen["admitted"] = str(e)
    if admission is not None:
        if not world.main:
            world.tell_failure("reward function failed on node 1: no nines", admission)
        world.barrier()
        if world.main:
            seen["told"] = world.failure_told(admission)
            import datetime as dt
            stranger = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                                  is_master=False, timeout=dt.timedelta(seconds=10))
            stranger.set(distributed.FAILED_KEY, "planted by a stranger")
            seen["planted"] = world.failure_told(admission)
            forged = json.dumps({"node": 1, "message": "forged", "mac": "00" * 32})
            stranger.set(distributed.FAILED_KEY, forged)
            seen["forged mac"] = world.failure_told(admission)
        world.barrier()
    Path(f"{out}.rank{world.rank}.json").write_text(json.dumps(seen))
    world.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
