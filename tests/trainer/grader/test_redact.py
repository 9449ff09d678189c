"""What `redact` scrubs: the trainer's secrets by value, and Azure's account keys and SAS signatures
by their shape, wherever they appear in text that leaves the sandbox."""

from __future__ import annotations

import pytest

from grpo_run.trainer.grader.redact import StreamScrubber, scrub, secret_names

pytestmark = pytest.mark.trust
ACCOUNT_KEY = "Zm9vYmFyYmF6cXV4MTIzNDU2Nzg5MGFiY2RlZmdoaWprbG1ub3BxcnN0dXZ3eHl6QUJDREVGR0g="
CONNECTION = f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={ACCOUNT_KEY};EndpointSuffix=core.windows.net"
SAS = "sv=2024-11-04&ss=b&srt=co&sp=rwl&se=2026-12-31T00:00:00Z&sig=bm90LWEtcmVhbC1zaWduYXR1cmUtMTIzNDU2%3D"


def test_an_azure_connection_string_and_its_account_key_alone_are_scrubbed():
    environ = {"AZURE_STORAGE_CONNECTION_STRING": CONNECTION, "PATH": "/usr/bin"}
    assert "$AZURE_STORAGE_CONNECTION_STRING" in {label for label, _ in secret_names(environ)}
    text = f"connecting with {CONNECTION}\nthe key {ACCOUNT_KEY} was refused"
    scrubbed = scrub(text, environ)
    assert ACCOUNT_KEY not in scrubbed
    assert scrubbed == ("connecting with [redacted $AZURE_STORAGE_CONNECTION_STRING]\n"
                        "the key [redacted $AZURE_STORAGE_CONNECTION_STRING] was refused")
    scrubber = StreamScrubber(environ)                      # the worker's output: by value
    assert ACCOUNT_KEY.encode() not in scrubber.feed(text.encode()) + scrubber.flush()


def test_a_sas_token_in_a_variable_or_a_url_is_scrubbed():
    environ = {"AZURE_STORAGE_SAS": SAS}
    assert scrub(f"token {SAS} end", environ) == "token [redacted $AZURE_STORAGE_SAS] end"
    url = f"https://acct.blob.core.windows.net/c/blob?{SAS}"
    shown = scrub(f"GET {url} failed: 403", {})               # a SAS no variable of ours holds
    assert "bm90LWEtcmVhbC1zaWduYXR1cmUtMTIzNDU2" not in shown and "&sig=[redacted] failed: 403" in shown
    other = scrub(f"AccountKey={ACCOUNT_KEY};SharedAccessSignature=sv=1&sig=abcdefgh12", {})
    assert other == "AccountKey=[redacted];SharedAccessSignature=[redacted]"


def test_ordinary_text_with_sig_or_keys_in_words_is_left_alone():
    text = "design=round config=sig-free signal=9 sig=short"
    assert scrub(text, {}) == text
