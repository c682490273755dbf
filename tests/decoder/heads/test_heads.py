"""Medusa heads: the heads file, the model check, the predictor, and training on a tiny model."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from redraft.decoder.heads.blocks import MedusaHeads
from redraft.decoder.heads.heads_file import (
    HeadsError,
    HeadsMismatch,
    load_heads,
    model_fingerprint,
    read_meta,
    save_heads,
)
from redraft.decoder.heads.hidden_cache import HiddenCache
from redraft.decoder.heads.predictor import HeadsPredictor
from redraft.decoder.heads.training import TrainConfig, evaluate, train_heads
from redraft.decoder.heads.training_data import Document, Positions, frequency_subset

from ..conftest import tiny_model


def _meta(model) -> dict:
    return {"model": "tiny", "model_fingerprint": model_fingerprint(model),
            "vocab_size": int(model.config.vocab_size)}


def _random_heads(model, k: int = 3, seed: int = 1) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(int(model.config.hidden_size), k, torch.arange(10, 40))
    for block in heads.blocks:
        torch.nn.init.normal_(block.linear.weight, std=0.3)
        torch.nn.init.normal_(block.linear.bias, std=0.3)
    return heads


def test_zero_initialised_heads_repeat_the_next_token_prediction():
    model = tiny_model()
    heads = MedusaHeads(int(model.config.hidden_size), 4)
    hidden = model.base_model(input_ids=torch.tensor([[3, 9, 27, 5]])).last_hidden_state[0, -1]
    ids, probs = HeadsPredictor(heads, model, "full", int8=False).topk(hidden.detach(), 3)
    expected = torch.topk(model.lm_head(hidden), 3).indices.tolist()
    assert ids.shape == (4, 3) and all(row.tolist() == expected for row in ids)
    assert np.all(np.diff(probs, axis=1) <= 0) and np.all((probs > 0) & (probs < 1))


def test_subset_projection_returns_full_vocabulary_ids_from_the_subset():
    model = tiny_model()
    heads = _random_heads(model)
    hidden = torch.randn(int(model.config.hidden_size))
    ids, _ = HeadsPredictor(heads, model, "subset").topk(hidden, 5)
    assert set(ids.ravel().tolist()) <= set(range(10, 40))
    full_ids, _ = HeadsPredictor(heads, model, "full").topk(hidden, 64)
    for k in range(3):  # the subset's ranking is the full ranking restricted to the subset
        assert ids[k].tolist() == [t for t in full_ids[k].tolist() if 10 <= t < 40][:5]


def test_int8_heads_agree_with_the_exact_ones():
    model = tiny_model(init=0.3)
    torch.manual_seed(3)
    heads = MedusaHeads(int(model.config.hidden_size), 3, torch.arange(10, 40), next_token=True)
    for block in heads.blocks:
        torch.nn.init.normal_(block.linear.weight, std=0.3)
        torch.nn.init.normal_(block.embed.weight, std=0.3)
    exact = HeadsPredictor(heads, model, "full", int8=False)
    fast = HeadsPredictor(heads, model, "full")  # a float32 CPU model: int8 by default
    assert fast.int8 and not exact.int8
    same, agree = 0, 0
    for i in range(40):
        hidden = torch.randn(int(model.config.hidden_size))
        a, pa = exact.topk(hidden, 5, next_token=i)
        b, pb = fast.topk(hidden, 5, next_token=i)
        same += int(np.array_equal(a[:, 0], b[:, 0]))
        agree += (a[:, 0] == b[:, 0]).sum()
        assert np.abs(pa - pb).max() < 0.1
    assert agree >= 0.9 * 40 * 3 and same >= 30
    # the int8 subset still ranks exactly as the int8 full projection restricted to it
    hidden = torch.randn(int(model.config.hidden_size))
    ids, _ = HeadsPredictor(heads, model, "subset").topk(hidden, 5, next_token=4)
    full_ids, _ = fast.topk(hidden, 64, next_token=4)
    for k in range(3):
        assert ids[k].tolist() == [t for t in full_ids[k].tolist() if 10 <= t < 40][:5]


def test_heads_file_round_trip(tmp_path):
    model = tiny_model()
    heads = _random_heads(model)
    path = tmp_path / "h.safetensors"
    save_heads(heads, path, {**_meta(model), "accuracy": {"full": {"topk": [[0.5, 0.7]] * 3}}})
    meta = read_meta(path)
    assert meta["num_heads"] == 3 and meta["vocab_subset_size"] == 30
    assert meta["dtype"] == "bfloat16" and meta["model"] == "tiny"
    loaded = load_heads(path, model)
    assert loaded.vocab_subset.tolist() == list(range(10, 40))
    assert loaded.accuracy("full") == [[0.5, 0.7]] * 3 and loaded.accuracy("subset") is None
    for a, b in zip(heads.blocks, loaded.blocks):  # stored in bfloat16: equal to its precision
        assert torch.allclose(a.linear.weight, b.linear.weight, rtol=1e-2, atol=1e-3)
    # bfloat16 storage: 2 bytes per weight plus the header and the subset ids
    h = int(model.config.hidden_size)
    assert path.stat().st_size < 3 * (h * h + h) * 2 + 30 * 4 + 4096


def test_next_token_heads_read_the_next_tokens_embedding_and_round_trip(tmp_path):
    model = tiny_model(init=0.3)
    torch.manual_seed(2)
    heads = MedusaHeads(int(model.config.hidden_size), 3, torch.arange(10, 40), next_token=True)
    for block in heads.blocks:
        torch.nn.init.normal_(block.embed.weight, std=2.0)
    hidden = torch.randn(int(model.config.hidden_size))
    predictor = HeadsPredictor(heads, model, "full")
    a, _ = predictor.topk(hidden, 5, next_token=7)
    b, _ = predictor.topk(hidden, 5, next_token=8)
    assert not np.array_equal(a, b)  # the guesses depend on the next token
    with pytest.raises(ValueError, match="next token"):
        predictor.topk(hidden, 5)
    path = tmp_path / "h.safetensors"
    save_heads(heads, path, _meta(model))
    assert read_meta(path)["next_token"] is True and read_meta(path)["version"] == 3
    loaded = load_heads(path, model)
    assert loaded.next_token
    for x, y in zip(heads.blocks, loaded.blocks):
        assert torch.allclose(x.embed.weight, y.embed.weight, rtol=1e-2, atol=1e-3)
    again, _ = HeadsPredictor(loaded, model, "full").topk(hidden, 5, next_token=7)
    assert (again[:, 0] == a[:, 0]).mean() >= 2 / 3  # bfloat16 storage may swap near-ties


def test_heads_for_another_model_are_refused(tmp_path):
    model, other = tiny_model(seed=0), tiny_model(seed=1)
    path = tmp_path / "h.safetensors"
    save_heads(_random_heads(model), path, _meta(model))
    with pytest.raises(HeadsMismatch, match="trained for model 'tiny'"):
        load_heads(path, other)
    wider = tiny_model(vocab=80)
    with pytest.raises(HeadsMismatch, match="vocabulary"):
        load_heads(path, wider)


def test_fingerprint_ignores_dtype_but_not_weights():
    model = tiny_model()
    fp = model_fingerprint(model)
    assert model_fingerprint(tiny_model().to(torch.bfloat16)) == fp
    changed = tiny_model()
    with torch.no_grad():
        changed.model.layers[1].mlp.down_proj.weight.mul_(1.5)
    assert model_fingerprint(changed) != fp


@pytest.mark.parametrize("content, message", [
    (b"not a safetensors file", "not a safetensors heads file"),
    (None, "not found"),
])
def test_bad_heads_files(tmp_path, content, message):
    path = tmp_path / "h.safetensors"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(HeadsError, match=message):
        load_heads(path)


def test_a_heads_file_of_a_newer_format_is_refused(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "h.safetensors"
    save_file({"w": torch.zeros(2)}, str(path),
              metadata={"redraft": json.dumps({"format": "redraft-medusa", "version": 4})})
    with pytest.raises(HeadsError, match="heads format version 4, this redraft reads 1, 2, 3"):
        load_heads(path)


def test_a_safetensors_file_that_is_not_heads_is_refused(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(2)}, str(path), metadata={"x": "1"})
    with pytest.raises(HeadsError, match="not a redraft Medusa heads file"):
        load_heads(path)


# -- training on a tiny model --------------------------------------------------------------


def _cycle_docs(n: int, vocab: int, seed: int = 0) -> list[Document]:
    """Documents whose answers count upwards (mod a cycle), from a random start: every
    token decides the ones after it, so heads can learn to guess several places ahead."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        prompt = rng.integers(2, vocab, size=6).tolist()
        start = int(rng.integers(0, 48))
        answer = [2 + (start + j) % 48 for j in range(40)]
        docs.append(Document(f"doc:{i}", prompt + answer, len(prompt), len(prompt) + 40))
    return docs


def test_hidden_cache_resumes_after_an_interruption(tmp_path):
    model = tiny_model()
    docs = _cycle_docs(10, 64)
    cache = HiddenCache(tmp_path / "c", docs, int(model.config.hidden_size))
    with pytest.raises(KeyboardInterrupt):
        original = cache._write_progress

        def interrupt(n):
            original(n)
            if n == 4:
                raise KeyboardInterrupt
        cache._write_progress = interrupt
        cache.fill(model, "test", chunk=2)
    assert cache.done == 4
    first = np.array(cache.hidden[: cache.offsets[4]])
    cache.hidden[: cache.offsets[4]] = 7.0  # marks rows a resumed run must not recompute
    cache.hidden.flush()
    resumed = HiddenCache(tmp_path / "c", docs, int(model.config.hidden_size))
    resumed.fill(model, "test", chunk=2)
    assert resumed.done == 10
    assert np.all(np.asarray(resumed.hidden[: resumed.offsets[4]]) == 7.0)
    fresh = HiddenCache(tmp_path / "fresh", docs, int(model.config.hidden_size))
    fresh.fill(model, "test")
    assert np.array_equal(np.asarray(fresh.hidden[: fresh.offsets[4]]), first)
    assert np.array_equal(np.asarray(fresh.hidden[fresh.offsets[4] :]),
                          np.asarray(resumed.hidden[resumed.offsets[4] :]))


def _tiny_setup(tmp_path, docs, init: float = 0.02):
    model = tiny_model(vocab=64, init=init)
    cache = HiddenCache(tmp_path / "cache", docs, int(model.config.hidden_size))
    cache.fill(model, "test")
    return model, cache, Positions.of(docs)


def test_training_learns_to_guess_ahead(tmp_path):
    docs = _cycle_docs(60, 64)
    model, cache, positions = _tiny_setup(tmp_path, docs[:50])
    held = HiddenCache(tmp_path / "held", docs[50:], int(model.config.hidden_size))
    held.fill(model, "test")
    held_pos = Positions.of(docs[50:])
    subset = frequency_subset(positions, 48, 64)
    assert set(subset.tolist()) == set(range(2, 50))
    weight = model.lm_head.weight.detach()
    torch.manual_seed(0)
    heads = MedusaHeads(int(model.config.hidden_size), 3, subset)
    before = evaluate(heads, held.hidden, held_pos, weight, torch.device("cpu"))
    cfg = TrainConfig(num_heads=3, epochs=30, batch_size=128, lr=3e-3, warmup=10)
    train_heads(heads, cache.hidden, positions, weight, cfg, tmp_path / "ckpt.pt",
                torch.device("cpu"))
    after = evaluate(heads, held.hidden, held_pos, weight, torch.device("cpu"))
    assert max(before["full"]["top1"]) < 0.1
    assert min(after["full"]["top5"]) > 0.5, after
    assert after["full"]["top1"][0] > 0.3, after
    for proj in ("full", "subset"):  # cumulative: top-k accuracy never falls with k
        for row in after[proj]["topk"]:
            assert all(a <= b for a, b in zip(row, row[1:]))
    assert after["positions"] == [40 * 10 - k for k in (10, 20, 30)]


def _pair_docs(n: int, seed: int = 0) -> list[Document]:
    """Answers of pairs (a, a + 24): a is random, so the token after a random `a` can only be
    guessed by a head that knows `a`, i.e. reads the next token (head 1 at the row before)."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        answer = [int(t) for a in rng.integers(2, 26, size=20) for t in (a, a + 24)]
        docs.append(Document(f"doc:{i}", [1, 1] + answer, 2, 2 + len(answer)))
    return docs


def test_heads_that_read_the_next_token_guess_what_only_it_decides(tmp_path):
    docs = _pair_docs(60)
    model, cache, positions = _tiny_setup(tmp_path, docs[:50], init=0.3)  # distinct embeddings
    held = HiddenCache(tmp_path / "held", docs[50:], int(model.config.hidden_size))
    held.fill(model, "test")
    held_pos = Positions.of(docs[50:])
    weight, embedding = model.lm_head.weight.detach(), model.model.embed_tokens.weight.detach()
    cfg = TrainConfig(num_heads=1, epochs=40, batch_size=128, lr=3e-3, warmup=10)
    top1 = {}
    for next_token in (False, True):
        torch.manual_seed(0)
        heads = MedusaHeads(int(model.config.hidden_size), 1,
                            frequency_subset(positions, 48, 64), next_token=next_token)
        train_heads(heads, cache.hidden, positions, weight, cfg, tmp_path / f"{next_token}.pt",
                    torch.device("cpu"), embedding)
        acc = evaluate(heads, held.hidden, held_pos, weight, torch.device("cpu"),
                       embedding=embedding)
        top1[next_token] = acc["full"]["top1"][0]
    # half the rows are decided by the next token (a -> a + 24), half are random
    assert top1[True] > 0.25 and top1[False] < 0.1, top1


def test_training_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    from redraft.decoder.heads import training as medusa_train

    docs = _cycle_docs(12, 64)
    model, cache, positions = _tiny_setup(tmp_path, docs)
    weight = model.lm_head.weight.detach()
    cfg = TrainConfig(num_heads=2, epochs=6, batch_size=64, checkpoint_every=4, warmup=3)

    def fresh_heads():
        torch.manual_seed(0)
        return MedusaHeads(int(model.config.hidden_size), 2, frequency_subset(positions, 30, 64))

    whole = fresh_heads()
    train_heads(whole, cache.hidden, positions, weight, cfg, tmp_path / "a.pt",
                torch.device("cpu"))
    original = medusa_train._save_checkpoint

    def save_then_die(path, cfg_, heads, opt, sched, step):
        original(path, cfg_, heads, opt, sched, step)
        if step == 8:
            raise KeyboardInterrupt

    monkeypatch.setattr(medusa_train, "_save_checkpoint", save_then_die)
    parts = fresh_heads()
    with pytest.raises(KeyboardInterrupt):
        train_heads(parts, cache.hidden, positions, weight, cfg, tmp_path / "b.pt",
                    torch.device("cpu"))
    monkeypatch.setattr(medusa_train, "_save_checkpoint", original)
    resumed = fresh_heads()
    train_heads(resumed, cache.hidden, positions, weight, cfg, tmp_path / "b.pt",
                torch.device("cpu"))
    for a, b in zip(whole.parameters(), resumed.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_labels_stop_at_the_end_of_each_document():
    docs = [Document("a", [9, 9, 10, 11, 12], 2, 5), Document("b", [9, 20, 21], 1, 3)]
    pos = Positions.of(docs)
    assert pos.next_tokens.tolist() == [10, 11, 12, 20, 21]
    assert pos.labels(np.arange(5), 2).tolist() == [
        [11, 12], [12, -1], [-1, -1], [21, -1], [-1, -1]]


# -- the command -----------------------------------------------------------------------------


def _run_cli(capsys, *argv):
    from redraft.decoder.cli import main

    rc = main(["train-medusa", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_bad_training_input_is_one_line(capsys, tmp_path):
    rc, out, err = _run_cli(capsys, "--data", str(tmp_path / "missing.jsonl"), "--out",
                            str(tmp_path / "h.safetensors"), "--heads", "0")
    assert rc == 2 and err.startswith("redraft train-medusa: error:") and "--heads" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    rc, _, err = _run_cli(capsys, "--data", str(bad), "--out", str(tmp_path / "h.safetensors"))
    assert rc == 2 and "bad.jsonl:1: needs a 'messages' list" in err and err.count("\n") == 1
    rc, _, err = _run_cli(capsys, "--data", str(tmp_path / "missing.jsonl"), "--out",
                          str(tmp_path / "h.safetensors"))
    assert rc == 2 and "cannot read" in err and err.count("\n") == 1
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)  # reading it would wait for a writer for ever
    rc, _, err = _run_cli(capsys, "--data", str(fifo), "--out", str(tmp_path / "h.safetensors"))
    assert rc == 2 and "not a regular file" in err and err.count("\n") == 1


def _chat_file(tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Count to {i}."},
        {"role": "assistant", "content": " ".join(map(str, range(i)))}]}) + "\n"
        for i in range(3, 9)))
    return data


@pytest.mark.parametrize("where", ["a directory", "under a regular file"])
def test_an_unwritable_out_is_refused_before_any_work(capsys, tmp_path, where):
    data = _chat_file(tmp_path)
    out = tmp_path / "heads"
    if where == "a directory":
        out.mkdir()
    else:
        out.write_text("a file")
        out = out / "h.safetensors"
    before = sorted(p.name for p in tmp_path.rglob("*"))
    rc, _, err = _run_cli(capsys, "--data", str(data), "--out", str(out), "--cache-dir",
                          str(tmp_path / "cache"))
    assert rc == 2 and err.count("\n") == 1 and err.startswith("redraft train-medusa: error:")
    assert ("is a directory" if where == "a directory" else "is not a directory") in err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # no cache, no .tmp


@pytest.mark.parametrize("flag, value", [
    ("--epochs", "nan"), ("--epochs", "inf"), ("--lr", "nan"), ("--lr", "-1"),
    ("--held-out", "nan"),
])
def test_non_finite_training_settings_are_refused_before_anything_loads(capsys, tmp_path,
                                                                        flag, value):
    # a model that does not exist: the setting must be refused before it is looked for
    rc, _, err = _run_cli(capsys, "--model", str(tmp_path / "no-model"), "--data",
                          str(_chat_file(tmp_path)), "--out", str(tmp_path / "h.safetensors"),
                          flag, value)
    assert rc == 2 and err.count("\n") == 1 and flag in err and "no-model" not in err


@pytest.mark.slow
def test_a_subset_larger_than_the_vocabulary_is_refused_before_the_model_loads(
        capsys, tmp_path):
    from ..conftest import have_default_model

    if not have_default_model():
        pytest.skip("default model package not installed (make install)")
    rc, _, err = _run_cli(capsys, "--data", str(_chat_file(tmp_path)), "--out",
                          str(tmp_path / "h.safetensors"), "--subset", "1000000000",
                          "--cache-dir", str(tmp_path / "cache"))
    assert rc == 2 and err.count("\n") == 1
    assert "--subset must be at most the vocabulary size (49152)" in err
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_a_training_line_nested_too_deeply_is_one_line(capsys, tmp_path):
    from ..conftest import have_default_model

    if not have_default_model():
        pytest.skip("default model package not installed (make install)")
    data = _chat_file(tmp_path)
    with data.open("a") as f:
        f.write('{"messages": ' + "[" * 100_000 + "\n")
    rc, out, err = _run_cli(capsys, "--data", str(data), "--out", str(tmp_path / "h.safetensors"),
                            "--cache-dir", str(tmp_path / "cache"))
    assert rc == 2 and out == ""
    assert err == f"redraft train-medusa: error: {data}:7: JSON nested too deeply\n"
