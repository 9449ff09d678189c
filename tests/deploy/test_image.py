"""`grpo-run deploy image`: the container image's build context for `deploy k8s --image`: the
Dockerfile, this grpo-run's wheel and constraints, and the install step every node runs, which
installs from the context for real here (no Docker daemon needed for that part)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_run.runner.cli.commands import EXIT_OK, EXIT_USAGE, main
from grpo_run.runner.deploy.node import IMAGE_SOURCE, image_context
from grpo_run.runner.deploy.wheel import build_wheel


def test_the_context_holds_the_dockerfile_the_wheel_and_its_install_step(tmp_path, capsys):
    out = tmp_path / "image"
    assert main(["deploy", "image", "--out", str(out), "--torch", "cu126"]) == EXIT_OK
    printed = capsys.readouterr().out
    names = sorted(p.name for p in out.iterdir())
    (wheel,) = [n for n in names if n.endswith(".whl")]
    assert names == sorted(["Dockerfile", "constraints.txt", "install-node.sh", wheel])
    dockerfile = (out / "Dockerfile").read_text()
    assert f"ARG PYTHON={sys.version_info.major}.{sys.version_info.minor}\n" in dockerfile
    assert f"COPY . {IMAGE_SOURCE}/" in dockerfile and "USER 1000:1000" in dockerfile
    script = (out / "install-node.sh").read_text()
    assert f'WHEEL_URL="{IMAGE_SOURCE}/{wheel}"' in script
    assert 'TORCH_INDEX="https://download.pytorch.org/whl/cu126"' in script
    assert "docker build -t REGISTRY/grpo-run:" in printed and str(out) in printed


def test_an_image_needs_a_new_folder(tmp_path, capsys):
    assert main(["deploy", "image"]) == EXIT_USAGE
    assert "give --out DIR" in capsys.readouterr().err
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    assert main(["deploy", "image", "--out", str(used)]) == EXIT_USAGE
    assert "not an empty folder" in capsys.readouterr().err
    assert [p.name for p in used.iterdir()] == ["notes.txt"]          # nothing written next to it


@pytest.mark.slow
def test_the_images_install_step_installs_the_wheel_from_the_context(tmp_path):
    """What the Dockerfile's RUN does, here: the context's install-node.sh (its source folder
    moved from IMAGE_SOURCE to where the context is, its prefix to a temporary folder), into a
    new venv whose dependencies come from this test's site-packages, pip kept off the network."""
    prefix = tmp_path / "opt"
    context = tmp_path / "image"
    image_context(build_wheel(tmp_path / "wheel"), context, torch="cpu", python="3.11", prefix=str(prefix))
    script = context / "install-node.sh"
    script.write_text(script.read_text().replace(IMAGE_SOURCE, str(context)))
    venv = prefix / ".venv"
    subprocess.run([Path(sys.base_prefix) / "bin" / "python3", "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "_deps_from_the_test_venv.pth").write_text("".join(p + "\n" for p in sys.path
                                                                    if p.endswith("site-packages")))
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PIP_NO_INDEX": "1"}
    done = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    version = subprocess.run([venv / "bin" / "grpo-run", "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert version.returncode == 0 and "apply" in version.stdout
    where = subprocess.run([venv / "bin" / "python", "-c", "import grpo_run.runner.cli.commands as c; print(c.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(venv)
