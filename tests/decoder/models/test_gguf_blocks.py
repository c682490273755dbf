"""The default model's GGUF blocks mapped onto its dense layers: every layer's blocks are its
dense weights bit for bit (query/key rows un-permuted as Hugging Face's loader does), the
header reader agrees with gguf-py's, and the verifier runs on them."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from redraft.decoder import block_linear
from redraft.decoder.models import gguf_blocks
from redraft.decoder.verify import TreeVerifier
from redraft.proto.models import resolve_model
from redraft.proto.tree import Tree

from ..conftest import have_default_model, tiny_model

pytestmark = pytest.mark.skipif(not have_default_model(), reason="default model not installed")


def gguf_path() -> str:
    source = resolve_model(None)
    return os.path.join(source.path, source.gguf_file)


def test_every_layers_blocks_are_its_dense_weights(default_model):
    model, _ = default_model
    blocks = gguf_blocks.block_weights(model)
    assert blocks is not None
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert set(blocks) == set(linears)  # every layer, the tied LM head included
    formats = set()
    for module in linears:
        formats.add(blocks[module].fmt)
        assert torch.equal(blocks[module].dense(), module.weight), module
    assert formats == {block_linear.FORMATS["Q4_1"], block_linear.FORMATS["Q8_0"]}
    assert sum(w.nbytes for w in blocks.values()) < 100e6  # the file's 96 MB, not 538


def test_the_header_reader_agrees_with_gguf_py():
    from gguf import GGUFReader

    arch, tensors = gguf_blocks.read_tensors(gguf_path())
    reader = GGUFReader(gguf_path())
    assert arch == reader.get_field("general.architecture").contents() == "llama"
    theirs = {t.name: t for t in reader.tensors if len(t.shape) == 2}
    assert set(tensors) == set(theirs)
    for name, mine in tensors.items():
        t = theirs[name]
        assert (mine.k, mine.n) == tuple(int(d) for d in t.shape[:2])
        assert mine.fmt == int(t.tensor_type)
        assert np.array_equal(mine.data.reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))


def test_a_model_not_loaded_from_a_gguf_file_has_no_blocks():
    assert gguf_blocks.block_weights(tiny_model("llama")) is None


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_blocks.read_tensors(bad)


def test_the_verifier_runs_on_blocks_and_computes_the_dense_copys_logits(default_model):
    """Same weights, another summation order: the logits agree to float32 rounding and the
    argmax is the same at every row."""
    model, _ = default_model
    if not block_linear.fast(torch.float32):
        path = block_linear.kernel_path(torch.float32)
        pytest.skip(f"float32 has no SIMD block path on this CPU ({path})")
    on_blocks, dense = TreeVerifier(model), TreeVerifier(model, block_weights=False)
    assert "blocks" in on_blocks.kind and "blocks" not in dense.kind
    ids = list(range(1000, 1040))
    tree = Tree.chain(ids[21:29])
    outs = []
    for v in (on_blocks, dense):
        v.prefill(ids[:20])
        outs.append(v.tree_forward(ids[20], tree).logits)
        v.commit([])
    assert on_blocks.packed_forwards == on_blocks.forwards  # every forward ran on blocks
    assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))
    assert (outs[0] - outs[1]).abs().max().item() < 1e-3


def test_a_model_whose_file_cannot_be_read_again_runs_dense(tmp_path):
    """The file changed or went away after loading: no blocks, no traceback (dense path)."""
    model = tiny_model("llama")
    bad = tmp_path / "gone.gguf"
    bad.write_bytes(b"GGUF\x03\x00")  # cut inside the header
    gguf_blocks.attach(model, bad)
    assert gguf_blocks.block_weights(model) is None
    other = tiny_model("llama")
    gguf_blocks.attach(other, tmp_path / "missing.gguf")
    assert gguf_blocks.block_weights(other) is None
