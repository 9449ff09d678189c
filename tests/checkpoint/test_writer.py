"""The checkpoint writer process: a snapshot in the shared buffer becomes a sealed local
checkpoint, which the supervisor's uploader makes durable in storage trusting its manifest; the
buffer is reused only once read; failures are reported, never swallowed; and the writer never
outlives its trainer."""

from __future__ import annotations

import json
import os
import select
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_run.checkpoint.manifest import checkpoint_dir, sealed, verify
from grpo_run.checkpoint.storage.store import Store
from grpo_run.checkpoint.sync import Uploader, remote_discover
from grpo_run.checkpoint.writer import CheckpointWriter, Failed, Sealed, WriterDied, weights_finite, write_files

REPO = Path(__file__).resolve().parents[2]


def put_floats(writer: CheckpointWriter, values: list[float]) -> dict:
    """A layout of one safetensors file holding `values` (float32) plus a text file, with the
    values copied into the writer's buffer."""
    data = struct.pack(f"<{len(values)}f", *values)
    buf = writer.buffer(len(data))
    buf[:len(data)] = data
    return {"weights.safetensors": {"tensors": [["w", "float32", [len(values)], 0, len(data)]],
                                    "metadata": {"format": "pt"}},
            "state.json": {"text": json.dumps({"n": len(values)})}}


def floats_in(path: Path) -> list[float]:
    from safetensors.numpy import load_file

    return load_file(str(path))["w"].tolist()


@pytest.fixture
def writer(tmp_path):
    w = CheckpointWriter(tmp_path / "local", keep=2, meta={"job": "t"})
    yield w
    w.close()


def upload_sealed(folder: Path, storage: str) -> dict:
    """What the supervisor does with a sealed checkpoint: upload it, its manifest trusted."""
    reports = []
    uploader = Uploader(Store(storage), on_upload=lambda step, durable, error: reports.append(
        {"upload": step, "durable": durable, "error": None if error is None else str(error),
         "config": type(error).__name__ == "StorageConfigError"}))
    try:
        uploader.submit(folder, sealed(folder))
        uploader.wait(timeout=60)
    finally:
        uploader.close()
    return reports[-1]


def test_a_snapshot_in_the_buffer_becomes_a_sealed_checkpoint_and_then_a_durable_one(writer, tmp_path):
    writer.submit(1, put_floats(writer, [1.0, 2.0, 3.0]))
    events = writer.wait_sealed(1, timeout=60)

    assert Sealed(sealed=1) in events
    upload = upload_sealed(checkpoint_dir(tmp_path / "local", 1), str(tmp_path / "store"))
    assert upload == {"upload": 1, "durable": [1], "error": None, "config": False}
    local = checkpoint_dir(tmp_path / "local", 1)
    assert verify(local).meta == {"job": "t", "finite": True}
    assert floats_in(local / "weights.safetensors") == [1.0, 2.0, 3.0]
    assert json.loads((local / "state.json").read_text()) == {"n": 3}
    assert remote_discover(Store(str(tmp_path / "store"))) == [1]


def test_a_checkpoint_with_a_nan_or_an_infinity_is_sealed_marked_not_finite(writer, tmp_path):
    """Its manifest says so, which pruning reads: the newest finite checkpoint is never pruned."""
    writer.submit(1, put_floats(writer, [1.0, float("nan"), 3.0]))
    writer.wait_sealed(1, timeout=60)
    writer.submit(2, put_floats(writer, [1.0, float("-inf"), 3.0]))
    writer.wait_sealed(2, timeout=60)

    assert verify(checkpoint_dir(tmp_path / "local", 1)).meta == {"job": "t", "finite": False}
    assert verify(checkpoint_dir(tmp_path / "local", 2)).meta == {"job": "t", "finite": False}


@pytest.mark.parametrize("dtype, values, finite", [
    ("float32", [1.0, 3.0e38], True),
    ("float32", [1.0, float("inf")], False),
    ("float64", [1e300, float("nan")], False),
    ("float16", [65504.0], True),
    ("float16", [float("inf")], False),
    ("bfloat16", [3.0e38], True),
    ("bfloat16", [float("nan")], False),
    ("int64", [-1], True),            # every bit set, and still an integer, not a NaN
    ("float8_e4m3fn", [1.0], None),   # a float type it cannot read: nothing is claimed
])
def test_weights_finite_reads_each_float_type_by_its_exponent_bits(dtype, values, finite):
    import torch

    tensor = torch.tensor(values, dtype=getattr(torch, dtype))
    data = bytearray(tensor.view(torch.uint8).numpy().tobytes()) if tensor.numel() else bytearray()
    layout = {"w.safetensors": {"tensors": [["w", dtype, [len(values)], 0, len(data)]]}, "a.json": {"text": "{}"}}
    assert weights_finite(layout, data) is finite


def test_the_buffer_is_handed_back_only_after_the_writer_has_read_the_snapshot(writer, tmp_path):
    writer.submit(1, put_floats(writer, [1.0] * 1000))
    writer.submit(2, put_floats(writer, [2.0] * 1000))    # overwrites the buffer: must wait first
    writer.submit(3, put_floats(writer, [3.0] * 1000))
    writer.wait_sealed(3, timeout=60)

    for step in (2, 3):    # keep=2: step 1 was pruned
        assert floats_in(checkpoint_dir(tmp_path / "local", step) / "weights.safetensors") == [float(step)] * 1000
    assert not checkpoint_dir(tmp_path / "local", 1).exists()


def test_the_buffer_grows_when_a_snapshot_needs_more_room(writer, tmp_path):
    writer.submit(1, put_floats(writer, [1.0]))
    writer.submit(2, put_floats(writer, [2.0] * 100_000))
    writer.wait_sealed(2, timeout=60)
    assert floats_in(checkpoint_dir(tmp_path / "local", 2) / "weights.safetensors") == [2.0] * 100_000


def test_a_checkpoint_that_cannot_be_written_is_reported_with_the_reason(writer, tmp_path):
    layout = put_floats(writer, [1.0])
    layout["weights.safetensors"]["tensors"][0][4] = 1 << 40          # beyond the buffer
    writer.submit(7, layout)
    events = writer.wait_sealed(7, timeout=60)

    failed = next(e for e in events if isinstance(e, Failed))
    assert failed.failed == 7 and "outside the snapshot buffer" in failed.error
    assert not checkpoint_dir(tmp_path / "local", 7).exists()
    writer.submit(8, put_floats(writer, [8.0]))                       # and the writer goes on
    assert Sealed(sealed=8) in writer.wait_sealed(8, timeout=60)


def test_a_bucket_that_does_not_exist_is_reported_as_a_configuration_error(writer, tmp_path, s3_env):
    writer.submit(1, put_floats(writer, [1.0]))
    writer.wait_sealed(1, timeout=60)
    upload = upload_sealed(checkpoint_dir(tmp_path / "local", 1), f"s3://no-such-bucket-{os.getpid()}/run")
    assert upload["config"] and "bucket does not exist" in upload["error"] and upload["durable"] == []


def test_a_writer_that_was_killed_is_reported_not_waited_for(writer):
    writer.submit(1, put_floats(writer, [1.0]))
    writer.wait_sealed(1, timeout=60)
    writer._proc.kill()
    with pytest.raises(WriterDied, match="checkpoint writer process ended"):
        writer.submit(2, put_floats(writer, [2.0]))
        writer.wait_sealed(2, timeout=60)


def test_the_writer_dies_with_its_trainer(tmp_path):
    script = (
        "import sys, time\n"
        "from checkpoint.writer import CheckpointWriter\n"
        f"w = CheckpointWriter({str(tmp_path / 'local')!r})\n"
        "print(w._proc.pid, flush=True)\n"
        "time.sleep(600)\n")
    trainer = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    writer_pid = int(trainer.stdout.readline())
    ended = os.pidfd_open(writer_pid)       # readable once the writer has exited
    try:
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        assert select.select([ended], [], [], 30)[0], "the writer outlived its trainer"
    finally:
        os.close(ended)


def test_write_files_in_process_gives_the_same_bytes_as_the_writer(writer, tmp_path):
    layout = put_floats(writer, [0.5, -1.5])
    writer.submit(1, layout)
    writer.wait_sealed(1, timeout=60)
    here = tmp_path / "here"
    write_files(here, layout, bytearray(struct.pack("<2f", 0.5, -1.5)))
    there = checkpoint_dir(tmp_path / "local", 1)
    for name in ("weights.safetensors", "state.json"):
        assert (here / name).read_bytes() == (there / name).read_bytes()


def test_the_writer_s_lines_are_models_and_a_malformed_one_is_refused():
    """Requests and replies are typed (pydantic): what one side writes the other reads back as the
    same model, and a line of neither shape fails to parse rather than being guessed at."""
    import pydantic

    from grpo_run.checkpoint.writer import _REPLY, _REQUEST, Close, Closed, Released, Write, _line

    write = Write(step=3, size=4096, files={"a.txt": {"text": "x"}})
    assert _REQUEST.validate_json(_line(write)) == write and _REQUEST.validate_json(_line(Close())) == Close()
    for reply in (Released(released=3), Sealed(sealed=3), Failed(failed=3, error="OSError: full", errno=28), Closed()):
        assert _REPLY.validate_json(_line(reply)) == reply
    with pytest.raises(pydantic.ValidationError):
        _REQUEST.validate_json('{"op": "checkpoint", "step": 3}')     # no size, no files
