"""Corpus inputs -> documents. Each file, or each record of a .jsonl file, is one document.

Inputs are files, directories (walked recursively) and glob patterns. A .jsonl record gives
its text through `--field` (default `text`), or, failing that, a chat `messages` / `turns`
list or GSM8K-style `question` + `answer`. Anything unreadable or not UTF-8 is a
CorpusError naming the file, unless the caller asks to skip such files.
"""

from __future__ import annotations

import fnmatch
import glob
import logging
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from redraft.proto.errors import CorpusError
from redraft.proto.jsonl import parse_record

log = logging.getLogger("redraft.datastore.corpus")

# Files a directory walk leaves out: caches and obvious binaries. Named files are never
# filtered; a binary file named explicitly is reported as not UTF-8.
_SKIP_DIRS = {"__pycache__", "node_modules"}
_BINARY_SUFFIXES = {
    ".pyc", ".pyo", ".so", ".dll", ".dylib", ".o", ".a", ".exe", ".bin", ".gguf",
    ".png", ".jpg", ".jpeg", ".gif", ".ico", ".bmp", ".webp", ".pdf", ".zip", ".gz", ".bz2",
    ".xz", ".zst", ".tar", ".whl", ".egg", ".npy", ".npz", ".pt", ".safetensors", ".mdb",
    ".lmdb", ".wav", ".mp3", ".mp4", ".ttf", ".otf", ".woff", ".woff2", ".db", ".sqlite",
}


@dataclass(frozen=True)
class Document:
    name: str  # "path" or "path:line" for a .jsonl record
    text: str


def _is_glob(s: str) -> bool:
    return any(c in s for c in "*?[")


def _walk(root: Path) -> Iterator[Path]:
    """Regular files under `root`. Anything else a directory holds (a FIFO, whose read
    blocks forever; a device such as a link to /dev/zero, whose read never ends; a socket;
    a dangling link) is skipped with one line."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS)
        for f in sorted(filenames):
            if f.startswith(".") or Path(f).suffix.lower() in _BINARY_SUFFIXES:
                continue
            path = Path(dirpath) / f
            try:
                regular = stat.S_ISREG(os.stat(path).st_mode)  # follows links
            except OSError:
                regular = False
            if not regular:
                log.warning("%s: not a regular file (a FIFO, device, socket or "
                            "dangling link); skipped", path)
                continue
            yield path


def expand_inputs(inputs: Sequence[str | os.PathLike], exclude: Sequence[str] = ()) -> list[Path]:
    """Files named by the inputs, in a stable order, each once; excluded patterns dropped."""
    if not inputs:
        raise CorpusError("no input files given")
    seen: set[str] = set()
    out: list[Path] = []

    def add(p: Path) -> None:
        key = os.path.abspath(p)
        if key in seen or any(fnmatch.fnmatch(str(p), pat) or fnmatch.fnmatch(key, pat)
                              for pat in exclude):
            return
        seen.add(key)
        out.append(p)

    for item in inputs:
        s = os.fspath(item)
        p = Path(s).expanduser()
        if p.is_dir():
            for f in _walk(p):
                add(f)
        elif p.is_file():
            add(p)
        elif _is_glob(s):
            matches = sorted(glob.glob(os.path.expanduser(s), recursive=True))
            files = [Path(m) for m in matches if os.path.isfile(m)]
            if not files:
                raise CorpusError(f"{s}: pattern matches no files")
            for f in files:
                add(f)
        elif p.exists():
            raise CorpusError(f"{s}: not a regular file or directory")
        else:
            raise CorpusError(f"{s}: no such file or directory")
    if not out:
        raise CorpusError("the inputs name no files (all excluded or empty directories)")
    return out


def read_text(path: Path, source: Path | None = None) -> str:
    """The text of file `path` (read from `source` when given: the same file as another
    process names it)."""
    try:
        data = (source or path).read_bytes()
    except OSError as exc:
        raise CorpusError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorpusError(f"{path}: not UTF-8 text (byte {exc.start})") from exc


def _content(value) -> str:
    """Text of a chat message or turn: a string, or a dict with `content`/`value`/`text`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        for k in ("content", "value", "text"):
            if isinstance(value.get(k), str):
                return value[k]
    return ""


def record_text(rec: object, field: str | None) -> str | None:
    """The document text of one .jsonl record, or None when it has none we understand."""
    if not isinstance(rec, dict):
        return rec if isinstance(rec, str) else None
    if field is not None:
        v = rec.get(field)
        if isinstance(v, str):
            return v
        if isinstance(v, list):
            return "\n".join(_content(x) for x in v)
        return None
    if isinstance(rec.get("text"), str):
        return rec["text"]
    for key in ("messages", "turns", "conversations"):
        if isinstance(rec.get(key), list):
            return "\n".join(_content(x) for x in rec[key])
    q, a = rec.get("question"), rec.get("answer")
    if isinstance(q, str) and isinstance(a, str):
        return q + "\n" + a
    return None


def _record(path: Path, lineno: int, line: str, field: str | None) -> str:
    """The text of one .jsonl record, or CorpusError naming path:line."""
    rec = parse_record(line, f"{path}:{lineno}", CorpusError)
    doc = record_text(rec, field)
    if doc is None:
        what = (f"field {field!r}" if field
                else "'text', 'messages', 'turns' or 'question'+'answer'")
        raise CorpusError(f"{path}:{lineno}: record has no {what}")
    return doc


def _jsonl_docs(path: Path, source: Path | None, field: str | None,
                on_bad: Callable[[CorpusError], None] | None) -> Iterator[Document]:
    """One document per record. Records end at "\n" only: JSON text may hold U+2028 and
    other characters that str.splitlines() would also split on. A bad record raises, or,
    given `on_bad`, is reported there and skipped alone."""
    text = read_text(path, source)
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            doc = _record(path, lineno, line, field)
        except CorpusError as exc:
            if on_bad is None:
                raise
            on_bad(exc)
            continue
        if doc:
            yield Document(f"{path}:{lineno}", doc)


def iter_documents(
    inputs: Sequence[str | os.PathLike],
    *,
    field: str | None = None,
    exclude: Sequence[str] = (),
    skip_bad: bool = False,
    on_skip: Callable[[str], None] | None = None,
) -> Iterator[Document]:
    """Yield the documents of the inputs in order; empty documents are left out.

    `field=None` means the default (`text`, with chat and question/answer fallbacks).
    With `skip_bad`, unreadable / non-UTF-8 files and malformed .jsonl records are reported
    to `on_skip` (one call each) and skipped.
    """
    for path in expand_inputs(inputs, exclude):
        yield from file_documents(path, field=field, skip_bad=skip_bad, on_skip=on_skip)


def file_documents(
    path: Path,
    *,
    field: str | None = None,
    skip_bad: bool = False,
    on_skip: Callable[[str], None] | None = None,
    cwd: str | os.PathLike | None = None,
) -> Iterator[Document]:
    """The documents of one input file, as `iter_documents` yields them. `cwd`: the working
    directory a relative `path` was listed in (another process's, on another machine), so
    that the file is found there while its documents keep the names it was listed under."""

    def skip(exc: CorpusError) -> None:
        if on_skip is not None:
            on_skip(str(exc))

    source = Path(cwd) / path if cwd is not None and not path.is_absolute() else None
    try:
        if path.suffix.lower() == ".jsonl":
            yield from _jsonl_docs(path, source, field, skip if skip_bad else None)
        else:
            text = read_text(path, source)
            if text:
                yield Document(str(path), text)
    except CorpusError as exc:
        if not skip_bad:
            raise
        skip(exc)
