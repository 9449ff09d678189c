"""A reward function is untrusted code (it may have been planted through the bucket): it takes
nothing of the node's. It finds none of the trainer's credentials in its environment or its files,
reaches no socket but its own socketpairs, cannot signal the run's processes, and whatever text of
its leaves the sandbox scrubbed of the trainer's secrets and capped. Every test runs with strict=True
(all layers in force) unless it is about a layer alone."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from grpo_run.trainer.envs.catalog import Reward
from grpo_run.trainer.grader import landlock
from grpo_run.trainer.grader.grader import MAX_ABS_REWARD, Grader, RewardFunctionError
from grpo_run.trainer.grader.reach import node_places, why_not
from grpo_run.trainer.grader.redact import StreamScrubber, cap, scrub
from grpo_run.trainer.grader.scoring import Scorer
from tests.nonamespaces import without_namespaces

pytestmark = pytest.mark.trust
SECRET = "FAKE-NODE-SECRET-1234567890"  # what the trainer's environment holds, and the files below
CREDENTIALS = {
    "AWS_SECRET_ACCESS_KEY": SECRET,
    "AWS_ACCESS_KEY_ID": "AKIAFAKEFAKEFAKE",
    "HF_TOKEN": "hf_fakefakefakefake",
    "WANDB_API_KEY": "fake-wandb-key-0000",
    "MLFLOW_TRACKING_TOKEN": "fake-mlflow-token",
    "GRPO_RUN_PARENT_PID": "12345",
}

REWARDS = '''
import ctypes, errno, json, os, signal, socket, struct, subprocess, sys

NOT_FOUND, REFUSED, READ = 2.0, 0.0, 1.0

def credentials_in_environment(completion, task):
    return float(sum(name in os.environ or value in repr(os.environ) for name, value in task["env"].items()))

def environment(completion, task):
    return float(os.environ.get(task["name"]) == task["value"])

def reads(completion, task):
    """READ when the file's text came back; the sandbox's refusal ends the reward function."""
    path = task["path"] if "path" in task else f"/proc/{os.getppid()}/environ"
    try:
        text = open(path, "rb").read()
    except FileNotFoundError:
        return NOT_FOUND
    return READ if task.get("expect", "").encode() in text else 3.0

def reads_with_a_program(completion, task):
    done = subprocess.run(["cat", task["path"]], capture_output=True)
    if done.returncode == 0:
        return READ
    return REFUSED if b"Permission denied" in done.stderr else NOT_FOUND

def reads_a_neighbour(completion, task):
    import neighbour  # a module next to this file
    with open(os.path.join(os.path.dirname(__file__), "data.txt")) as f:
        return float(f.read()) + neighbour.BONUS

def c_connect(completion, task):
    """socket() and connect() through libc, past Python's refusals: 0 once connected (or on its
    way), else the errno of the step that failed."""
    libc = ctypes.CDLL(None, use_errno=True)
    family = socket.AF_UNIX if "path" in task else socket.AF_INET
    fd = libc.socket(family, socket.SOCK_STREAM | socket.SOCK_NONBLOCK, 0)
    if fd < 0:
        return float(ctypes.get_errno())
    if family == socket.AF_UNIX:
        address = struct.pack("H", family) + task["path"].encode().ljust(108, b"\\0")
    else:
        address = struct.pack("H", family) + struct.pack(">H", task["port"]) + socket.inet_aton(task["host"]) + bytes(8)
    code = 0 if libc.connect(fd, address, len(address)) == 0 else ctypes.get_errno()
    if code == errno.EINPROGRESS:
        code = 0  # a SYN went out
    else:
        libc.send(fd, b"LEAK", 4, 0)
    os.close(fd)
    return float(code)

def dgram_socketpair(completion, task):
    try:
        socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    except PermissionError as error:
        return float(error.errno)
    return 0.0

def stream_socketpair(completion, task):
    a, b = socket.socketpair()
    a.sendall(b"ping")
    return float(b.recv(4) == b"ping")

def signals(completion, task):
    """1.0 when SIGTERM reached the target, 0.0 when refused, -1.0 when it has no pid in here."""
    pid = os.getppid() if task["target"] == "parent" else task["pid"]
    if pid == 0:
        return -1.0  # a PID namespace: the parent is outside it
    if task.get("with") == "a program":
        return float(subprocess.run(["sh", "-c", f"kill -TERM {pid}"], capture_output=True).returncode == 0)
    try:
        os.kill(pid, signal.SIGTERM)
    except (PermissionError, ProcessLookupError):
        return 0.0
    return 1.0

def raises_the_secret(completion, task):
    print("printing", task["secret"], flush=True)
    os.write(1, task["secret"][:6].encode())
    os.write(1, task["secret"][6:].encode() + b" written in two pieces\\n")
    raise RuntimeError(f"the key is {task['secret']}")

def raises_a_long_chain(completion, task):
    error = None
    for i in range(15):
        try:
            raise ValueError(f"{i} " + "x" * 900) from error
        except ValueError as caught:
            error = caught
    raise error

def returns(completion, task):
    return task["value"]

def forges_a_reply(completion, task):
    config = json.loads(sys.argv[1])  # the worker's argv names the response pipe
    payload = task["payload"].encode()
    os.write(config["response_fd"], struct.pack(">I", len(payload)) + payload)
    os._exit(0)
'''


@pytest.fixture
def rewards_file(tmp_path: Path) -> Path:
    """The rewards, alone in a folder of their own: tmp_path holds the secrets the tests plant."""
    folder = tmp_path / "reward"
    folder.mkdir()
    path = folder / "rewards.py"
    path.write_text(REWARDS)
    return path


@pytest.fixture
def node(tmp_path: Path, monkeypatch) -> dict[str, Path]:
    """A node's secrets: credentials in the trainer's environment, a home folder with AWS and
    Hugging Face credentials, a work folder whose plan.json holds the eval answers."""
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    home = tmp_path / "home"
    (home / ".aws").mkdir(parents=True)
    (home / ".aws" / "credentials").write_text(f"[default]\naws_secret_access_key = {SECRET}\n")
    (home / ".cache" / "huggingface").mkdir(parents=True)
    (home / ".cache" / "huggingface" / "token").write_text(SECRET)
    monkeypatch.setenv("HOME", str(home))
    work = tmp_path / "work"
    work.mkdir()
    (work / "plan.json").write_text(json.dumps({"evalAnswers": [SECRET]}))
    return {"aws": home / ".aws" / "credentials", "hf": home / ".cache" / "huggingface" / "token",
            "plan": work / "plan.json", "home": home}


def grader_for(rewards_file: Path, name: str, **settings) -> Grader:
    settings.setdefault("retries", 0)
    settings.setdefault("retry_wait_s", 0)
    settings.setdefault("strict", True)
    return Grader(f"{rewards_file}:{name}", **settings)


def failure_of(grader: Grader, tasks=({},)) -> RewardFunctionError:
    with pytest.raises(RewardFunctionError) as raised:
        grader.score(["x"] * len(tasks), list(tasks))
    return raised.value


# environment ----------------------------------------------------------------------------------


def test_the_trainers_credentials_are_not_in_the_reward_functions_environment(rewards_file, node, figures):
    with grader_for(rewards_file, "credentials_in_environment") as grader:
        assert grader.score(["x"], [{"env": CREDENTIALS}]) == [0.0]
    reward_author(figures, "read the trainer's AWS, HF, W&B, MLflow keys from its environment",
                  "an allow-listed environment", "none of them there")


def test_the_reward_function_gets_a_scratch_home_and_one_thread_per_library(rewards_file, node):
    with grader_for(rewards_file, "environment") as grader:
        tasks = [{"name": "HOME", "value": os.environ["HOME"]}, {"name": "OMP_NUM_THREADS", "value": "1"},
                 {"name": "PATH", "value": os.environ["PATH"]}]
        assert grader.score(["x"] * 3, tasks) == [0.0, 1.0, 1.0]  # HOME is not the node's


def reward_author(figures, tried: str, protection: str, outcome: str) -> None:
    """A line of docs/reliability.md's trust section (written only by scripts/reliability)."""
    figures.add("trust", actor="reward author", tried=tried, protection=protection, outcome=outcome, held=True)


# files ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("secret", ["aws", "hf", "plan"])
def test_the_nodes_credential_files_and_the_eval_answers_cannot_be_read(rewards_file, node, secret, figures):
    task = {"path": str(node[secret]), "expect": SECRET}
    with grader_for(rewards_file, "reads") as grader, grader_for(rewards_file, "reads_with_a_program") as program:
        assert grader.sandbox_mode["filesystem"] == "landlock"
        assert program.score(["x"], [task]) == [0.0]  # Landlock: `cat` is past Python's hook
        error = failure_of(grader, [task])
    # Python's own reads are refused before Landlock would, saying what and why, and not retried
    assert error.kind == "refused" and f"reading {str(node[secret])!r} was refused" in str(error)
    reward_author(figures, {"aws": "read ~/.aws/credentials", "hf": "read the Hugging Face token",
                            "plan": "read plan.json (the evaluation answers)"}[secret],
                  "Landlock: reads of its own folder, Python and its scratch only", "refused, from Python and from `cat`")


def test_the_trainers_proc_environ_and_root_only_files_cannot_be_read(rewards_file, node, figures):
    with grader_for(rewards_file, "reads_with_a_program") as program:
        paths = [f"/proc/{os.getpid()}/environ", "/etc/shadow"]
        # in a PID namespace of its own the trainer has no pid at all: not found, or else refused
        not_there = 2.0 if program.sandbox_limits.get("contained") else 0.0
        assert program.score(["x"] * 2, [{"path": p} for p in paths]) == [not_there, 0.0]
    with grader_for(rewards_file, "reads") as grader:
        assert failure_of(grader, [{"expect": SECRET}]).kind == "refused"  # /proc/<its parent>/environ
    reward_author(figures, "read the trainer's /proc/PID/environ and /etc/shadow", "Landlock", "refused")


def test_a_reward_in_the_home_folder_is_given_its_own_file_not_the_folder(tmp_path, node):
    module = node["home"] / "reward.py"
    module.write_text("def reward(completion, task):\n    return len(open(task['path']).read())\n")
    with Grader(f"{module}:reward", strict=True, retries=0) as grader:
        assert grader.score(["x"], [{"path": str(module)}]) == [float(len(module.read_text()))]
        with pytest.raises(RewardFunctionError, match="was refused"):
            grader.score(["x"], [{"path": str(node["aws"])}])


def test_the_reward_reads_its_own_folder_and_imports_its_neighbours(rewards_file, node):
    (rewards_file.parent / "neighbour.py").write_text("BONUS = 0.5\n")
    (rewards_file.parent / "data.txt").write_text("2")
    with grader_for(rewards_file, "reads_a_neighbour") as grader:
        assert grader.score(["x"], [{}]) == [2.5]


@pytest.mark.parametrize("ref", ["grpo_run.trainer.envs.rewards:math_correct",
                                 "grpo_run.trainer.envs.catalog:arithmetic_reward"])
def test_the_catalogs_rewards_run_in_the_strict_sandbox(ref, node):
    task = {"answer": "#### 72"} if ref.endswith("math_correct") else {"answer": "72"}
    with Grader(ref, strict=True, retries=0) as grader:
        assert grader.score(["so \\boxed{72}" if "math" in ref else "72"], [task]) == [1.0]


def test_the_scorer_says_which_layers_are_in_force_for_the_trainers_events(node):
    rewards = [Reward("correct", "grpo_run.trainer.envs.rewards:math_correct"),
               Reward("format", "grpo_run.trainer.envs.rewards:boxed_format", 0.2)]
    with Scorer(rewards, strict=True) as scorer:
        mode = scorer.sandbox_mode
    assert mode["network"] == "netns" and mode["filesystem"] == "landlock" and mode["seccomp"] == "on"
    assert mode["signals"] in ("landlock", "pidns")


# sockets --------------------------------------------------------------------------------------


@pytest.fixture
def unix_listener():
    folder = tempfile.mkdtemp(prefix="gs-")  # short: a unix socket's path has 108 bytes
    path = os.path.join(folder, "listen.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    listener.setblocking(False)
    yield listener, path
    listener.close()
    os.unlink(path)
    os.rmdir(folder)


@pytest.mark.parametrize("network", ["auto", "python"])
def test_no_socket_is_reachable_below_python_with_or_without_a_network_namespace(rewards_file, node, unix_listener,
                                                                                  network, figures):
    listener, path = unix_listener
    local = socket.create_server(("127.0.0.1", 0))
    local.setblocking(False)
    targets = [{"path": path}, {"host": "127.0.0.1", "port": local.getsockname()[1]},
               {"host": "169.254.169.254", "port": 80}]
    with local, grader_for(rewards_file, "c_connect", network=network, strict=network == "auto") as grader:
        assert grader.sandbox_mode["network"] == ("netns" if network == "auto" else "python")
        assert grader.sandbox_mode["seccomp"] == "on"
        # seccomp refuses socket() itself: the errno is EPERM, not a namespace's "unreachable"
        assert grader.score(["x"] * 3, targets) == [float(errno.EPERM)] * 3
        for server in (listener, local):
            with pytest.raises(BlockingIOError):
                server.accept()  # nobody ever connected
    reward_author(figures, f"connect with ctypes to a unix socket, 127.0.0.1 and 169.254.169.254 (network: {network})",
                  "seccomp: socket() denied but socketpair", "EPERM on each; nobody connected")


def test_stream_socketpairs_work_and_datagram_ones_are_refused(rewards_file, node):
    with grader_for(rewards_file, "stream_socketpair") as grader:
        assert grader.score(["x"], [{}]) == [1.0]  # multiprocessing.Pipe
    with grader_for(rewards_file, "dgram_socketpair") as grader:
        assert grader.score(["x"], [{}]) == [float(errno.EPERM)]  # sendto() on one reaches any path


# signals --------------------------------------------------------------------------------------


@pytest.mark.parametrize("signals", ["auto", "pidns"])
@pytest.mark.parametrize("how", ["os.kill", "a program"])
def test_the_reward_cannot_signal_the_trainer_or_the_supervisor(rewards_file, node, signals, how, figures):
    got: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    supervisor = subprocess.Popen(["sleep", "60"])
    try:
        with grader_for(rewards_file, "signals", signals=signals) as grader:
            assert grader.sandbox_mode["signals"] in (("landlock", "pidns") if signals == "auto" else ("pidns",))
            tasks = [{"target": "parent", "with": how}, {"target": "trainer", "pid": os.getpid(), "with": how},
                     {"target": "supervisor", "pid": supervisor.pid, "with": how}]
            parent, trainer, supervised = grader.score(["x"] * 3, tasks)
        assert (trainer, supervised) == (0.0, 0.0)
        assert parent == (-1.0 if grader.sandbox_limits.get("contained") else 0.0)    # outside its PID namespace
        assert supervisor.poll() is None and got == []
        reward_author(figures, f"SIGTERM the trainer and the supervisor with {how} (signals: {signals})",
                      f"{grader.sandbox_mode['signals']} (a PID namespace or Landlock's scope)", "no signal arrived")
    finally:
        signal.signal(signal.SIGTERM, previous)
        supervisor.kill()
        supervisor.wait()


# text that leaves the sandbox -----------------------------------------------------------------


def test_a_secret_in_a_reward_functions_error_and_output_comes_back_redacted(rewards_file, node, capfd, figures):
    with grader_for(rewards_file, "raises_the_secret") as grader:
        error = failure_of(grader, [{"secret": SECRET}])
    message = str(error)
    assert "RuntimeError: the key is [redacted $AWS_SECRET_ACCESS_KEY]" in message and SECRET not in message
    err = capfd.readouterr().err
    assert "printing [redacted $AWS_SECRET_ACCESS_KEY]" in err
    assert "[redacted $AWS_SECRET_ACCESS_KEY] written in two pieces" in err and SECRET not in err
    reward_author(figures, "raise and print a secret it was handed, for the record and the logs",
                  "secret values scrubbed from every text leaving the sandbox", "[redacted $AWS_SECRET_ACCESS_KEY]")


def test_a_long_error_is_capped_saying_so(rewards_file, node):
    with grader_for(rewards_file, "raises_a_long_chain") as grader:
        message = str(failure_of(grader))
    assert "characters cut" in message and len(message) < 5_000
    assert "ValueError: 0 xxx" in message and "ValueError: 14 xxx" in message  # its head and its tail


def test_scrubbing_catches_a_secret_split_across_chunks_and_leaves_short_values():
    environ = {"AWS_SECRET_ACCESS_KEY": SECRET, "MY_API_KEY": "k" * 12, "PIN_TOKEN": "1234567", "PATH": "/usr/bin"}
    text = f"a {SECRET} b {'k' * 12} c 1234567 /usr/bin".encode()
    for cut in range(1, len(text)):
        scrubber = StreamScrubber(environ)
        out = scrubber.feed(text[:cut]) + scrubber.feed(text[cut:]) + scrubber.flush()
        assert out == b"a [redacted $AWS_SECRET_ACCESS_KEY] b [redacted $MY_API_KEY] c 1234567 /usr/bin"
    assert scrub(f"x{SECRET}x", environ) == "x[redacted $AWS_SECRET_ACCESS_KEY]x"
    assert cap("y" * 10, 4) == "yy\n[... 6 characters cut: text from the reward function's sandbox is capped at 4 ...]\nyy"


def test_whole_lines_of_output_pass_at_once():
    scrubber = StreamScrubber({"HF_TOKEN": SECRET})
    assert scrubber.feed(b"line one\nline tw") == b"line one\n"
    assert scrubber.feed(b"o\n") == b"line two\n"


# rewards that cannot be training data ---------------------------------------------------------


@pytest.mark.parametrize("value", [1e7, -1e39, float("inf")])
def test_a_reward_past_the_bound_is_the_reward_functions_error(rewards_file, node, value, figures):
    with grader_for(rewards_file, "returns") as grader:
        assert grader.score(["x"], [{"value": MAX_ABS_REWARD}]) == [MAX_ABS_REWARD]
        message = str(failure_of(grader, [{"value": value}]))
    assert f"returns returned {value!r}; a reward must be a finite number within ±1e+06" in message
    reward_author(figures, f"return {value!r}", "the parent checks every reward: finite, within ±1e6",
                  "the reward function's error, never a score")


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        ('{"ok": NaN}', "returned nan; a reward must be a finite number within ±1e+06"),
        ('{"ok": Infinity}', "returned inf"),
        ('{"ok": 1e39}', "returned 1e+39"),
        ('{"ok": 1' + "0" * 400 + "}", "returned inf"),
        ('{"ok": "1.0"}', "sent the grader a reply it cannot read"),
        ('{"ok": true}', "sent the grader a reply it cannot read"),
        ('{"kind": "exception"}', "sent the grader a reply it cannot read"),
        ("[1, 2]", "exited with code 0"),
        ("[" * 100_000, "exited with code 0"),
    ],
)
def test_a_reply_the_reward_function_forges_is_checked_like_any_other(rewards_file, node, payload, says, figures):
    with grader_for(rewards_file, "forges_a_reply") as grader:
        error = failure_of(grader, [{"payload": payload}])
    assert says in str(error)
    reward_author(figures, f"forge its own reply frame: {payload[:24]}{'...' if len(payload) > 24 else ''}",
                  "the parent reads every reply as untrusted", "the reward function's error, never a score")


# strict ---------------------------------------------------------------------------------------

# A node like a container under Docker's default seccomp profile: unshare() is refused, so there is
# no user namespace and no network namespace.
WITHOUT_NAMESPACES = without_namespaces('''
    import json, sys
    from grpo_run.trainer.grader.grader import Grader, SandboxUnavailable
    try:
        grader = Grader(sys.argv[1], strict=sys.argv[2] == "strict", retries=0)
    except SandboxUnavailable as error:
        print(json.dumps({"missing": list(error.missing), "message": str(error)}))
    else:
        print(json.dumps({"mode": grader.sandbox_mode, "score": grader.score(["x"], [{}])}))
        grader.close()
''')


@pytest.mark.parametrize("strict", ["strict", "lenient"])
def test_strict_refuses_a_node_without_namespaces_naming_the_fix_and_never_runs_the_reward(tmp_path, strict, figures):
    module = tmp_path / "reward.py"
    module.write_text("import sys\nprint('IMPORTED', file=sys.stderr)\ndef reward(completion, task):\n    return 1.0\n")
    done = subprocess.run([sys.executable, "-c", WITHOUT_NAMESPACES, f"{module}:reward", strict],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    # Without unshare() there is no PID namespace either: signals need Landlock's scope (Linux 6.12)
    scoped = landlock.abi()[0] >= landlock.SCOPE_ABI
    if strict == "strict":
        assert result["missing"] == ["network"] + ([] if scoped else ["signals"]) and "IMPORTED" not in done.stderr
        assert "unshare(CLONE_NEWUSER|CLONE_NEWNET): Operation not permitted" in result["message"]
        assert "allow user namespaces" in result["message"] and "strict=True" in result["message"]
        figures.add("trust", actor="ordinary failure", tried="a node that refuses user namespaces (Docker's seccomp)",
                    protection="strict sandbox", outcome="the reward is never run; the missing layer and its fix named",
                    held=True)
    else:  # runs, and says so; seccomp still keeps it off the network
        assert result == {"mode": {"network": "python", "filesystem": "landlock",
                                   "signals": "landlock" if scoped else "none", "seccomp": "on"}, "score": [1.0]}
        assert "cannot keep reward function" in done.stderr


def test_strict_cannot_be_combined_with_a_layer_turned_off(rewards_file):
    with pytest.raises(ValueError, match="strict: cannot be combined with network='python'"):
        grader_for(rewards_file, "returns", network="python", strict=True)


# what a job may name for the reward to read (environment.path) ---------------------------------


@pytest.mark.parametrize("given", ["~/.aws", "GRPO_RUN_HOME/runs"])
def test_a_search_path_naming_the_nodes_folders_gives_the_reward_none_of_them(rewards_file, node, tmp_path,
                                                                            monkeypatch, given, figures):
    """What a job file's or a stored spec's `environment.path` once opened (review N2): the
    folder is left out of the reward's reach, and its files stay unread."""
    runs = tmp_path / "grpo-home" / "runs"
    (runs / "other-job").mkdir(parents=True)
    (runs / "other-job" / "plan.json").write_text(json.dumps({"evalAnswers": [SECRET]}))
    monkeypatch.setenv("GRPO_RUN_HOME", str(tmp_path / "grpo-home"))
    folder = {"~/.aws": node["aws"].parent, "GRPO_RUN_HOME/runs": runs}[given]
    secret = {"~/.aws": node["aws"], "GRPO_RUN_HOME/runs": runs / "other-job" / "plan.json"}[given]
    task = {"path": str(secret), "expect": SECRET}
    with grader_for(rewards_file, "reads_with_a_program", search_path=[str(folder)]) as program:
        assert program.score(["x"], [task]) == [0.0]
    with grader_for(rewards_file, "reads", search_path=[str(folder)]) as grader:
        error = failure_of(grader, [task])
    assert error.kind == "refused" and "was refused" in str(error) and SECRET not in str(error)
    reward_author(figures, f"read {given} through environment.path", "the grader never grants the node's folders",
                  "refused, from Python and from `cat`")


def test_a_reward_file_in_tmp_is_given_its_own_file_not_tmp(figures):
    """A job file in /tmp once opened all of /tmp (its folder was the default search path). The
    node's home folder is its own here, not one under /tmp (which would keep /tmp out anyway)."""
    import uuid

    assert not os.path.realpath(os.path.expanduser("~")).startswith("/tmp/")

    stem = f"/tmp/grpo-test-reach-{uuid.uuid4().hex}"
    module, other = Path(f"{stem}.py"), Path(f"{stem}-plan.json")
    module.write_text("def reward(completion, task):\n    return float(len(open(task['path']).read()))\n")
    other.write_text(json.dumps({"evalAnswers": [SECRET]}))
    try:
        with Grader(f"{module}:reward", search_path=["/tmp"], strict=True, retries=0) as grader:
            assert grader.score(["x"], [{"path": str(module)}]) == [float(len(module.read_text()))]
            with pytest.raises(RewardFunctionError, match="was refused") as raised:
                grader.score(["x"], [{"path": str(other)}])
        assert SECRET not in str(raised.value)
    finally:
        module.unlink()
        other.unlink()
    reward_author(figures, "read /tmp from a job file in /tmp", "its own file alone", "refused")


def test_the_nodes_secret_places_are_never_granted_and_the_jobs_stored_files_are(tmp_path):
    """The mounted service-account tokens (not mounted on this machine, so by the rule itself), the
    shared temporary folders, another worker's scratch; a resumed job's own stored files are."""
    places = node_places({"HOME": str(tmp_path / "home"), "GRPO_RUN_HOME": str(tmp_path / "grpo")})
    assert "secrets" in why_not("/var/run/secrets/kubernetes.io/serviceaccount", places)
    assert "holds" in why_not("/var", places) and "holds" in why_not("/tmp", places)
    assert "scratch" in why_not("/tmp/grpo-grader-abc123", places)
    assert "hidden" in why_not(str(tmp_path / "home" / ".config" / "gcloud"), places)
    assert "GRPO_RUN_HOME" in why_not(str(tmp_path / "grpo" / "runs" / "other"), places)
    assert why_not(str(tmp_path / "grpo" / "runs" / "job" / "environment" / "reward"), places) is None
    assert why_not(str(tmp_path / "home" / "projects" / "job"), places) is None


def test_a_credential_files_secret_in_a_reward_functions_error_comes_back_redacted(rewards_file, node, monkeypatch,
                                                                                   capfd, figures):
    """A secret only in a file (none of the trainer's variables holds it), as a reward that got
    hold of it would raise or print it."""
    file_only = "FAKE-FILE-ONLY-SECRET-0987654321"
    node["aws"].write_text(f"[default]\naws_access_key_id = AKIAFAKE\naws_secret_access_key = {file_only}\n")
    adc = node["home"] / ".config" / "gcloud" / "application_default_credentials.json"
    adc.parent.mkdir(parents=True)
    adc.write_text(json.dumps({"type": "authorized_user", "client_id": "x.apps", "refresh_token": "1//FAKE-REFRESH-77"}))
    with grader_for(rewards_file, "raises_the_secret") as grader:
        message = str(failure_of(grader, [{"secret": f"{file_only} and 1//FAKE-REFRESH-77"}]))
    err = capfd.readouterr().err
    assert file_only not in message and file_only not in err and "FAKE-REFRESH-77" not in message
    assert f"[redacted {node['aws']}] and [redacted {adc}]" in message
    reward_author(figures, "raise the text of ~/.aws/credentials", "credential files' secrets scrubbed too",
                  f"[redacted {'~/.aws/credentials'}]")


@pytest.mark.parametrize("value", ["", None])
def test_the_sandbox_keeps_rewards_out_of_the_very_grpo_run_home_the_runner_uses(tmp_path, monkeypatch, value):
    # An empty GRPO_RUN_HOME made the runner work in the current folder while the sandbox kept
    # rewards out of ~/.grpo-run: the two read it one way now (HOME_ENV, unset or empty: the default).
    from grpo_run.runner.home import grpo_run_home

    monkeypatch.setenv("HOME", str(tmp_path))
    if value is None:
        monkeypatch.delenv("GRPO_RUN_HOME", raising=False)
    else:
        monkeypatch.setenv("GRPO_RUN_HOME", value)
    assert node_places().grpo_run_home == os.path.realpath(grpo_run_home()) == str(tmp_path / ".grpo-run")
