"""vLLM's colocated engine runs in the test's own process (as in a trainer), where it initialises a
one-process torch.distributed group and lowers torch's threads for serving. A module of these tests
leaves the worker as it found it, so the tests that run after it in the same xdist worker (a
thread share, a single process without a group) see a plain process."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _the_process_as_it_was():
    threads = torch.get_num_threads()
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    torch.set_num_threads(threads)
