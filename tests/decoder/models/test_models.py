"""The models package's defaults: the dtype a model loads in where none is given."""

from __future__ import annotations

import torch


def test_the_cpu_default_dtype_is_bfloat16_only_with_bf16_units():
    from redraft.decoder.kernels import cpu_has_bf16
    from redraft.decoder.models.loading import resolve_dtype

    expected = torch.bfloat16 if cpu_has_bf16() else torch.float32
    assert resolve_dtype(None, "cpu") == resolve_dtype("auto", "cpu") == expected
    assert resolve_dtype("float32", "cpu") == torch.float32
    assert resolve_dtype(None, "cuda") == torch.bfloat16
