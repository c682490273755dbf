"""The default model's dense copy in the cache: the same weights as de-quantising its GGUF
file in any dtype, converted again when the cache entry is damaged, and then read without
touching the GGUF file."""

from __future__ import annotations

import pytest
import torch
from redraft.decoder.models import loading
from redraft.proto.models import resolve_model

from ..conftest import have_default_model

pytestmark = pytest.mark.skipif(not have_default_model(), reason="default model not installed")


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


def gguf_reads(monkeypatch) -> list[str]:
    """Records each de-quantisation of a GGUF file from here on."""
    reads: list[str] = []
    original = loading._from_pretrained

    def recording(source, path, torch_dtype, **kwargs):
        if kwargs.get("gguf_file"):
            reads.append(kwargs["gguf_file"])
        return original(source, path, torch_dtype, **kwargs)

    monkeypatch.setattr(loading, "_from_pretrained", recording)
    return reads


def test_a_damaged_cache_entry_is_converted_again_then_read_from_the_cache(
        tmp_path, monkeypatch, default_model):
    monkeypatch.setenv("REDRAFT_CACHE", str(tmp_path))
    source = resolve_model(None)
    entry = tmp_path / "models" / loading.gguf_key(source,
                                                   f"|{loading.transformers.__version__}")
    entry.mkdir(parents=True)
    (entry / "config.json").write_text("{not json")  # an interrupted or foreign entry
    reads = gguf_reads(monkeypatch)
    converted = loading.dense_weights(source, torch.float32)
    assert reads == [source.gguf_file]
    assert {"config.json", "model.safetensors"} <= {p.name for p in entry.iterdir()}
    cached = loading.dense_weights(source, torch.float32)
    assert reads == [source.gguf_file]  # the second load never read the GGUF file
    assert same_weights(converted, default_model[0]) and same_weights(cached, converted)
    assert cached.generation_config.to_dict() == default_model[0].generation_config.to_dict()


def test_the_cached_copy_cast_to_bfloat16_is_the_gguf_file_loaded_in_bfloat16(default_model):
    """What makes the cache one copy for every dtype: casting the float32 copy rounds as
    loading the GGUF file in that dtype does."""
    source = resolve_model(None)
    direct = loading._from_pretrained(source, source.path, torch.bfloat16,
                                      gguf_file=source.gguf_file)
    assert same_weights(loading.dense_weights(source, torch.bfloat16), direct)
