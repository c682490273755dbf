"""Stage 1 of training Medusa heads: the target's hidden states over every answer position,
computed once and cached on disk, resumable after an interruption.

Tested by: tests/decoder/heads/test_heads.py"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from redraft.decoder.heads.training_data import Document
from redraft.decoder.kernels import cpu_has_bf16
from redraft.proto.files import cache_root, write_atomically
from tqdm import tqdm


def fast_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where matmuls in it are fast (GPUs, CPUs with bf16 units), else float32."""
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


class HiddenCache:
    """float16 hidden states [N, H] of some documents' answer positions, on disk.

    `progress.json` records how many documents are done; it is written only after the
    memory map was flushed, so a killed run loses at most one chunk.
    """

    def __init__(self, directory: Path, docs: Sequence[Document], hidden_size: int) -> None:
        self.dir = directory
        self.docs = list(docs)
        self.offsets = np.concatenate([[0], np.cumsum([d.positions for d in docs])])
        self.hidden_size = hidden_size
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "hidden.f16"
        shape = (int(self.offsets[-1]), hidden_size)
        mode = "r+" if path.is_file() and path.stat().st_size == 2 * shape[0] * shape[1] else "w+"
        if mode == "w+":
            self._write_progress(0)
        self.hidden = np.memmap(path, dtype=np.float16, mode=mode, shape=shape)

    @property
    def done(self) -> int:
        try:
            return int(json.loads((self.dir / "progress.json").read_text())["docs"])
        except (OSError, ValueError, KeyError):
            return 0

    def _write_progress(self, docs: int) -> None:
        progress = json.dumps({"docs": docs, "total": len(self.docs)})
        write_atomically(self.dir / "progress.json", lambda tmp: tmp.write_text(progress))

    @torch.inference_mode()
    def fill(self, model, desc: str, chunk: int = 32) -> None:
        """Run the target over every document not done yet."""
        base = model.base_model  # the decoder stack: its output is the post-norm hidden state
        device = next(model.parameters()).device
        start = self.done
        todo = self.docs[start:]
        if not todo:
            return
        bar = tqdm(total=int(self.offsets[-1] - self.offsets[start]), desc=desc, unit="tok",
                   unit_scale=True, dynamic_ncols=True, mininterval=1.0)
        for i, doc in enumerate(todo, start):
            ids = torch.tensor([doc.ids[: doc.end - 1]], device=device)
            hidden = base(input_ids=ids).last_hidden_state[0, doc.start - 1 :]
            self.hidden[self.offsets[i] : self.offsets[i + 1]] = (
                hidden.float().cpu().numpy().astype(np.float16))
            bar.update(doc.positions)
            if (i + 1) % chunk == 0 or i + 1 == len(self.docs):
                self.hidden.flush()
                self._write_progress(i + 1)
        bar.close()


def hidden_cache_dir() -> Path:
    """Where hidden states and checkpoints go unless `--cache-dir` says otherwise."""
    return cache_root() / "medusa"
