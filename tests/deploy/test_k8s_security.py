"""The generated Kubernetes Job gives the reward function as little as the node allows: not root,
no privilege escalation, no capabilities, no Kubernetes API token unless asked; and those same
settings, applied to a process here, still leave the reward sandbox's strict mode in force. The
cloud-init user-data never suggests keys: the node's instance role reaches storage."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import yaml

from grpo_run.runner.cli.commands import EXIT_OK, EXIT_USAGE, main
from grpo_run.runner.deploy.node import NodeSettings, cloud_init
from grpo_run.runner.deploy.wheel import build_wheel

K8S = ["deploy", "k8s", "--storage", "s3://bucket/grpo", "--job", "my-job", "--image", "registry/grpo-run:1"]


def manifest(capsys, *extra: str) -> tuple[str, dict]:
    capsys.readouterr()
    assert main([*K8S, *extra]) == EXIT_OK
    text = capsys.readouterr().out
    return text, yaml.safe_load(text)


def pod_of(doc: dict) -> tuple[dict, dict]:
    pod = doc["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return pod, container


def test_the_pod_runs_as_a_user_without_privileges_or_an_api_token(capsys):
    text, doc = manifest(capsys, "--service-account", "grpo-run")
    pod, container = pod_of(doc)
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000}
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]} and "add" not in security["capabilities"]
    assert not security.get("privileged")
    assert pod["automountServiceAccountToken"] is False and pod["serviceAccountName"] == "grpo-run"
    # a user with no home folder in the image writes its caches on the volume fsGroup makes its own
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["HOME"] == "/work" and env["HF_HOME"].startswith("/work/")
    # the reason for the seccomp choice travels with the file
    assert text.startswith("# grpo-run deploy k8s") and "RuntimeDefault) refuses unshare()" in text


def test_the_api_token_is_mounted_only_when_asked(capsys):
    _, doc = manifest(capsys, "--service-account", "grpo-run", "--service-account-token")
    assert pod_of(doc)[0]["automountServiceAccountToken"] is True


@pytest.mark.parametrize("choice, profile", [
    ([], {"type": "Unconfined"}),
    (["--seccomp", "runtime-default"], {"type": "RuntimeDefault"}),
    (["--seccomp", "localhost/profiles/grpo-run.json"], {"type": "Localhost", "localhostProfile": "profiles/grpo-run.json"}),
])
def test_the_containers_seccomp_profile_is_the_one_chosen_and_passes_kubernetes_validate(capsys, choice, profile):
    import kubernetes_validate

    _, doc = manifest(capsys, "--uid", "4242", *choice)
    kubernetes_validate.validate(doc, "1.31.0", strict=True)
    pod, container = pod_of(doc)
    assert container["securityContext"]["seccompProfile"] == profile
    assert pod["securityContext"]["runAsUser"] == pod["securityContext"]["fsGroup"] == 4242


@pytest.mark.parametrize("args, names", [
    (["--uid", "0"], "--uid 0: expected a user id above 0"),
    (["--seccomp", "none"], "--seccomp 'none': expected one of unconfined, runtime-default, localhost/PATH"),
    (["--seccomp", "localhost//etc/x.json"], "--seccomp 'localhost//etc/x.json'"),
    (["--seccomp", "localhost/../x.json"], "--seccomp 'localhost/../x.json'"),
])
def test_a_bad_security_setting_is_refused_naming_the_flag(capsys, args, names):
    assert main([*K8S, *args]) == EXIT_USAGE
    assert names in capsys.readouterr().err


# What the container runtime does with the generated settings, done to a child process here: drop
# every capability (bounding, inheritable, and so permitted and effective after exec) and set
# no_new_privs (allowPrivilegeEscalation: false); RuntimeDefault is containerd's default profile
# for a container without CAP_SYS_ADMIN, reduced to what matters here: unshare() is refused.
UNDER_THE_POD_SETTINGS = textwrap.dedent('''
    import ctypes, json, sys
    from grpo_run.trainer.grader import seccomp
    from grpo_run.trainer.grader.grader import Grader, SandboxUnavailable
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    caps = {k: int(status[k].strip(), 16) for k in ("CapEff", "CapPrm", "CapBnd")}
    nnp = status["NoNewPrivs"].strip() == "1"
    if sys.argv[2] == "RuntimeDefault":
        UNSHARE = 272
        program = seccomp._assemble([(seccomp._LD_W_ABS, 0, 0, seccomp._NR), (seccomp._JEQ_K, "deny", 0, UNSHARE),
                                     (seccomp._RET_K, 0, 0, seccomp._RET_ALLOW), "deny",
                                     (seccomp._RET_K, 0, 0, seccomp._RET_EPERM)])
        array = (seccomp._SockFilter * len(program))(*(seccomp._SockFilter(*i) for i in program))
        assert ctypes.CDLL(None).prctl(22, 2, ctypes.byref(seccomp._SockFprog(len(program), array)), 0, 0) == 0
    try:
        grader = Grader(sys.argv[1], strict=True, retries=0)
    except SandboxUnavailable as error:
        print(json.dumps({"caps": caps, "nnp": nnp, "missing": list(error.missing)}))
    else:
        print(json.dumps({"caps": caps, "nnp": nnp, "mode": grader.sandbox_mode, "score": grader.score(["x"], [{}])}))
        grader.close()
''')


def run_under(container_security: dict, reward: str) -> dict:
    """The strict sandbox, in a process given what `container_security` asks of the runtime."""
    args = ["setpriv"]
    if container_security.get("allowPrivilegeEscalation") is False:
        args.append("--no-new-privs")
    if container_security.get("capabilities", {}).get("drop") == ["ALL"]:
        args += ["--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all"]
    profile = container_security["seccompProfile"]["type"]
    done = subprocess.run([*args, sys.executable, "-c", UNDER_THE_POD_SETTINGS, reward, profile],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is not installed")
def test_the_generated_containers_settings_leave_the_strict_sandbox_in_force(tmp_path, capsys):
    reward = tmp_path / "reward.py"
    reward.write_text("def reward(completion, task):\n    return 1.0\n")
    _, doc = manifest(capsys)
    result = run_under(pod_of(doc)[1]["securityContext"], f"{reward}:reward")
    assert result["caps"] == {"CapEff": 0, "CapPrm": 0, "CapBnd": 0} and result["nnp"]   # as the pod would be
    assert result.get("missing") is None, result
    assert result["mode"]["network"] == "netns" and result["mode"]["seccomp"] == "on"
    assert result["mode"]["filesystem"] == "landlock" and result["mode"]["signals"] in ("landlock", "pidns")
    assert result["score"] == [1.0]

    # The runtime's default profile would take the namespaces away: a strict job then fails.
    _, doc = manifest(capsys, "--seccomp", "runtime-default")
    refused = run_under(pod_of(doc)[1]["securityContext"], f"{reward}:reward")
    assert "network" in refused["missing"]


# --- cloud-init ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel the nodes install (runner/deploy/wheel.py), built once."""
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_the_user_data_holds_no_keys_and_says_the_instance_role_brings_them(wheel):
    text = cloud_init(NodeSettings(storage="s3://bucket/grpo", job="my-job", region="us-east-1", wheel=wheel))
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        assert key not in text                      # not even commented out, as a suggestion
    assert "instance role" in text and "IMDSv2" in text and "hop limit of 1" in text
    (env,) = [f["content"] for f in yaml.safe_load(text)["write_files"] if f["path"] == "/etc/grpo-run/env"]
    assert "No keys here" in env


@pytest.mark.trust
def test_every_generated_node_runs_reward_functions_only_in_the_strict_sandbox(capsys, figures, wheel, tmp_path):
    """A job's spec.sandbox comes from storage on `resume`; the node's own GRPO_RUN_SANDBOX=strict,
    set by every file `grpo-run deploy` writes, is the floor it cannot lower."""
    _, doc = manifest(capsys)
    env = {e["name"]: e["value"] for e in pod_of(doc)[1]["env"]}
    assert env["GRPO_RUN_SANDBOX"] == "strict"

    def printed(*args: str) -> str:
        capsys.readouterr()
        assert main(list(args)) == EXIT_OK
        return capsys.readouterr().out

    unit = printed("deploy", "systemd", "--storage", "s3://bucket/grpo", "--job", "my-job")
    assert "Environment=GRPO_RUN_SANDBOX=strict" in unit
    assert "GRPO_RUN_SANDBOX=strict" in cloud_init(NodeSettings(storage="s3://bucket/grpo", job="my-job", wheel=wheel))
    # a folder for storage: the task's command puts the wheel there
    task = yaml.safe_load(printed("deploy", "skypilot", "--storage", str(tmp_path / "bucket"), "--job", "my-job",
                                  "--accelerators", "L4:1"))
    assert task["envs"]["GRPO_RUN_SANDBOX"] == "strict"
    figures.add("trust", actor="bucket writer", tried="spec.sandbox: best-effort in a stored job, on a deployed node",
                protection="GRPO_RUN_SANDBOX=strict in every generated unit, user-data, Job and task",
                outcome="the node's strict is the floor", held=True)
