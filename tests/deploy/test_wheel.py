"""The wheel nodes install (runner/deploy/wheel.py): built from what is installed here, keyed by its
content, put into the job's storage only where the job's other files may go."""

from __future__ import annotations

import hashlib
import importlib.metadata
import shutil
import tomllib
import zipfile
from pathlib import Path

import pytest

from grpo_run.checkpoint.storage.lease import Lease
from grpo_run.checkpoint.storage.store import Store
from grpo_run.runner.jobs.envfiles import with_file_hashes
from grpo_run.runner.jobs.find import jobs_in
from grpo_run.runner.spec.job import load_job
from grpo_run.runner.jobs.submit import SubmitRefused, submit
from grpo_run.runner.deploy.wheel import (DIST_PREFIX, WheelError, _build_from_source, _check_setuptools, _digest,
                                   build_wheel, publish)
from tests.runner.jobs.test_resume import REPO, grpo_run, write_job


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def source_copy(folder: Path) -> Path:
    """The files an editable install's wheel is built from (pyproject's package folders, its
    readme), copied: a tree of our own to change."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    folder.mkdir()
    for name in ("pyproject.toml", project["project"]["readme"]):
        shutil.copy2(REPO / name, folder / name)
    for sub in project["tool"]["setuptools"]["package-dir"].values():
        shutil.copytree(REPO / sub, folder / sub, ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def test_the_wheel_holds_the_templates_and_the_constraints_with_torch_pinned(wheel):
    names = zipfile.ZipFile(wheel.path).namelist()
    assert {"grpo_run/deploy/install-node.sh", "grpo_run/deploy/constraints.txt",
            "grpo_run/deploy/cloud-init.yaml"} <= set(names)
    shipped = zipfile.ZipFile(wheel.path).read("grpo_run/deploy/constraints.txt")
    assert shipped == (REPO / "constraints.txt").read_bytes()         # the symlink's target, not the link
    torch = importlib.metadata.version("torch").split("+")[0]
    assert wheel.constraints == shipped.rstrip(b"\n") + f"\ntorch=={torch}\n".encode()
    assert wheel.version == importlib.metadata.version("grpo-run")
    assert wheel.wheel_key == f"{DIST_PREFIX}/{wheel.version}-{wheel.digest}/{wheel.path.name}"


def test_the_same_code_gets_the_same_key_and_changed_code_another(tmp_path, wheel):
    again = build_wheel(tmp_path / "again")
    assert again.digest == wheel.digest                 # a second build: other zip times, same files
    tree = source_copy(tmp_path / "tree")
    same = _build_from_source(tree, tmp_path / "same")
    assert _digest(same, wheel.constraints) == wheel.digest
    (tree / "runner" / "deploy" / "wheel.py").write_text((tree / "runner" / "deploy" / "wheel.py").read_text() + "\n# changed\n")
    changed = _build_from_source(tree, tmp_path / "changed")
    assert _digest(changed, wheel.constraints) != wheel.digest
    assert _digest(same, wheel.constraints + b"numpy==1.0\n") != wheel.digest    # other pins: another key


def test_building_from_a_source_tree_writes_nothing_into_it(tmp_path):
    tree = source_copy(tmp_path / "tree")
    before = sorted(p.relative_to(tree) for p in tree.rglob("*"))
    _build_from_source(tree, tmp_path / "out")
    assert sorted(p.relative_to(tree) for p in tree.rglob("*")) == before     # no build/, no egg-info


def test_a_setuptools_older_than_pyproject_asks_is_refused_with_the_fix():
    with pytest.raises(WheelError, match=r"needs setuptools>=999 in this environment \(have .*\): .* -m pip "
                                         r"install 'setuptools>=999'"):
        _check_setuptools({"build-system": {"requires": ["setuptools>=999"]}})
    _check_setuptools(tomllib.loads((REPO / "pyproject.toml").read_text()))     # this environment's is new enough


def test_publishing_puts_the_wheel_and_names_its_bytes(tmp_path, wheel):
    storage = str(tmp_path / "bucket")
    published = publish(wheel, storage)
    store = Store(storage)
    assert store.get_bytes(wheel.constraints_key) == wheel.constraints
    assert store.get_bytes(wheel.wheel_key) == wheel.path.read_bytes()
    assert published.sha256 == hashlib.sha256(wheel.path.read_bytes()).hexdigest() == wheel.sha256
    assert published.constraints_sha256 == hashlib.sha256(wheel.constraints).hexdigest()


@pytest.mark.trust
def test_a_swapped_wheel_under_the_key_is_replaced_and_another_build_of_the_same_files_is_kept(tmp_path, wheel):
    storage = str(tmp_path / "bucket")
    publish(wheel, storage)
    stored = Path(storage) / wheel.wheel_key
    # a bucket writer's wheel: the same files and one more (a .pth runs at every interpreter start)
    with zipfile.ZipFile(wheel.path) as zf, zipfile.ZipFile(tmp_path / "swapped.whl", "w") as out:
        for info in zf.infolist():
            out.writestr(info, zf.read(info))
        out.writestr("zzz_owned.pth", "import os; os.system('id > /tmp/owned')\n")
    stored.write_bytes((tmp_path / "swapped.whl").read_bytes())
    (Path(storage) / wheel.constraints_key).write_bytes(wheel.constraints + b"--extra-index-url http://127.0.0.1:9/\n")
    assert publish(wheel, storage).sha256 == wheel.sha256
    assert stored.read_bytes() == wheel.path.read_bytes()            # ours again
    assert (Path(storage) / wheel.constraints_key).read_bytes() == wheel.constraints
    # another build of exactly these files (other order, times and compression) is kept, and named
    with zipfile.ZipFile(wheel.path) as zf, zipfile.ZipFile(tmp_path / "rebuilt.whl", "w", zipfile.ZIP_STORED) as out:
        for info in reversed(zf.infolist()):
            out.writestr(zipfile.ZipInfo(info.filename, date_time=(2001, 2, 3, 4, 5, 6)), zf.read(info))
    rebuilt = (tmp_path / "rebuilt.whl").read_bytes()
    stored.write_bytes(rebuilt)
    assert publish(wheel, storage).sha256 == hashlib.sha256(rebuilt).hexdigest() != wheel.sha256
    assert stored.read_bytes() == rebuilt


def test_apply_detach_puts_the_wheel_beside_the_jobs_and_it_is_no_job(tmp_path, wheel):
    storage = tmp_path / "bucket"
    grpo_run(tmp_path / "laptop", "apply", "-f", str(write_job(tmp_path, str(storage))), "--detach")
    assert _digest(storage / wheel.wheel_key, wheel.constraints) == wheel.digest    # this code, built by apply
    assert (storage / wheel.constraints_key).read_bytes() == wheel.constraints
    assert jobs_in(str(storage)) == ["resumable"]       # _dist/ is not a job: `resume` alone still finds it


def test_a_job_another_node_holds_gets_no_wheel(tmp_path, wheel):
    storage = str(tmp_path / "bucket")
    job = with_file_hashes(load_job(write_job(tmp_path, storage)))
    url = f"{storage}/{job.name}"
    submit(job, url, holder="laptop")                   # submitted without a wheel
    node = Lease(url, holder="node-a")
    node.acquire()
    try:
        changed = with_file_hashes(load_job(write_job(tmp_path, storage, learningRate=0.001)))
        with pytest.raises(SubmitRefused):
            submit(changed, url, holder="laptop", wheel=wheel)
    finally:
        node.release()
    assert not (Path(storage) / DIST_PREFIX).exists()   # refused: nothing of it written either
