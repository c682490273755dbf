"""`redraft generate` as a user runs it: one-line errors for bad input, --json records,
JSONL prompts with multi-turn chats, and the --baseline comparison."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from redraft.decoder.cli import main

from ..conftest import CODE_PROMPTS


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["generate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", "  "], "empty prompt"),
        (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be positive"),
        (["--prompt", "hi", "--drafters", "pld,ngram"], "unknown drafter 'ngram'"),
        (["--prompt", "hi", "--drafters", "none,pld"], "cannot be combined"),
        (["--prompt", "hi", "--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--prompt", "hi", "--drafters", "rest"], "needs a datastore"),
        (["--prompt", "hi", "--datastore", "/nonexistent/ds"], "/nonexistent/ds"),
        (["--prompt", "hi", "--top-p", "0"], "--top-p must be in (0, 1]"),
        # checked before the model is looked for: a missing model would be the error otherwise
        (["--prompt", "hi", "--model", "no-such-model", "--temperature", "nan"],
         "--temperature must be a finite number >= 0, got nan"),
        (["--prompt", "hi", "--model", "no-such-model", "--temperature", "inf"],
         "--temperature must be a finite number >= 0, got inf"),
        (["--prompt", "hi", "--model", "no-such-model", "--seed", str(2**70)],
         f"--seed must be in 0..2**64-1, got {2**70}"),
        (["--prompt", "hi", "--model", "no-such-model", "--seed", "-1"],
         "--seed must be in 0..2**64-1, got -1"),
        (["--prompt", "caf\udcff", "--model", "no-such-model"],
         "--prompt is not valid UTF-8 (byte 0xff at character 3)"),
        (["--prompt", "hi", "--tree-nodes", "0"], "--tree-nodes must be in 1..256"),
        (["--prompt", "hi", "--drafters", "draft-model", "--draft-model", "skip:x"],
         "skip:L needs a layer count"),
        (["--prompt", "hi", "--drafters", "draft-model", "--draft-top-k", "0"],
         "--draft-top-k must be >= 1"),
        (["--prompt", "hi", "--drafters", "lookahead", "--lookahead-ngram", "1"],
         "lookahead needs W >= 1, N >= 2, G >= 1"),
    ],
)
def test_bad_arguments_are_one_line_errors(capsys, argv, message):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("redraft generate: error:")
    assert message in err


def test_bad_prompt_files(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    rc, _, err = run(capsys, "--prompts", str(bad))
    assert rc == 2 and "bad.jsonl:2: invalid JSON" in err
    bad.write_text('{"question": "no prompt field"}\n')
    rc, _, err = run(capsys, "--prompts", str(bad))
    assert rc == 2 and "needs a 'prompt' string or a 'turns' list" in err
    rc, _, err = run(capsys, "--prompts", str(tmp_path / "missing.jsonl"))
    assert rc == 2 and "cannot read prompts file" in err
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)  # reading it would wait for a writer for ever
    for path in (fifo, tmp_path):
        rc, _, err = run(capsys, "--prompts", str(path))
        assert rc == 2 and "not a regular file" in err and err.count("\n") == 1
    bad.write_text('{"prompt": "ok"}\n{"turns": ["fine", "caf\\ud800"]}\n')  # a JSON escape
    rc, out, err = run(capsys, "--prompts", str(bad), "--model", "no-such-model")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "bad.jsonl:2: the prompt is not valid Unicode (a lone surrogate U+D800" in err


def test_a_prompt_line_nested_too_deeply_is_one_line(capsys, tmp_path):
    deep = tmp_path / "deep.jsonl"
    deep.write_text(json.dumps({"prompt": "ok"}) + "\n" + "[" * 100_000 + "\n")
    rc, out, err = run(capsys, "--prompts", str(deep), "--model", "no-such-model")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err == f"redraft generate: error: {deep}:2: JSON nested too deeply\n"


def test_invalid_utf8_in_argv_is_one_line(tmp_path):
    """Bytes that are not UTF-8 on the real command line (Python passes them on as surrogate
    escapes): one line before anything loads, not a tokenizer's traceback."""
    proc = subprocess.run([sys.executable, "-m", "redraft.decoder.cli", "generate",
                           "--prompt", b"caf\xe9 au lait"], capture_output=True, timeout=300,
                          env={**os.environ, "LC_ALL": "C.UTF-8"})
    assert proc.returncode == 2 and proc.stdout == b""
    assert proc.stderr == b"redraft generate: error: --prompt is not valid UTF-8 (byte 0xe9 " \
                          b"at character 3)\n"


def test_incompatible_datastore(capsys, tmp_path):
    from redraft.datastore import build_datastore

    path = str(tmp_path / "other")
    build_datastore(None, path, documents=[[1, 2, 3]], fingerprint="sha256:other", vocab_size=9)
    rc, _, err = run(capsys, "--prompt", "hi", "--datastore", path)
    assert rc == 2 and "fingerprint" in err and err.count("\n") == 1


def test_draft_model_with_another_tokenizer_is_refused(capsys, tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from ..conftest import tiny_model

    other = tmp_path / "other"
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        {"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>")), unk_token="<unk>").save_pretrained(other)
    tiny_model("llama", vocab=3).save_pretrained(other)
    capsys.readouterr()  # saving draws a progress bar
    rc, out, err = run(capsys, "--prompt", "hi", "--drafters", "draft-model",
                       "--draft-model", str(other))
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "has another tokenizer than the target" in err


def test_too_long_prompt(capsys, default_model):
    rc, _, err = run(capsys, "--prompt", "word " * 9000, "--drafters", "none")
    assert rc == 2 and "the model's context is 8192" in err


def test_json_records_with_baseline(capsys, default_model, code_datastore):
    rc, out, err = run(capsys, "--prompt", CODE_PROMPTS[0], "--max-new-tokens", "24",
                       "--datastore", code_datastore, "--json", "--baseline", "--threads", "1")
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    s = rec["stats"]
    assert len(rec["tokens"]) == s["new_tokens"] == 24 and rec["text"]
    assert s["steps"] <= 24 and s["tokens_per_step"] == pytest.approx(24 / s["steps"], abs=1e-3)
    # the default drafters with a datastore (hybrid: the default model has committed heads);
    # a token drafted by several is counted under all
    sources = {"pld", "rest", "learned", "recycle", "medusa"}
    assert all(set(label.split("+")) <= sources for label in s["accepted"])
    assert s["seconds"] > 0
    assert rec["baseline"]["identical"] is True


def test_stock_kernels_give_the_same_tokens(capsys, default_model):
    outs = []
    for extra in ([], ["--stock-kernels"]):
        rc, out, err = run(capsys, "--prompt", CODE_PROMPTS[1], "--max-new-tokens", "16",
                           "--json", "--threads", "1", *extra)
        assert rc == 0, err
        outs.append(json.loads(out)["tokens"])
    assert len(outs[0]) == 16 and outs[0] == outs[1]


def test_a_fixed_tree_verifies_more_nodes_and_keeps_the_tokens(capsys, default_model):
    stats = []
    for extra in ([], ["--tree-nodes", "32"]):
        rc, out, err = run(capsys, "--prompt", CODE_PROMPTS[1], "--max-new-tokens", "32",
                           "--json", "--threads", "1", "--baseline", *extra)
        assert rc == 0, err
        rec = json.loads(out)
        assert rec["baseline"]["identical"] is True
        stats.append(rec["stats"])
    cpu, fixed = (s["drafted"] / s["steps"] for s in stats)
    assert fixed > cpu and fixed > 8  # the CPU's curve keeps a few nodes, the fixed tree many


def test_prompts_file_with_turns_streams_text(capsys, default_model, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "Say hi."}) + "\n"
                 + json.dumps({"turns": ["Name a color.", "Name another one."]}) + "\n")
    rc, out, err = run(capsys, "--prompts", str(f), "--max-new-tokens", "12", "--threads", "1")
    assert rc == 0, err
    assert out.strip() and err.count("tokens in") == 2  # one stats line per prompt
    rc, out, _ = run(capsys, "--prompts", str(f), "--max-new-tokens", "12", "--json",
                     "--drafters", "none")
    recs = [json.loads(line) for line in out.strip().splitlines()]
    assert len(recs) == 2 and len(recs[1]["turns"]) == 2
    assert recs[1]["stats"]["new_tokens"] == sum(t["stats"]["new_tokens"] for t in recs[1]["turns"])
    assert recs[0]["stats"]["tokens_per_step"] == 1.0


def test_draft_service_with_another_tokenizer_is_refused(capsys, tmp_path):
    from redraft.datastore import Reader, build_datastore
    from redraft.datastore.service.server import ServerThread

    path = str(tmp_path / "other")
    build_datastore(None, path, documents=[[1, 2, 3]], fingerprint="sha256:other", vocab_size=9)
    with Reader(path) as reader:
        server = ServerThread(reader).start()
        try:
            rc, _, err = run(capsys, "--prompt", "hi", "--draft-service", server.address)
        finally:
            server.stop(grace=0)
    assert rc == 2 and err.count("\n") == 1
    assert f"draft service {server.address} serves a datastore built with" in err


@pytest.mark.parametrize("token_from", ["--token-file", "environment"])
def test_draft_service_over_tls_with_a_token_from_a_file_or_the_environment(
        capsys, tmp_path, tls_cert, monkeypatch, token_from):
    """The service answers only over TLS with the token: that the command reaches its
    datastore's tokenizer check shows both were sent."""
    from redraft.datastore import Reader, build_datastore
    from redraft.datastore.service.client import TOKEN_ENV
    from redraft.datastore.service.config import ServiceConfig
    from redraft.datastore.service.server import ServerThread, TLSFiles

    cert, key = tls_cert
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    token = ["--token-file", str(secret)]
    if token_from == "environment":
        monkeypatch.setenv(TOKEN_ENV, "s3cret")
        token = []
    path = str(tmp_path / "other")
    build_datastore(None, path, documents=[[1, 2, 3]], fingerprint="sha256:other", vocab_size=9)
    with Reader(path) as reader:
        server = ServerThread(reader, config=ServiceConfig(token="s3cret"),
                              tls=TLSFiles(cert, key)).start()
        try:
            rc, _, err = run(capsys, "--prompt", "hi", "--draft-service", server.address,
                             "--tls-ca", cert, *token)
        finally:
            server.stop(grace=0)
    assert rc == 2 and err.count("\n") == 1
    assert f"draft service {server.address} serves a datastore built with" in err


def test_draft_service_credentials_are_checked_before_anything_loads(capsys, tmp_path):
    rc, _, err = run(capsys, "--prompt", "hi", "--draft-service", "127.0.0.1:9", "--tls-ca",
                     str(tmp_path / "missing.pem"), "--model", "no-such-model")
    assert rc == 2 and err == "redraft generate: error: TLS file not found: " \
                              f"{tmp_path / 'missing.pem'}\n"
    rc, _, err = run(capsys, "--prompt", "hi", "--draft-service", "127.0.0.1:9", "--token",
                     "sécret", "--model", "no-such-model")
    assert rc == 2 and "--token: a token must be printable ASCII" in err


def test_the_recycling_table_carries_over_to_the_next_run(capsys, default_model, fresh_cache,
                                                           monkeypatch):
    monkeypatch.setenv("REDRAFT_CACHE", str(fresh_cache))  # no table from earlier tests
    steps = []
    for _ in range(2):
        rc, out, err = run(capsys, "--prompt", CODE_PROMPTS[2], "--max-new-tokens", "24",
                           "--drafters", "recycle", "--json", "--threads", "1")
        assert rc == 0, err
        steps.append(json.loads(out)["stats"]["steps"])
    # the second process starts from the table the first one saved
    assert steps[1] < steps[0]
