"""Data parallelism: one trainer process per GPU (a rank), started by accelerate's launcher
(torchrun's elastic agent underneath, see trainer.launch), talking through torch.distributed.

What is split and what is agreed, per training step (B prompts, G completions each):

    prompts      the step's B prompts (trainer.trainer.batch_indices, from (seed, step) alone) in
                 contiguous shards, one per rank: a group never spans ranks, so each rank
                 scores its own groups and computes their advantages
    sampling     one generator per prompt, seeded from (seed, step, prompt's place in the step):
                 a prompt draws from the same random stream on any number of ranks
    after sampling   one all-reduce: was any rank interrupted by a stop request (then every rank
                 abandons the step), and the step's unmasked tokens (DAPO's normaliser)
    update       DistributedDataParallel averages the gradients; each rank's loss is normalised
                 by the whole step's completions or tokens and multiplied by the world size, so
                 the average is the gradient of the step's loss over all B x G completions
    metrics      all-gathered, rank 0 reports them
    step boundary    one all-reduce of (stop requested, past the deadline, checkpoint asked):
                 all ranks stop, or checkpoint, at the same step
    evaluation   batches dealt round-robin to the ranks, gathered at the end

Rank 0 alone reports events and seals checkpoints (every rank's RNG state gathered into it).
On several nodes (GROUP_RANK, LOCAL_WORLD_SIZE) rank 0's plan and the checkpoint it resumes from
are broadcast at the start (trainer.child.shared_plan, Checkpointer.load_latest): only rank 0's
node holds the job's checkpoints.
A single process (WORLD_SIZE unset or 1) initialises nothing and calls no collective. The model
across the ranks (DDP, FSDP): trainer.sharding.

A rank that dies makes its peers' next collective fail (gloo and NCCL see the closed
connection); the agent stops the rest of the group within its shutdown timeout anyway, and the
process group's timeout (GRPO_RUN_COLLECTIVE_TIMEOUT_S, default 1,800 s) bounds a rank that
hangs alive.

What a peer can send. Anyone who reaches rank 0's rendezvous port (MASTER_PORT) can set keys in
its store and, arriving first for a missing node's rank, join the group. So nothing that crosses
between ranks is a pickle: `gather` and `broadcast` carry JSON bytes in uint8 tensors (a size
first, capped at MAX_WIRE_BYTES), the checkpoint's files raw bytes under names each receiver
checks against its own folder (`received_path`). With NODES_SECRET_ENV set on every node (the
generated Kubernetes Job sets it from the Job's uid; elsewhere the launcher gives the same random
value to each node), `admit` makes every rank prove it holds that secret before rank 0 sends its
plan or a checkpoint, and a failure told through the store is believed only with this attempt's
signature (`tell_failure`, `failure_told`); unsigned text there is a lost rank, never the job's
own failure. Gloo and NCCL traffic is not encrypted: only the job's nodes may reach the port
(docs/security.md).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from pathlib import PurePosixPath
from typing import Any, Sequence

import torch

from grpo_run.trainer.protocol import NODES_SECRET_ENV

log = logging.getLogger(__name__)

TIMEOUT_ENV = "GRPO_RUN_COLLECTIVE_TIMEOUT_S"
FAILED_KEY = "grpo-run/failed"     # tell_failure's key in the rendezvous store
STORE_TIMEOUT_S = 10.0
SHARE_PIECE_BYTES = 64 << 20      # share_files: a checkpoint goes to the other nodes in pieces of this size
DEFAULT_TIMEOUT_S = 1800.0
MAX_WIRE_BYTES = 256 << 20        # gather/broadcast: the most one rank's JSON may announce (a step's metrics
                                  # and kept samples are kilobytes; a held-out evaluation's, megabytes)
NONCE_BYTES = 32


class WireRefused(RuntimeError):
    """A peer sent what the ranks never send each other (an oversized or malformed message)."""


class UnsafeName(WireRefused):
    """Rank 0 named a checkpoint file outside the receiving folder."""


class NodesNotAdmitted(RuntimeError):
    """A rank did not prove it holds the job's node secret: not (only) the job's nodes formed the
    group. The attempt ends as for a lost rank (restarted); nothing was sent to them."""


def _all_gather_tensor(dist):
    """torch's all-gather into one tensor, under its newer name where it has it (2.13 deprecates the old)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def to_wire(value: Any) -> bytes:
    """`value` as JSON bytes. Raises TypeError for what JSON cannot carry as it is (objects,
    arrays, dict keys that are not strings: they would come back as strings)."""
    _check_json(value, "value")
    return json.dumps(value, separators=(",", ":")).encode()


def from_wire(data: bytes) -> Any:
    try:
        return json.loads(data.decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise WireRefused(f"a rank sent bytes that are not JSON ({e}): refused") from None


def _check_json(value: Any, where: str) -> None:
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: key {k!r} is a {type(k).__name__}; ranks exchange JSON, whose keys are "
                                f"strings (send a list of pairs)")
            _check_json(v, f"{where}[{k!r}]")
        return
    raise TypeError(f"{where}: a {type(value).__name__}; ranks exchange JSON values only (never pickles): send its "
                    f"JSON form")


def received_path(into: Path, name: Any) -> Path:
    """Where a received file named `name` (relative, '/'-separated, as rank 0 sent it) goes under
    `into`. Raises UnsafeName for an absolute name, '..', '.', an empty part, or a path that a link
    under `into` would take outside it."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        raise UnsafeName(f"rank 0 sent the checkpoint file name {name!r}: not a relative file name; refused, "
                         f"nothing written (is rank 0 the job's node?)")
    parts = name.split("/")
    if PurePosixPath(name).is_absolute() or any(part in ("", ".", "..") for part in parts):
        raise UnsafeName(f"rank 0 sent the checkpoint file name {name!r}, which leaves the receiving folder {into}: "
                         f"refused, nothing written (is rank 0 the job's node?)")
    root = into.resolve()
    target = (root / name).resolve()
    if not target.is_relative_to(root) or target == root:
        raise UnsafeName(f"rank 0 sent the checkpoint file name {name!r}, which a link takes outside the receiving "
                         f"folder {into}: refused, nothing written")
    return root / name


def file_listing(folder: Path) -> list[list]:
    """share_files' listing of `folder`: [[relative name, size], ...] of its files."""
    return [[p.relative_to(folder).as_posix(), p.stat().st_size] for p in sorted(folder.rglob("*")) if p.is_file()]


_listing = file_listing        # what share_files sends (a test forges rank 0's names through it)


def checked_listing(listing: Any, into: Path | None) -> list[tuple[str, int]]:
    """share_files' listing as rank 0 sent it ([[name, size], ...]), every name checked against
    `into` (the node's own folder; None: the files are dropped, but the names are checked all the
    same) before anything is written. Raises UnsafeName / WireRefused."""
    if not isinstance(listing, list):
        raise WireRefused(f"rank 0 sent a file listing that is a {type(listing).__name__}: refused")
    out = []
    for entry in listing:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], int) and entry[1] >= 0):
            raise WireRefused(f"rank 0 sent the file entry {entry!r} (expected [name, size]): refused")
        received_path(into if into is not None else Path("/nonexistent-grpo-run-check"), entry[0])
        out.append((entry[0], entry[1]))
    if len({name for name, _ in out}) != len(out):
        raise WireRefused("rank 0 sent one file name twice: refused")
    return out


@dataclass(frozen=True)
class Admission:
    """This attempt's node key (None: no NODES_SECRET_ENV on this node) and the nonce rank 0 drew
    for it: what `admit` agreed on, what signs a told failure."""
    key: bytes | None
    nonce: bytes

    def mac(self, text: bytes) -> str:
        assert self.key is not None
        return hmac.new(self.key, self.nonce + text, hashlib.sha256).hexdigest()


def node_key(secret: str | None, job: str) -> bytes | None:
    """The job's node key: HMAC-SHA256 of the job's name under the node secret (so one secret
    shared by several jobs still gives each its own key). None without a secret."""
    if not secret:
        return None
    return hmac.new(secret.encode(), b"grpo-run nodes v1\n" + job.encode(), hashlib.sha256).digest()


def _failure_text(node: int, message: str) -> bytes:
    return b"failed\n" + str(node).encode() + b"\n" + message.encode()


def admit(world: "World", job: str, secret: str | None) -> Admission:
    """Several nodes, before rank 0 sends anything of the job: rank 0 draws a nonce, every rank
    answers HMAC(node key, nonce, its rank), rank 0 checks each answer. A collective: every rank
    calls it. Raises NodesNotAdmitted on every rank when rank 0 holds a secret and some rank's
    answer is wrong (a stranger who joined as a missing node's rank, or a node started without the
    secret); without a secret on rank 0 every rank is admitted, and rank 0 warns once."""
    key = node_key(secret, job)
    nonce = world.broadcast_bytes(secrets.token_bytes(NONCE_BYTES) if world.main else b"", NONCE_BYTES)
    admission = Admission(key, nonce)
    answer = bytes.fromhex(admission.mac(b"rank\n" + str(world.rank).encode())) if key is not None else bytes(32)
    answers = world.gather_bytes(answer)
    refused: list[int] = []
    if world.main:
        if key is None:
            log.warning("several nodes without %s: any host that reaches the rendezvous port could join as a "
                        "missing node's rank and receive the job's plan and checkpoint; set the same secret on "
                        "every node (docs/security.md)", NODES_SECRET_ENV)
        else:
            refused = [r for r, got in enumerate(answers)
                       if not hmac.compare_digest(got.hex(), admission.mac(b"rank\n" + str(r).encode()))]
    refused = world.broadcast(refused)
    if refused:
        raise NodesNotAdmitted(f"rank(s) {refused} did not prove the job's node secret ({NODES_SECRET_ENV}): a host "
                               f"that is not one of the job's nodes joined the group, or a node was started without "
                               f"the secret; nothing was sent to them, and the attempt ends as for a lost node")
    return admission


@dataclass(frozen=True)
class World:
    """This process's place among the run's processes."""
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    node: int = 0           # this process's node among the job's (torchrun's GROUP_RANK)
    nodes: int = 1          # the job's nodes (WORLD_SIZE / LOCAL_WORLD_SIZE)

    @property
    def main(self) -> bool:
        """Rank 0: reports events, seals checkpoints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @classmethod
    def from_environment(cls) -> World:
        """The world torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), with
        its process group initialised: NCCL on GPUs, gloo on CPUs. One process: nothing is
        initialised."""
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if size <= 1:
            return cls()
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE") or size)
        world = cls(rank=int(os.environ["RANK"]), size=size, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                    node=int(os.environ.get("GROUP_RANK", "0")), nodes=max(1, size // max(1, local_size)))
        import torch.distributed as dist

        if not dist.is_initialized():
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.set_device(world.local_rank)
            timeout = dt.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
        return world

    def device(self) -> torch.device:
        """This rank's device: its own GPU (LOCAL_RANK), else the CPU."""
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    def shard(self, n: int) -> range:
        """This rank's contiguous share of range(n): sizes differ by at most one, earlier ranks
        the larger (numpy's array_split)."""
        base, extra = divmod(n, self.size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (1 if self.rank < extra else 0))

    def agree(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag true on any rank, the same answer on every rank (one all-reduce)."""
        if not self.distributed:
            return tuple(bool(f) for f in flags)
        return tuple(v > 0 for v in self.total(*(float(bool(f)) for f in flags)))

    def total(self, *values: float) -> tuple[float, ...]:
        """Each value summed over the ranks (one all-reduce, float64)."""
        if not self.distributed:
            return tuple(float(v) for v in values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device())
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return tuple(t.tolist())

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (JSON: dicts with string keys, lists, tuples, strings, numbers,
        booleans, None; a tuple comes back a list), in rank order, on every rank. It travels as
        JSON bytes in a uint8 tensor, never as a pickle: rank 0 decodes what any rank sends (see
        the module's docstring, "What a peer can send")."""
        if not self.distributed:
            return [value]
        import torch.distributed as dist

        mine = to_wire(value)
        device = self.device()
        sizes = torch.zeros(self.size, dtype=torch.int64, device=device)
        _all_gather_tensor(dist)(sizes, torch.tensor([len(mine)], dtype=torch.int64, device=device))
        sizes_ = [int(n) for n in sizes.tolist()]
        if not all(0 < n <= MAX_WIRE_BYTES for n in sizes_):
            raise WireRefused(f"a rank announced {max(sizes_)} bytes to gather (at most {MAX_WIRE_BYTES}): refused")
        width = max(sizes_)
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        out = torch.empty(self.size * width, dtype=torch.uint8, device=device)
        _all_gather_tensor(dist)(out, padded.to(device))
        data = out.cpu().numpy().tobytes()
        return [from_wire(data[r * width:r * width + n]) for r, n in enumerate(sizes_)]

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` (JSON, as `gather`'s), on every rank; as JSON bytes, never a pickle."""
        if not self.distributed:
            return value
        import torch.distributed as dist

        device = self.device()
        mine = to_wire(value) if self.main else b""
        size = torch.tensor([len(mine)], dtype=torch.int64, device=device)
        dist.broadcast(size, src=0)
        n = int(size.item())
        if not 0 < n <= MAX_WIRE_BYTES:
            raise WireRefused(f"rank 0 announced {n} bytes to broadcast (at most {MAX_WIRE_BYTES}): refused")
        data = torch.frombuffer(bytearray(mine), dtype=torch.uint8) if self.main else torch.empty(n, dtype=torch.uint8)
        data = data.to(device)
        dist.broadcast(data, src=0)
        return from_wire(data.cpu().numpy().tobytes())

    def broadcast_bytes(self, data: bytes, n: int) -> bytes:
        """Rank 0's `data` (`n` bytes, agreed beforehand), on every rank (one broadcast)."""
        if not self.distributed:
            return data
        import torch.distributed as dist

        t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.main else torch.zeros(n, dtype=torch.uint8)
        t = t.to(self.device())
        dist.broadcast(t, src=0)
        return t.cpu().numpy().tobytes()

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's `data` (the same length on every rank), in rank order (one all-gather)."""
        if not self.distributed:
            return [data]
        import torch.distributed as dist

        n = len(data)
        out = torch.empty(self.size * n, dtype=torch.uint8, device=self.device())
        _all_gather_tensor(dist)(out, torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device()))
        got = out.cpu().numpy().tobytes()
        return [got[r * n:(r + 1) * n] for r in range(self.size)]

    def share_files(self, folder: Path | None, into: Path | None) -> None:
        """Rank 0's files under `folder` (rank 0 names it; None on the others) written under `into`
        by the ranks that pass one (None: received and dropped). A collective: every rank calls
        it; each file goes out in pieces of SHARE_PIECE_BYTES (one broadcast each). The receivers
        check every name before writing anything (`received_path`): a name that leaves `into`
        raises UnsafeName."""
        import torch.distributed as dist

        listing = self.broadcast(None if folder is None else _listing(folder))
        if folder is None:
            names = checked_listing(listing, into)
        else:
            names = [(name, size) for name, size in listing]
        device = self.device()
        for name, size in names:
            out = None
            if into is not None:
                target = received_path(into, name)      # again: a folder made for an earlier name
                target.parent.mkdir(parents=True, exist_ok=True)
                out = open(target, "xb")                # never through a link, never over a file
            source = open(folder / name, "rb") if folder is not None and size else None
            try:
                for start in range(0, size, SHARE_PIECE_BYTES):
                    n = min(SHARE_PIECE_BYTES, size - start)
                    piece = torch.empty(n, dtype=torch.uint8)
                    if source is not None:
                        piece = torch.frombuffer(bytearray(source.read(n)), dtype=torch.uint8)
                    sent = piece.to(device)
                    dist.broadcast(sent, src=0)
                    if out is not None:
                        out.write(sent.cpu().numpy().tobytes())
            finally:
                if source is not None:
                    source.close()
                if out is not None:
                    out.flush()
                    os.fsync(out.fileno())
                    out.close()

    def tell_failure(self, message: str, admission: Admission | None) -> None:
        """Several nodes: the job's own failure on this rank (a reward function's), left for rank 0 in
        the rendezvous store (rank 0's node hosts it) before this rank exits. Its supervisor is not
        rank 0's: without this, rank 0 would see only a lost peer. Signed with the attempt's node
        key (`admit`); without one (no NODES_SECRET_ENV) it is left unsigned, and rank 0 will
        treat it as a lost rank."""
        doc = {"node": self.node, "message": message}
        if admission is not None and admission.key is not None:
            doc["mac"] = admission.mac(_failure_text(doc["node"], message))
        try:
            self._store().set(FAILED_KEY, json.dumps(doc))
        except Exception:           # the store gone too: rank 0 sees a lost rank, as it would anyway
            pass

    def failure_told(self, admission: Admission | None) -> str | None:
        """What another node's rank told with tell_failure, when it carries this attempt's node
        key's signature (None: nothing, or text that is not provably from the job's nodes, which
        anyone who reaches the store's port can leave there: then the caller sees a lost rank)."""
        if admission is None or admission.key is None:
            if self._told_raw() is not None:
                log.warning("another node's rank left a failure in the rendezvous store, but no %s is set on this "
                            "node, so it cannot be told from a stranger's: treated as a lost rank", NODES_SECRET_ENV)
            return None
        raw = self._told_raw()
        if raw is None:
            return None
        try:
            doc = json.loads(raw)
            node, message, mac = int(doc["node"]), str(doc["message"]), str(doc["mac"])
        except (ValueError, KeyError, TypeError):
            log.warning("the rendezvous store holds a failure that is not the job's nodes' (not their form): "
                        "treated as a lost rank")
            return None
        if not hmac.compare_digest(mac, admission.mac(_failure_text(node, message))):
            log.warning("the rendezvous store holds a failure not signed with this attempt's node key (a stranger "
                        "on the node network?): treated as a lost rank")
            return None
        return message

    def _told_raw(self) -> bytes | None:
        try:
            store = self._store()
            return store.get(FAILED_KEY) if store.check([FAILED_KEY]) else None
        except Exception:
            return None

    @staticmethod
    def _store():
        import torch.distributed as dist

        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=dt.timedelta(seconds=STORE_TIMEOUT_S))

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def concat(parts: Sequence[Sequence[float]]) -> list[float]:
    return [x for part in parts for x in part]
