"""The trainer on several processes: `python -m grpo_run.trainer.launch N WORK/plan.json`.

The supervisor starts this in place of `python -m grpo_run.trainer.child` when the job asks for more than
one process (spec.resources.processes). It runs accelerate's own launcher in this process
(`accelerate launch --multi_gpu --num_processes N -m grpo_run.trainer.child plan.json`; torchrun's
elastic agent underneath, no restarts), which starts one trainer.child per rank with RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set. What this process adds, so that the supervisor
sees one trainer as before:

- the events pipe: torchrun closes inherited descriptors, so the ranks open it by path, as this
  process's descriptor under /proc (GRPO_RUN_EVENTS_PATH);
- signals: SIGTERM (a notice) goes to every rank through the agent, which forwards it and kills
  what is still running after its shutdown timeout; SIGUSR1 (checkpoint at the next step) goes
  to rank 0, and the ranks agree on it at the step boundary;
- the exit status: trainer.protocol's CHILD_* (done, stopped, the reward function's error,
  crashed) from the ranks' exit statuses, which the agent reports only as a failure;
- the rendezvous store bound to the address it was given (`bound_rendezvous`): torch's own static
  rendezvous listens on every interface, even for 127.0.0.1;
- threads: a first attempt's pool (GRPO_RUN_CPU_SHARE) is split evenly among the ranks, each rank
  gets the same count (replicas must round their optimizer steps alike), and the ranks take no
  further share of the node's other trainers.

A rank that dies ends the attempt: the agent sees it within its monitor interval, sends the
others SIGTERM (their next collective fails on the lost peer anyway) and SIGKILLs whatever still
runs 30 s later; this process then exits CHILD_CRASHED and the supervisor restarts from the last
durable checkpoint. This process dies with the supervisor, the ranks with this process.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Mapping

from grpo_run.checkpoint.procs import die_with_parent
from grpo_run.trainer.protocol import (CHECKPOINT_SIGNAL, CHILD_CODE_ERROR, CHILD_CRASHED, CHILD_DONE, CHILD_NO_GROUP,
                                       CHILD_STOPPED,
                                       EVENTS_FD_ENV, EVENTS_PATH_ENV, MASTER_ENV, NODE_RANK_ENV, NODES_ENV, PARENT_ENV,
                                       RENDEZVOUS_TIMEOUT_ENV, SHARE_ENV)

log = logging.getLogger(__name__)

MONITOR_INTERVAL_S = 0.2       # how often the agent looks at its ranks: a dead one is seen this fast
CPP_LOG_ENV = "TORCH_CPP_LOG_LEVEL"
RENDEZVOUS_TIMEOUT_S = 600     # several nodes: how long one waits for the others (torchrun's own default)
RENDEZVOUS_BACKEND = "grpo-run-static"     # torch's static rendezvous, its store bound to the given address


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_environment(env: dict[str, str], processes: int, launcher_pid: int, supervisor_pid: int) -> dict[str, str]:
    """What the ranks inherit from this process (see the module's docstring)."""
    out = dict(env)
    out[EVENTS_PATH_ENV] = f"/proc/{launcher_pid}/fd/{env[EVENTS_FD_ENV]}"
    out[PARENT_ENV] = str(launcher_pid)               # the ranks' parent, which they die with
    pool = out.pop(SHARE_ENV, None)
    if pool is not None:                              # a first attempt: the run's pool split evenly
        out["OMP_NUM_THREADS"] = str(max(1, int(pool) // processes))
    return out


def exit_status(codes: dict[int, int]) -> int:
    """trainer.child's status for the run from the ranks that failed (rank -> exit status; the
    agent reports the first ones it saw): the reward function's error wins, then a crash (any
    other status, a signal); only ranks that all stopped cleanly make a stopped run. A rank
    ended by SIGTERM was stopped by the agent because another rank had ended (a notice comes as
    SignalException, not here): it says nothing of its own. Ranks leave trainer.child only
    together (a barrier after rank 0 has sealed and reported), so one that the agent's SIGTERM
    catches on its way out had finished its work."""
    own = {rank: c for rank, c in codes.items() if c != -signal.SIGTERM}
    if any(c == CHILD_CODE_ERROR for c in own.values()):
        return CHILD_CODE_ERROR
    if own and all(c == CHILD_STOPPED for c in own.values()):
        return CHILD_STOPPED
    return CHILD_CRASHED


def bound_listener(host: str, port: int) -> socket.socket | None:
    """A listening socket on `host`:`port` (the rendezvous store's, handed to torch's TCPStore as
    master_listen_fd), or None when `host` is not an address of this node (a Kubernetes Service's
    cluster IP, a NAT'd public address): then the store listens on every interface, as torch's own
    does, and only the network keeps strangers from the port (docs/security.md)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return None
    for family, kind, proto, _, addr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(128)
            return sock
        except OSError:
            sock.close()
    return None


def register_bound_rendezvous() -> None:
    """Register RENDEZVOUS_BACKEND with torch's rendezvous handlers (`bound_rendezvous`). The agent
    runs in this process, so the registration reaches it."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(RENDEZVOUS_BACKEND, bound_rendezvous)


def bound_rendezvous(params):
    """torch's static rendezvous for `params`, with rank 0's store listening on the address it was
    given (`bound_listener`) where that is one of this node's."""
    import datetime as dt

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    class BoundStaticRendezvous(StaticTCPRendezvous):
        def get_backend(self) -> str:
            return RENDEZVOUS_BACKEND

        def next_rendezvous(self):
            if self._store is None and self.rank == 0:
                sock = bound_listener(self.master_addr, self.master_port)
                if sock is None:
                    log.warning("the rendezvous address %s is not one of this node's, so the store listens on every "
                                "interface at port %s: only the job's nodes may reach it (docs/security.md)",
                                self.master_addr, self.master_port)
                self._store = TCPStore(self.master_addr, self.master_port, self.world_size, True, self.timeout,
                                       multi_tenant=True, master_listen_fd=None if sock is None else sock.detach())
            return super().next_rendezvous()

    # what torch's own create_rdzv_handler reads, which torchrun fills for "static" alone: the rank and,
    # on one node, the endpoint come in --rdzv_conf (machines())
    endpoint = (params.endpoint or str(params.config.get("address", ""))).strip()
    host, port = parse_rendezvous_endpoint(endpoint, -1)
    if port == -1 or "rank" not in params.config:
        raise ValueError(f"{RENDEZVOUS_BACKEND}: the rendezvous needs HOST:PORT and this node's rank (got "
                         f"{endpoint!r}, rank {params.config.get('rank')!r})")
    return BoundStaticRendezvous(host, port, int(params.config["rank"]), params.max_nodes, params.run_id,
                                 int(params.config.get("timeout", RENDEZVOUS_TIMEOUT_S)))


def machines(processes: int, env: Mapping[str, str]) -> list[str]:
    """accelerate's arguments for where the ranks are: this node alone (a free port on
    127.0.0.1), or one of NODES_ENV nodes (NODE_RANK_ENV, rank 0's node at MASTER_ENV, host:port)
    on torch's static rendezvous (RENDEZVOUS_BACKEND: its store bound to the address given, the rank
    and one node's endpoint in --rdzv_conf): a TCP store on rank 0's node, each node's rank as given (rank 0
    is the node that holds the job's lease), and RENDEZVOUS_TIMEOUT_ENV seconds for every node to
    arrive, after which the agent gives up (default RENDEZVOUS_TIMEOUT_S)."""
    nodes = int(env.get(NODES_ENV) or 1)
    if nodes <= 1:
        port = free_port()
        return ["--num_processes", str(processes), "--num_machines", "1", "--main_process_ip", "127.0.0.1",
                "--main_process_port", str(port), "--rdzv_backend", RENDEZVOUS_BACKEND,
                "--rdzv_conf", f"rank=0,address=127.0.0.1:{port}"]
    host, _, port = env[MASTER_ENV].rpartition(":")
    timeout = int(float(env.get(RENDEZVOUS_TIMEOUT_ENV) or RENDEZVOUS_TIMEOUT_S))
    return ["--num_processes", str(processes * nodes), "--num_machines", str(nodes),
            "--machine_rank", env[NODE_RANK_ENV], "--main_process_ip", host.strip("[]"), "--main_process_port", port,
            "--rdzv_backend", RENDEZVOUS_BACKEND, "--rdzv_conf", f"timeout={timeout},rank={int(env[NODE_RANK_ENV])}"]


def launch(processes: int, plan: str) -> int:
    # This process runs the agent alone: what goes wrong in it is said below in one line each. Its
    # c10d store's own C++ log (a rendezvous timeout prints the socket error with its C++ frames)
    # is silenced here; the level is read once, when libtorch loads, and the ranks get the user's.
    user_cpp_log = os.environ.get(CPP_LOG_ENV)
    os.environ[CPP_LOG_ENV] = "FATAL"
    import torch.distributed.run  # noqa: F401 - accelerate imports it late; its loggers must exist to be quieted
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    # The agent logs every stop it makes (an ERROR line for a rank that ended as stopped, as for
    # one that crashed); what the run makes of the ranks' statuses is logged below instead.
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    # torchrun says master_addr and node_rank serve only its "static" backend: RENDEZVOUS_BACKEND is that one too
    logging.getLogger("torch.distributed.run").addFilter(
        lambda record: "only used for static rdzv_backend" not in record.getMessage())

    register_bound_rendezvous()
    os.environ.pop(CPP_LOG_ENV)
    if user_cpp_log is not None:
        os.environ[CPP_LOG_ENV] = user_cpp_log
    ranks = rank_environment(dict(os.environ), processes, os.getpid(), os.getppid())
    os.environ.pop(SHARE_ENV, None)
    os.environ.update(ranks)
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    signal.signal(CHECKPOINT_SIGNAL, lambda signum, frame: _to_rank_zero(signum))
    args = launch_command_parser().parse_args([
        "--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no", "--num_cpu_threads_per_process", threads,
        *machines(processes, os.environ), "--monitor_interval", str(MONITOR_INTERVAL_S), "--max_restarts", "0",
        "--quiet", "--module", "grpo_run.trainer.child", plan])
    try:
        launch_command(args)
    except (DistError, RendezvousError, TimeoutError) as e:       # several nodes: no group was formed
        master, timeout = os.environ.get(MASTER_ENV), os.environ.get(RENDEZVOUS_TIMEOUT_ENV) or RENDEZVOUS_TIMEOUT_S
        log.error("no group: the rendezvous at %s did not complete within %s s (%s): the node of rank 0 must be "
                  "reachable at that address and every node started with the same --nnodes; nothing was trained",
                  master, timeout, str(e).splitlines()[0] if str(e) else type(e).__name__)
        return CHILD_NO_GROUP
    except ChildFailedError as e:
        codes = {f.local_rank: f.exitcode for f in e.failures.values()}
        status = exit_status(codes)
        if status != CHILD_STOPPED:
            log.warning("the attempt ends: ranks ended with %s (rank: exit status, negative: killed by that "
                        "signal); their logs are logs/trainer*.log", codes)
        return status
    except SignalException:          # a notice: the agent stopped every rank (each at the same step)
        return CHILD_STOPPED
    return CHILD_DONE


def _to_rank_zero(signum: int) -> None:
    """Forward `signum` to rank 0 (a child of this process, RANK=0 in its environment)."""
    import psutil

    for child in psutil.Process().children():
        try:
            if child.environ().get("RANK") == "0":
                os.kill(child.pid, signum)
        except (psutil.Error, OSError):
            continue


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return launch(int(argv[0]), str(Path(argv[1])))


if __name__ == "__main__":
    die_with_parent()
    if os.environ.get(PARENT_ENV) and os.getppid() != int(os.environ[PARENT_ENV]):
        sys.exit(CHILD_CRASHED)          # the supervisor died before the line above
    sys.exit(main())
