"""bench/gpu_check.py runs here with --tiny (a CPU, a tiny config, two short steps), so the script
for the day a GPU is at hand does not rot: it trains, times the decoders and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_tiny_on_a_cpu_and_writes_one_json_file(tmp_path):
    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--tiny", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["tiny"] is True and report["estimateGpu"] == "H200" and report["device"] == "cpu"
    lora = report["lora"]
    assert lora["steps"] == 2 and lora["stepSeconds"] > 0 and 0 < lora["samplingShare"] <= 1
    assert lora["estimatedStepSeconds"] == report["estimate"]["stepSeconds"] > 0
    assert lora["measuredOverEstimated"] == round(lora["stepSeconds"] / lora["estimatedStepSeconds"], 3)
    assert lora["peakGB"] > 0 and lora["neededGB"] == report["estimate"]["neededGB"] > 0
    decoders = report["decoders"]
    assert decoders["default"]["tokensPerSecond"] > 0 and decoders["hfGenerate"]["tokensPerSecond"] > 0
    assert "skipped" in decoders["compileDecode"]
    vllm = report["vllm"]                  # the same job sampled by vLLM's CPU build (head_dim 64)
    assert vllm["engine"]["engine"] == "vllm" and vllm["steps"] == 2 and vllm["startSeconds"] > 0
    assert vllm["vllmOverNative"]["stepSeconds"] == round(vllm["stepSeconds"] / lora["stepSeconds"], 3)
    assert vllm["anchors"]["tokensPerSecondOverPublished"] > 0
    assert "stepSeconds" in report["qlora"] or "skipped" in report["qlora"]
    ahead = report["async"]                # staleness 1: the producer thread samples the next step
    assert ahead["engine"]["staleness"] == 1 and ahead["steps"] == 2 and ahead["stepSeconds"] > 0
    assert [s["staleness"] for s in ahead["perStep"]] == [0, 1]
    assert ahead["asyncOverSync"]["stepSeconds"] == round(ahead["stepSeconds"] / lora["stepSeconds"], 3)
    assert [p.name for p in tmp_path.iterdir()] == ["check.json"]          # nothing else left behind
