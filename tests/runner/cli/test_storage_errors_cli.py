"""Every command that reads or changes a job in storage says a store it cannot use in one line
(exit 1), never a traceback: `cancel` above all, the command that stops a paid run. No store
answers here: each has no credentials (and gs:// no metadata server: conftest points google-auth
at a closed port), so the error comes before any request."""

from __future__ import annotations

import pytest

from grpo_run.runner.cli.commands import main
from grpo_run.runner.exits import EXIT_FAILED

STORES = {
    "gs://some-bucket/grpo": "no Google credentials found",
    "az://some-container/grpo": "no Azure storage account",
    "s3://some-bucket/grpo": "missing or incomplete credentials",
}
# an Azure account named, and no credential for it: azure-identity tries each it knows (no managed
# identity answers: conftest points it at a closed port) and logged a dozen lines before the error
SIGNED_IN = {"az://some-container/grpo": "no Azure credential found"}
COMMANDS = {
    "get": ["get", "tj", "my-job"],
    "samples": ["samples", "my-job"],
    "report": ["report", "my-job", "--out", "report.png"],
    "export": ["export", "my-job", "--out", "adapter"],
    "cancel": ["cancel", "my-job"],
    "delete": ["delete", "my-job", "--yes"],
}


@pytest.fixture
def no_credentials(monkeypatch, tmp_path):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud"))     # no gcloud login either
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("url", STORES)
@pytest.mark.parametrize("command", COMMANDS)
def test_a_store_without_credentials_is_one_line_naming_the_fix(no_credentials, capsys, url, command):
    assert main([*COMMANDS[command], "--storage", url]) == EXIT_FAILED      # no exception escapes main
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith(f"error: storage {url}/my-job: "), err
    assert STORES[url] in err


@pytest.mark.parametrize("command", ["get", "cancel"])
def test_an_azure_account_without_a_credential_is_one_line_too(no_credentials, monkeypatch, capfd, command):
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT", "someaccount")
    (url, says), = SIGNED_IN.items()
    assert main([*COMMANDS[command], "--storage", url]) == EXIT_FAILED
    out, err = capfd.readouterr()                     # the file descriptors: a library's log handler included
    assert out == ""
    assert err.count("\n") == 1 and err.startswith(f"error: storage {url}/my-job: {says}"), err
