"""Several nodes resume the same job at the same moment (a replacement node booting while the
old one is not yet gone, a Kubernetes Job and a SkyPilot job both started): exactly one takes the
job's lease and trains, every other says who holds it and exits 5 having written nothing."""

from __future__ import annotations

import pytest

from tests.campaign import full_campaign_only
from tests.faults.harness import start_node
from tests.runner.jobs.test_resume import grpo_run, status, write_job

pytestmark = pytest.mark.fault


@pytest.mark.parametrize("nodes", [2, pytest.param(5, marks=full_campaign_only("CI runs two nodes at once"))])
def test_nodes_resuming_one_job_at_once_leave_exactly_one_training(tmp_path, s3_env, figures, nodes):
    job = write_job(tmp_path, s3_env.url, maxSteps=300, saveSteps=50)
    grpo_run(tmp_path / "laptop", "apply", "--detach", "-f", str(job))         # Pending in storage
    procs = [start_node(tmp_path / f"node-{i}", "resume", "resumable", "--storage", s3_env.url,
                        GRPO_RUN_NOTICES="none") for i in range(nodes)]
    ended = [(p.returncode, err) for p in procs for _, err in [p.communicate(timeout=600)]]
    codes = sorted(code for code, _ in ended)
    trained = [i for i in range(nodes) if (tmp_path / f"node-{i}" / "runs" / "resumable" / "checkpoints").exists()]
    figures.add("split", nodes=nodes, trained=len(trained), refused=codes.count(5))
    assert codes == [0] + [5] * (nodes - 1), [err[-1500:] for _, err in ended]
    assert all("held by" in err for code, err in ended if code == 5)
    assert len(trained) == 1                                   # the others trained nothing
    st = status(tmp_path / "node-x", s3_env.url)
    assert st["phase"] == "Succeeded" and len(st["attempts"]) == 1
