"""The launcher's rendezvous (trainer.launch): rank 0's store listens on the address it was given."""

from __future__ import annotations

import socket

import psutil

from grpo_run.trainer.launch import RENDEZVOUS_BACKEND, bound_listener, machines, register_bound_rendezvous


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port}


def test_the_rendezvous_store_listens_only_on_the_address_it_was_given():
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    port = _free_port()
    register_bound_rendezvous()                     # as launch() does, so torchrun's agent finds it by name
    handler = rendezvous_handler_registry.create_handler(RendezvousParameters(
        RENDEZVOUS_BACKEND, "", "job", 1, 1, rank="0", address=f"127.0.0.1:{port}", timeout="10"))
    info = handler.next_rendezvous()
    info.store.set("k", "v")                       # a working store (the agent and the ranks use it)
    assert info.store.get("k") == b"v"
    assert _listening(port) == {"127.0.0.1"}        # torch's own static rendezvous: "::", every interface


def test_an_address_that_is_not_this_nodes_falls_back_to_every_interface():
    assert bound_listener("192.0.2.1", _free_port()) is None       # TEST-NET-1: nobody's address
    sock = bound_listener("127.0.0.1", 0)
    assert sock is not None and sock.getsockname()[0] == "127.0.0.1"
    sock.close()


def test_the_launcher_asks_for_the_bound_rendezvous_on_one_node_and_on_several():
    one = machines(2, {})
    several = machines(1, {"GRPO_RUN_NODES": "2", "GRPO_RUN_NODE_RANK": "0", "GRPO_RUN_MASTER": "10.0.0.5:29500"})
    for args in (one, several):
        assert args[args.index("--rdzv_backend") + 1] == RENDEZVOUS_BACKEND
