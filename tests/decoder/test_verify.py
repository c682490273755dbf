"""Tree verification: every node's logits equal a plain sequential forward along its path,
and after compaction the cache is exactly what sequential decoding would have built."""

from __future__ import annotations

import os
import random

import pytest
import torch
from redraft.decoder.verify import TreeVerifier, tree_mask_rows
from redraft.proto.tree import Tree

from .conftest import tiny_model


def node_paths(tree: Tree) -> list[list[int]]:
    out: list[list[int]] = []
    for tok, parent in zip(tree.tokens, tree.parents):
        out.append(([] if parent < 0 else out[parent]) + [tok])
    return out


@torch.inference_mode()
def sequential_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids], device=model.device)).logits[0, -1].float()


def sequential_hidden(model, ids: list[int]) -> torch.Tensor:
    """The final (post-norm) hidden state of the last position, from a plain forward."""
    with torch.no_grad():
        return model.base_model(torch.tensor([ids], device=model.device)
                                ).last_hidden_state[0, -1]


def random_tree(rng: random.Random, n: int, vocab: int) -> Tree:
    parents = [rng.randrange(-1, i) for i in range(n)]
    return Tree([rng.randrange(vocab) for _ in range(n)], parents, [0.5] * n, ["pld"] * n)


def test_mask_rows_are_ancestors():
    t = Tree([1, 2, 3, 4], [-1, 0, -1, 2], [0.5] * 4, ["pld"] * 4)
    assert tree_mask_rows(t) == [[0], [0, 1], [0, 1, 2], [0, 3], [0, 3, 4]]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_tree_logits_equal_sequential_on_tiny_models(kind, attn):
    model = tiny_model(kind, attn=attn, init=0.2)
    rng = random.Random(hash((kind, attn)) % 1000)
    verifier = TreeVerifier(model)
    context = [rng.randrange(64) for _ in range(9)]
    verifier.prefill(context[:-1])
    for step in range(3):  # several steps: compaction must leave a correct cache each time
        tree = random_tree(rng, rng.randrange(1, 14), 64)
        out = verifier.tree_forward(context[-1], tree)
        logits = out.logits
        assert logits.shape == (len(tree) + 1, 64)
        assert out.hidden is not None and out.hidden.shape == (len(tree) + 1, 32)
        worst = worst_hidden = 0.0
        for row, path in enumerate([[], *node_paths(tree)]):
            ref = sequential_logits(model, context + path)
            worst = max(worst, float((ref - logits[row]).abs().max()))
            ref_hidden = sequential_hidden(model, context + path)
            worst_hidden = max(worst_hidden, float((ref_hidden - out.hidden[row]).abs().max()))
        assert worst < 1e-4, f"step {step}: tree logits differ from sequential by {worst}"
        assert worst_hidden < 1e-4, f"step {step}: hidden states differ by {worst_hidden}"
        # accept a random root-to-node path (not necessarily the first nodes) and continue
        node = rng.randrange(len(tree))
        path_nodes = []
        while node >= 0:
            path_nodes.append(node)
            node = tree.parents[node]
        path_nodes.reverse()
        verifier.commit(path_nodes)
        context += [tree.tokens[i] for i in path_nodes] + [rng.randrange(64)]
        assert verifier.cached_len == len(context) - 1


def test_rejecting_everything_restores_the_cache():
    model = tiny_model("llama", init=0.2)
    verifier = TreeVerifier(model)
    context = [3, 4, 5, 6]
    verifier.prefill(context[:-1])
    verifier.tree_forward(context[-1], Tree([7, 8, 9], [-1, 0, -1], [0.5] * 3, ["pld"] * 3))
    verifier.commit([])
    assert verifier.cached_len == len(context)
    logits = verifier.tree_forward(11, Tree()).logits
    assert torch.allclose(logits[0], sequential_logits(model, context + [11]), atol=1e-5)


def test_tree_logits_equal_sequential_on_the_default_model(default_model):
    model, tok = default_model
    context = tok("def fibonacci(n):\n    if n < 2:\n        return n\n")["input_ids"]
    ret = tok(" return", add_special_tokens=False)["input_ids"]
    # A tree with two branches and a chain, tokens taken from plausible code continuations.
    cont = tok("    return fibonacci(n - 1) + fibonacci(n - 2)", add_special_tokens=False)
    a = cont["input_ids"][:4]
    tree = Tree(a + ret[:1] + [a[0]], [-1, 0, 1, 2, -1, 4], [0.5] * 6, ["pld"] * 6)
    verifier = TreeVerifier(model)
    verifier.prefill(context[:-1])
    logits = verifier.tree_forward(context[-1], tree).logits
    worst = 0.0
    for row, path in enumerate([[], *node_paths(tree)]):
        ref = sequential_logits(model, context + path)
        worst = max(worst, float((ref - logits[row]).abs().max()))
        assert int(ref.argmax()) == int(logits[row].argmax())
    assert worst < 2e-3, worst


def one_token_logits(verifier: TreeVerifier, context: list[int], path: list[int]
                     ) -> torch.Tensor:
    """The logits after context + path from one-token forwards of the verifier itself (plain
    decoding's forwards), the cache rolled back afterwards."""
    verifier.prefill(context[:-1])
    toks = [context[-1], *path]
    for t in toks[:-1]:
        verifier.tree_forward(t, Tree())
        verifier.commit([])
    out = verifier.tree_forward(toks[-1], Tree()).logits[0]
    verifier.commit([])
    return out


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "modules"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_exact_bfloat16_tree_rows_are_bitwise_one_token_forwards(kind, lean):
    """In bfloat16 the verifier's exact forwards make each tree row compute exactly what a
    one-token forward at its position does, whatever the tree (deep chains past the exact
    attention's cached body included): plain and speculative decoding then agree bit for bit
    even where bfloat16 logits tie."""
    model = tiny_model(kind, vocab=64, layers=2, init=0.2).to(torch.bfloat16)
    v = TreeVerifier(model, lean=lean)
    assert v.exact and v.kind.startswith("lean" if lean else "modules")
    rng = random.Random(1)
    for trial in range(5):
        context = [rng.randrange(64) for _ in range(rng.randrange(2, 60))]
        n = 40 if trial == 0 else rng.randrange(1, 20)
        tree = Tree.chain([rng.randrange(64) for _ in range(n)]) if trial == 0 \
            else random_tree(rng, n, 64)
        v.prefill(context[:-1])
        logits = v.tree_forward(context[-1], tree).logits
        v.commit([])
        for row, path in enumerate([[], *node_paths(tree)]):
            one = one_token_logits(v, context, path)
            assert torch.equal(one, logits[row]), (trial, row, len(path))


def test_on_blocks_plain_output_is_the_same_at_any_thread_count(default_model):
    """Every stage of a forward on the model file's blocks splits work across threads without
    splitting a reduction (prefill included), so the thread count never changes the tokens."""
    from redraft.decoder import Generator, block_linear

    model, tokenizer = default_model
    gen = Generator(model, tokenizer, None, model_name="smollm2-135m")
    if not gen.verifier.on_blocks:
        pytest.skip(f"no block path for float32 here ({block_linear.kernel_path(torch.float32)})")
    prompt = "Write a Python function that merges two sorted lists."
    before = torch.get_num_threads()
    outputs = {}
    try:
        for threads in sorted({1, 2, os.cpu_count() or 1}):
            torch.set_num_threads(threads)
            outputs[threads] = gen.generate(prompt, max_new_tokens=40, temperature=0).tokens
    finally:
        torch.set_num_threads(before)
    first = outputs[1]
    assert all(tokens == first for tokens in outputs.values()), {
        t: next((i for i, (a, b) in enumerate(zip(first, o)) if a != b), None)
        for t, o in outputs.items()}
