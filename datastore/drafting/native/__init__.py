"""The compiled drafting core: a session's whole step, new tokens in and merged tree out, in
one call into C++ (_core.cpp and the headers beside it, built at install), and many sessions'
steps in one call.

Why: the Python session drafter (redraft.datastore.drafting.session_drafter, which stays as the
reference these trees are tested against) spends most of a step creating per-node objects;
an engine drafting for a batch of sequences needs a step in microseconds. The core reads the
datastore's mapped arrays in place and keeps each session's prompt-lookup index and the
learned outputs in C++. Callers go through redraft.datastore.drafting, which picks it.
"""

from redraft.datastore.drafting.native import _core
from redraft.datastore.drafting.native.native_learned import NativeLearnedIndex
from redraft.datastore.drafting.native.native_session import (
    NativeSessionDrafter,
    native_step,
    native_step_flat,
)
from redraft.proto.tree import LEARNED, PLD, REST, SOURCE_BITS, source_label

# The source bits and their labels are defined once, in redraft.proto.tree: the core is given
# them here, when the package is first imported (before any module of it, the extension
# included, can be used); it makes no Session or Learned index before.
_core.set_sources(SOURCE_BITS[REST], SOURCE_BITS[PLD], SOURCE_BITS[LEARNED],
                  [source_label(bits) for bits in range(256)])

__all__ = ["NativeLearnedIndex", "NativeSessionDrafter", "native_step", "native_step_flat"]
