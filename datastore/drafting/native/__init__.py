"""The compiled drafting core: a session's whole step, new tokens in and merged tree out, in
one call into C++ (_core.cpp, built at install), and many sessions' steps in one call.

Why: the Python session drafter (redraft.datastore.drafting.session, which stays as the
reference these trees are tested against) spends most of a step creating per-node objects;
an engine drafting for a batch of sequences needs a step in microseconds. The core reads the
datastore's mapped arrays in place and keeps each session's prompt-lookup index and the
learned outputs in C++. Callers go through redraft.datastore.drafting, which picks it.
"""

from redraft.datastore.drafting.native.native_learned import NativeLearnedIndex
from redraft.datastore.drafting.native.native_session import (
    NativeSessionDrafter,
    native_step,
    native_step_flat,
)

__all__ = ["NativeLearnedIndex", "NativeSessionDrafter", "native_step", "native_step_flat"]
