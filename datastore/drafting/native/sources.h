// The source bits: which drafter proposed a node (retrieval, prompt lookup, learned outputs),
// OR-ed where several did. Defined once, in Python (the wire's enum redraft.v1.Source holds the
// same values): the module's set_sources gives them to the core when the package is imported,
// before anything drafts, so the core has no copy of its own to drift.
// Python: redraft.proto.tree.SOURCE_BITS
//
// Part of the compiled drafting core: included by _core.cpp only, so that the core stays one
// translation unit (everything in the anonymous namespace, inlined as it was in one file).

#pragma once

#include <cstdint>

namespace {

struct SourceBits {
    uint8_t rest = 0, pld = 0, learned = 0;
    bool set = false;  // set_sources was called: Sessions and Learned indexes may be made
};
SourceBits g_sources;

}  // namespace
