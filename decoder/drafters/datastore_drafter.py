"""`rest` in process (`--datastore DIR`): retrieval from a datastore opened in this process,
plus the outputs learned from this process's earlier generations.

It drafts through the same session drafter the draft service runs
(`redraft.datastore.drafting`: the compiled core unless REDRAFT_DRAFTING=python), so both
paths draft with the same tunings and trees, and opens it through the draft source
(`redraft.decoder.draft_source`) the engine adapters share. Output never changes: drafts only
affect speed.

Tested by: tests/decoder/drafters/test_datastore_drafter.py, tests/decoder/test_generate.py
"""

from __future__ import annotations

from collections.abc import Sequence

from redraft.datastore.drafting import DEFAULT_PARAMS, LearnedIndex
from redraft.decoder.draft_source import DraftSource
from redraft.decoder.drafters.source_drafter import SourceDrafter
from redraft.proto.errors import TokenizerMismatch
from redraft.proto.tree import DEFAULT_MAX_DEPTH, LEARNED, REST


class DatastoreDrafter(SourceDrafter):
    """Retrieval and learned outputs from a datastore opened in this process (no server).

    `tokenizer`: the target's tokenizer (or its fingerprint), checked against the datastore's
    at once; None leaves the check to the Generator this drafter joins, which passes its own
    (`check_tokenizer`). Drafting before either check raises TokenizerMismatch: drafts in
    another tokenizer's ids would be verified as garbage. `corpora`: retrieval from these only
    (each must exist). `learned`: the index of earlier outputs to draft from and add to (shared
    across this drafter's generations; pass one to share it further), None for retrieval only.
    """

    def __init__(self, path: str, tokenizer=None, max_depth: int = DEFAULT_MAX_DEPTH,
                 corpora: Sequence[str] | None = None,
                 learned: LearnedIndex | None = None) -> None:
        sources = (REST, LEARNED) if learned is not None else (REST,)
        params = DEFAULT_PARAMS.replace(max_depth=max_depth, sources=sources,
                                        corpora=tuple(corpora or ()))
        super().__init__(DraftSource(datastore=path, tokenizer=tokenizer, params=params,
                                     learned=learned))
        self.reader, self.learned = self.source.reader, learned

    def begin(self, prompt: Sequence[int]) -> None:
        if not self.source.tokenizer_checked:
            self.end()
            raise TokenizerMismatch(
                f"{self.reader.path}: no tokenizer was checked against this datastore's: pass "
                "DatastoreDrafter(path, tokenizer) or use the drafter in a Generator")
        super().begin(prompt)
