"""The source bits are defined once, in redraft.proto.tree: the compiled core drafts with the
bits and labels it is given at import, so a new definition there is what both the core's
arrays and its trees' labels carry, with no copy in the C++ to update."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from redraft.datastore.drafting.native import _core

# In a fresh interpreter: the bits redefined before the core is imported, then one generation
# learned and a second one drafted from retrieval, prompt lookup and the learned output at
# once, by the core and by the Python reference.
CODE = """
import json, sys
from redraft.proto import tree
from redraft.proto.tree import LEARNED, PLD, REST
tree.SOURCE_BITS.update({REST: 16, PLD: 64, LEARNED: 128})
from redraft.datastore import Reader
from redraft.datastore.drafting.learned_index import LearnedIndex
from redraft.datastore.drafting.native import NativeLearnedIndex, NativeSessionDrafter
from redraft.datastore.drafting.session_drafter import DraftSettings, SessionDrafter

path, doc = sys.argv[1], json.loads(sys.argv[2])
settings = DraftSettings()  # every source
out = {"bits": [], "labels": [], "same": True}
with Reader(path) as reader:
    learned = NativeLearnedIndex(), LearnedIndex()
    for native, ref in [(NativeSessionDrafter(doc[:8], settings, reader, learned[0]),
                         SessionDrafter(doc[:8], settings, reader, learned[1])) for _ in range(2)]:
        for at in range(8, len(doc), 3):
            native.extend(doc[at:at + 3])
            ref.extend(doc[at:at + 3])
            got, want = native.propose(), ref.propose()
            out["same"] &= (got.tokens, got.sources) == (want.tokens, want.sources)
            out["labels"] += got.sources
            out["bits"] += native.propose_arrays()[3].tolist()
        native.close()
        ref.close()
print(json.dumps(out))
"""


def test_the_core_drafts_with_the_bits_python_defines(narrow_store):
    doc = max(narrow_store.docs, key=len)
    done = subprocess.run([sys.executable, "-c", CODE, str(narrow_store.path), json.dumps(doc)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["same"]
    labels = {"rest": 16, "pld": 64, "learned": 128}
    # every source drafted, alone and agreeing with another
    assert {"rest", "pld", "learned"} <= set(out["labels"])
    assert any("+" in label for label in out["labels"])
    assert out["bits"] == [sum(labels[s] for s in label.split("+")) for label in out["labels"]]


LABELS = [str(bits) for bits in range(256)]


@pytest.mark.parametrize("bits", [(1, 2, 3), (1, 1, 4), (0, 2, 4), (1, 2, 256), (-1, 2, 4)])
def test_bits_that_are_not_distinct_single_bits_are_refused(bits):
    with pytest.raises(ValueError, match="distinct single bits"):
        _core.set_sources(*bits, LABELS)


@pytest.mark.parametrize("labels, error", [(LABELS[:8], ValueError),
                                           (LABELS[:255] + [3], TypeError), (None, TypeError)])
def test_labels_must_be_one_string_per_set_of_bits(labels, error):
    with pytest.raises(error, match="256 strings"):
        _core.set_sources(1, 2, 4, labels)
