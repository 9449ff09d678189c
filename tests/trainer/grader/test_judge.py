"""LLM judges over HTTP (`rewards: [{judge: {url, model, prompt}}]`), against a real local
OpenAI-compatible server: `transformers serve` on the tiny model built here, offline, on
127.0.0.1. The tiny model's replies are digits and signs (its whole alphabet), the same for the
same message (greedy), so every reply has a first number: the tests check calls, limits and
failures, not what the judge thinks."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from grpo_run.runner.cli.commands import EXIT_OK, main
from grpo_run.runner.exits import EXIT_BUDGET
from grpo_run.trainer.envs.catalog import JudgeSettings
from grpo_run.trainer.grader.judge import (REPLY_SHOWN, Judge, JudgeError, JudgeUnavailable, call_usd, judge_message,
                                           quoted, reply_number)
from grpo_run.trainer.model.tinymodel import build_tiny_model


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`transformers serve FOLDER` on 127.0.0.1, its OpenAI-compatible API at `url`."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port = folder, _free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        serve = Path(sys.executable).parent / "transformers"
        self.proc = subprocess.Popen([str(serve), "serve", str(folder), "--host", "127.0.0.1", "--port", str(self.port),
                                      "--device", "cpu"], env={**os.environ, "HF_HUB_OFFLINE": "1"},
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"transformers serve exited with status {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1):
                    return
            except OSError:
                time.sleep(0.2)         # polling the port until it answers; nothing else to wait on
        self.stop()
        raise RuntimeError("transformers serve did not answer /health within 90 s")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp("judge") / "tiny")
    # a chat template the character-level tokenizer can render: the messages' contents
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    s = Server(folder)
    yield s
    s.stop()


def settings(server: Server, **overrides) -> JudgeSettings:
    base = dict(url=server.url, model=str(server.folder), prompt="{prompt}{completion}", low=0.0, high=10.0,
                timeout_s=5.0, retries=0, max_tokens=4)
    return JudgeSettings(**{**base, **overrides})


def test_the_message_fills_both_placeholders_once_and_the_reward_is_the_first_number_clipped():
    assert judge_message("Q: {prompt} A: {completion}", {"prompt": "say {completion}"}, "x {prompt}") == \
        "Q: say {completion} A: x {prompt}"
    chat = {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]}
    assert judge_message("{prompt}|{completion}", chat, "4") == "be brief\n2+2?|4"
    assert reply_number("Score: 8.5/10", 0, 10) == 8.5
    assert reply_number("-3 points", 0, 10) == 0 and reply_number("12", 0, 10) == 10
    assert reply_number("9" * 400, 0, 10) == 10                      # too long for a float: inf, clipped
    assert reply_number("excellent", 0, 10) is None


def test_what_an_error_quotes_of_a_server_hides_the_key_and_the_nodes_secrets(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secretvalue123")
    reply = '{"error": "bad key sk-abc", "auth": "Bearer sk-abc", "hf": "hf_secretvalue123"}' + "x" * 500
    text = quoted(reply, "sk-abc")
    assert "sk-abc" not in text and "hf_secretvalue123" not in text and "[redacted apiKeyEnv]" in text
    assert len(text) == REPLY_SHOWN


def test_a_judge_scores_each_completion_with_one_call_and_counts_them(server):
    judge = Judge("quality", settings(server), calls=3)          # 3: an earlier attempt's
    tasks = [{"prompt": "1+2="}, {"prompt": [{"role": "user", "content": "4+4="}]}]
    scores = judge.score(["3", "8"], tasks)
    assert len(scores) == 2 and all(0.0 <= s <= 10.0 for s in scores)
    assert judge.score(["3", "8"], tasks) == scores                 # greedy: the same reply, the same number
    assert judge.calls == 7
    several = Judge("quality", settings(server, concurrency=3))
    completions = ["3", "8", "12", "5", "7"]
    assert several.score(completions, tasks * 3) == [judge.score([c], [t])[0] for c, t in zip(completions, tasks * 3)]
    assert several.calls == 5


def test_a_judge_whose_server_stops_answering_is_retried_then_unavailable(server):
    waits: list[float] = []
    judge = Judge("quality", settings(server, timeout_s=0.5, retries=2), sleep=waits.append)
    judge.score(["3"], [{"prompt": "1+2="}])
    server.proc.send_signal(signal.SIGSTOP)                          # accepts connections, never replies
    try:
        with pytest.raises(JudgeUnavailable, match=r"did not answer on all 3 tries \(retries=2, timeoutSeconds=0.5\)"):
            judge.score(["3"], [{"prompt": "1+2="}])
    finally:
        server.proc.send_signal(signal.SIGCONT)
    assert len(waits) == 2 and judge.calls == 1                      # unanswered tries are not calls


def test_the_call_budget_is_checked_before_a_batch_and_a_missing_key_is_refused(server, monkeypatch):
    judge = Judge("quality", settings(server, max_calls=3), calls=2)
    with pytest.raises(JudgeError, match="maxCalls 3 reached: 2 calls made, the next 2 completions need 1 more"):
        judge.score(["3", "8"], [{"prompt": "1+2="}] * 2)
    assert judge.calls == 2
    monkeypatch.delenv("JUDGE_TEST_KEY", raising=False)
    with pytest.raises(JudgeError, match="apiKeyEnv JUDGE_TEST_KEY is not set in this node's environment"):
        Judge("quality", settings(server, api_key_env="JUDGE_TEST_KEY"))


def test_a_judge_prices_its_calls_per_call_and_per_token_from_the_replies_usage(server):
    priced = settings(server, usd_per_call=0.01, usd_per_mtok=(1e6, 2e6))     # $1 an input token, $2 an output one
    judge = Judge("quality", priced, calls=1, usd=0.5)                         # 0.5: an earlier attempt's
    tasks = [{"prompt": "1+2="}, {"prompt": "4+4="}]
    judge.score(["3", "8"], tasks)
    usage = []
    for completion, task in zip(["3", "8"], tasks):                           # the same calls, asked directly
        body = json.dumps({"model": str(server.folder), "temperature": 0, "max_tokens": 4, "messages": [
            {"role": "user", "content": judge_message("{prompt}{completion}", task, completion)}]}).encode()
        request = urllib.request.Request(server.url + "/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            usage.append(json.loads(response.read())["usage"])
    assert all(u["prompt_tokens"] > 0 and u["completion_tokens"] > 0 for u in usage)
    expected = 0.5 + 2 * 0.01 + sum(u["prompt_tokens"] + 2 * u["completion_tokens"] for u in usage)
    assert judge.calls == 3 and judge.usd == pytest.approx(expected) and judge.priced
    assert not Judge("free", settings(server)).priced

    reply = {"choices": [{"message": {"content": "7"}}]}                      # a server that reports no usage
    assert call_usd(settings(server, usd_per_call=0.25), reply) == 0.25
    assert call_usd(priced, reply) is None
    assert call_usd(priced, {**reply, "usage": {"prompt_tokens": 3, "completion_tokens": None}}) is None
    assert call_usd(priced, {**reply, "usage": {"prompt_tokens": 3, "completion_tokens": 1}}) == pytest.approx(5.01)


def write_job(folder: Path, server: Server, params: dict | None = None, max_cost_usd: float | None = None,
              **judge) -> str:
    (folder / "train.jsonl").write_text("".join(f'{{"prompt": "{a}+{b}="}}\n' for a in range(4) for b in range(4)))
    (folder / "eval.jsonl").write_text('{"prompt": "7+8="}\n{"prompt": "9+9="}\n')
    spec = {"runtime": "grpo-lora", "model": "tiny:char",
            "environment": {"name": "judged", "tasks": "train.jsonl", "evalTasks": "eval.jsonl",
                            "rewards": [{"judge": {"url": server.url, "model": str(server.folder),
                                                   "prompt": "{prompt}{completion}", "maxTokens": 4,
                                                   "apiKeyEnv": "JUDGE_TEST_KEY", **judge}}]},
            "parameters": {"numGenerations": 2, "promptsPerStep": 2, "maxCompletionLength": 4, "maxSteps": 2,
                           "saveSteps": 2, "learningRate": 0.002, **(params or {})},
            **({"maxCostUSD": max_cost_usd} if max_cost_usd is not None else {})}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "grpo-run/v1", "kind": "TrainingJob",
                                    "metadata": {"name": "judged"}, "spec": spec}))
    return str(path)


def status_of(capsys) -> dict:
    capsys.readouterr()
    assert main(["get", "tj", "judged", "-o", "json"]) == EXIT_OK
    return json.loads(capsys.readouterr().out)["status"]


def test_a_job_with_a_judge_trains_counts_its_calls_and_needs_the_node_to_allow_it(tmp_path, server, capsys,
                                                                                   monkeypatch):
    job = write_job(tmp_path, server)
    monkeypatch.setenv("JUDGE_TEST_KEY", "not-a-real-key")
    assert main(["apply", "-f", job]) != EXIT_OK                      # GRPO_RUN_ALLOW_JUDGES unset
    assert "set GRPO_RUN_ALLOW_JUDGES=1 where grpo-run runs" in capsys.readouterr().err

    monkeypatch.setenv("GRPO_RUN_ALLOW_JUDGES", "1")
    monkeypatch.setenv("GRPO_RUN_JUDGE_KEYS", "JUDGE_TEST_KEY")   # the node lets the judge send it
    assert main(["apply", "-f", job]) == EXIT_OK
    status = status_of(capsys)
    assert status["phase"] == "Succeeded" and status["step"] == 2
    # 2 held-out tasks in the baseline and in the final evaluation, 2 prompts x 2 completions a step
    assert status["judgeCalls"] == {"judge": 2 + 2 * 4 + 2}
    assert status["lastStep"]["judgeCalls"] == {"judge": 4}
    for rewards in (status["lastStep"]["rewards"], status["baseline"]["rewards"], status["final"]["rewards"]):
        assert 0.0 <= rewards["judge"] <= 10.0 and math.isfinite(rewards["judge"])

    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+2=", "completion": "3"}\n')
    assert main(["score", "-f", job, "--completions", str(tmp_path / "rows.jsonl"), "-o", "json"]) == EXIT_OK
    [scored] = json.loads(capsys.readouterr().out)
    expected = Judge("judge", settings(server)).score(["3"], [{"prompt": "1+2="}])[0]
    assert scored == {"rewards": {"judge": expected}, "total": expected}


def test_a_judge_that_does_not_answer_fails_the_run_as_infrastructure_never_a_zero(tmp_path, server, capsys,
                                                                                  monkeypatch):
    monkeypatch.setenv("GRPO_RUN_ALLOW_JUDGES", "1")
    monkeypatch.setenv("GRPO_RUN_JUDGE_KEYS", "JUDGE_TEST_KEY")   # the node lets the judge send it
    monkeypatch.setenv("JUDGE_TEST_KEY", "not-a-real-key")
    job = write_job(tmp_path, server, timeoutSeconds=0.5, retries=1)
    server.proc.send_signal(signal.SIGSTOP)
    try:
        assert main(["apply", "-f", job]) != EXIT_OK
    finally:
        server.proc.send_signal(signal.SIGCONT)
    status = status_of(capsys)
    assert status["phase"] == "Failed" and status["step"] == 0
    assert status["message"].startswith("infrastructure failure: judge 'judge'")
    assert "did not answer on all 2 tries" in status["message"]
    assert "baseline" not in status and status["judgeCalls"] == {"judge": 0}   # nothing scored, no 0 recorded


def test_the_run_fails_when_its_call_budget_is_spent_and_a_resume_counts_on(tmp_path, server, capsys, monkeypatch):
    monkeypatch.setenv("GRPO_RUN_ALLOW_JUDGES", "1")
    monkeypatch.setenv("GRPO_RUN_JUDGE_KEYS", "JUDGE_TEST_KEY")   # the node lets the judge send it
    monkeypatch.setenv("JUDGE_TEST_KEY", "not-a-real-key")
    assert main(["apply", "-f", write_job(tmp_path, server, maxCalls=5)]) != EXIT_OK
    status = status_of(capsys)
    assert status["phase"] == "Failed" and status["step"] == 0 and status["judgeCalls"] == {"judge": 2}
    assert "maxCalls 5 reached: 2 calls made, the next 4 completions need 1 more" in status["message"]
    # resumed, the baseline is reused and the trainer counts on from the run's 2: the budget still holds
    assert main(["resume", "judged"]) != EXIT_OK
    status = status_of(capsys)
    assert status["baseline"]["runs"] == 1 and status["judgeCalls"] == {"judge": 2} and status["step"] == 0
    assert "maxCalls 5 reached: 2 calls made" in status["message"] and len(status["attempts"]) == 2


def test_priced_judge_calls_are_the_run_s_cost_and_maxCostUSD_stops_the_run_before_they_pass_it(
        tmp_path, server, capsys, monkeypatch):
    monkeypatch.setenv("GRPO_RUN_ALLOW_JUDGES", "1")
    monkeypatch.setenv("GRPO_RUN_JUDGE_KEYS", "JUDGE_TEST_KEY")   # the node lets the judge send it
    monkeypatch.setenv("JUDGE_TEST_KEY", "not-a-real-key")
    # no GPU rate: the judge's calls are the whole cost. The baseline's 2 calls ($0.02) and step 1's
    # 4 ($0.06 in all) fit $0.07; step 2 would end at $0.10: the run stops after step 1.
    job = write_job(tmp_path, server, params={"maxSteps": 4}, max_cost_usd=0.07, usdPerCall=0.01)
    assert main(["apply", "-f", job]) == EXIT_BUDGET
    status = status_of(capsys)
    assert status["phase"] == "BudgetExceeded" and status["step"] == 1
    assert status["judgeCalls"] == {"judge": 6} and status["judgeCostUSD"] == {"judge": 0.06}
    assert status["costUSD"] == 0.06 and status["lastStep"]["costUSD"] == 0.06
    assert "spent $0.0600 of maxCostUSD $0.07" in status["message"]
    # applied again with a larger budget: the run goes on from step 1 and counts on from $0.06
    assert main(["apply", "-f", write_job(tmp_path, server, params={"maxSteps": 4}, max_cost_usd=1.0,
                                          usdPerCall=0.01)]) == EXIT_OK
    status = status_of(capsys)
    assert status["phase"] == "Succeeded" and status["step"] == 4 and status["baseline"]["runs"] == 1
    assert status["judgeCalls"] == {"judge": 2 + 4 * 4 + 2} and status["costUSD"] == 0.2


def test_the_baseline_fingerprint_covers_the_judge_but_not_its_key_or_limits(tmp_path, server):
    from grpo_run.runner.books.fingerprint import baseline_fingerprint
    from grpo_run.runner.environments import build_environment
    from grpo_run.runner.spec.job import load_job

    def fingerprint(**judge) -> str:
        job = load_job(write_job(tmp_path, server, **judge))
        return baseline_fingerprint("tiny:char", build_environment(job), job.parameters)

    before = fingerprint()
    assert fingerprint(apiKeyEnv="OTHER_KEY", maxCalls=9, retries=5, timeoutSeconds=3) == before
    assert fingerprint(prompt="Rate {completion}") != before
    assert fingerprint(model="another") != before
    assert fingerprint(url="http://127.0.0.1:1/v1") != before


def test_the_preflight_refuses_a_judge_here_unless_allowed_and_notes_it_for_another_node(tmp_path, server,
                                                                                        monkeypatch):
    from grpo_run.runner.jobs.preflight import preflight
    from grpo_run.runner.spec.job import load_job

    job = load_job(write_job(tmp_path, server))
    monkeypatch.delenv("GRPO_RUN_ALLOW_JUDGES", raising=False)
    assert [p for p in preflight(job, mode="apply").problems if "judge" in p] == [
        f"spec.environment.rewards.0.judge: this node does not allow LLM judges (the trainer would call {server.url}): "
        "set GRPO_RUN_ALLOW_JUDGES=1 where grpo-run runs to allow it",
        "spec.environment.rewards.0.judge.apiKeyEnv: this node does not let a judge send its variable JUDGE_TEST_KEY "
        "(it lets: none): add JUDGE_TEST_KEY to GRPO_RUN_JUDGE_KEYS (NAME,NAME) where grpo-run runs, and give that "
        "variable only the judge's key"]
    assert any("the node that runs this job needs GRPO_RUN_ALLOW_JUDGES=1" in n
               for n in preflight(job, mode="dry-run").notes)
    monkeypatch.setenv("GRPO_RUN_ALLOW_JUDGES", "1")
    monkeypatch.setenv("GRPO_RUN_JUDGE_KEYS", "JUDGE_TEST_KEY")   # the node lets the judge send it
    found = preflight(job, mode="apply")
    assert not [p for p in found.problems if "judge" in p] and not [n for n in found.notes if "judge" in n]


def test_a_node_without_the_allow_leaves_a_submitted_judge_job_pending(tmp_path, server, capsys, monkeypatch):
    monkeypatch.delenv("GRPO_RUN_ALLOW_JUDGES", raising=False)
    job = write_job(tmp_path, server)
    doc = yaml.safe_load(Path(job).read_text())
    doc["spec"]["storage"] = str(tmp_path / "store")
    Path(job).write_text(yaml.safe_dump(doc))
    assert main(["apply", "-f", job, "--detach"]) == EXIT_OK
    assert "the node that runs this job needs GRPO_RUN_ALLOW_JUDGES=1" in capsys.readouterr().err
    assert main(["resume", "judged", "--storage", str(tmp_path / "store")]) != EXIT_OK
    assert "this node does not allow LLM judges" in capsys.readouterr().err
    assert main(["get", "tj", "judged", "--storage", str(tmp_path / "store"), "-o", "json"]) == EXIT_OK
    status = json.loads(capsys.readouterr().out)["status"]
    assert status["phase"] == "Pending" and status["attempts"] == []
