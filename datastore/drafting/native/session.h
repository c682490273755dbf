// One generation's drafting state and its step: the context, the retrieval of its snapshot,
// its prompt-lookup index and its writer into the learned outputs; the step drafts from each
// source and merges the drafts.
// Python: redraft.datastore.drafting.session_drafter.SessionDrafter
//
// Part of the compiled drafting core: included by _core.cpp only, so that the core stays one
// translation unit (everything in the anonymous namespace, inlined as it was in one file).

#pragma once

#include "learned.h"
#include "prompt_lookup.h"
#include "retrieval.h"
#include "scratch.h"
#include "suffix_array.h"
#include "tree.h"
#include "tree_ops.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <vector>

namespace {

// Error codes a step returns instead of a tree; the Python wrapper then asks the reference
// for the exact exception (the same message, type and precedence as the Python drafter's).
// The module exports them (ERR_REST, ERR_TOKENS) for the wrapper.
constexpr int ERR_REST = 1;  // retrieval would raise (bad settings, ids, corpora, closed,
                              // damaged arrays)
constexpr int ERR_TOKENS = 2;  // (batched step) the accepted tokens were not token ids

// The Store and the Learned index are those of the Python objects that the session's own
// object holds (bindings): valid while it holds them.
struct SessionState {
    // retrieval
    const Store* store = nullptr;  // null: no retrieval
    std::vector<int32_t> shards;
    bool rest_ok = true;  // false: the reference's retrieval_tree would raise
    RestParams rest{};
    double scale = 1.0, power = 1.0;
    RestHint hint;
    // prompt lookup
    std::unique_ptr<PromptIndex> pld;
    // learned outputs
    Learned* learned = nullptr;  // null: none
    bool learned_drafts = false;
    Writer writer;
    // state
    std::vector<uint32_t> context;
    int64_t budget = 64, max_depth = 16;
    int64_t rest_match_len = 0, pld_match_len = 0, learned_match_len = 0;
    Tree t_rest, t_pld, t_learned, out;
    // the last batched step's: out's expected accepted tokens and the source bits it holds
    double expected = 0.0;
    uint8_t used = 0;
    std::vector<uint32_t> unlearned;  // a batched step's accepted tokens, until learned
};

// The accepted tokens into the context; learned now, or (learn_later: a batched step) kept
// in `unlearned` for learn_unlearned.
// Python: redraft.datastore.drafting.session_drafter.SessionDrafter.extend
void session_extend(SessionState* s, const std::vector<uint32_t>& toks, bool learn_later = false) {
    s->context.insert(s->context.end(), toks.begin(), toks.end());
    if (s->learned == nullptr) return;
    if (learn_later)
        s->unlearned.insert(s->unlearned.end(), toks.begin(), toks.end());
    else
        s->writer.extend(*s->learned, toks.data(), toks.size());
}

void learn_unlearned(SessionState* s) {
    if (s->unlearned.empty()) return;
    s->writer.extend(*s->learned, s->unlearned.data(), s->unlearned.size());
    s->unlearned.clear();
}

// The step's first part: the drafts from the session's own context (retrieval, prompt
// lookup). 0, or an error code (the tree is then empty, with no second part). `closed`:
// whether the session's Reader was closed (the bindings ask, with the GIL; without it, every
// step is plain C++ over the session's own state, the mapped arrays and the learned index
// under its shared lock).
// Python: redraft.datastore.drafting.session_drafter.SessionDrafter.propose
// Python: redraft.datastore.drafting.retrieval.calibrate
int propose_own(SessionState* s, int64_t budget, Scratch& scratch, bool closed) {
    s->rest_match_len = s->pld_match_len = s->learned_match_len = 0;
    s->t_rest.clear();
    s->t_pld.clear();
    s->t_learned.clear();
    if (s->store != nullptr && !s->context.empty()) {
        const Store& st = *s->store;
        int64_t n = std::min<int64_t>(s->rest.max_match, static_cast<int64_t>(s->context.size()));
        const uint32_t* tail = s->context.data() + s->context.size() - n;
        bool ok = s->rest_ok && budget >= 0;
        for (int64_t i = 0; ok && i < n; ++i) ok = tail[i] < st.vocab;
        if (!ok || closed) {
            s->out.clear();
            return ERR_REST;
        }
        RestParams p = s->rest;
        p.budget = budget;
        if (!rest_propose(st, s->shards, tail, n, p, s->t_rest, scratch, s->hint,
                          s->context.size())) {
            s->hint.valid = false;
            s->out.clear();
            return ERR_REST;  // damaged arrays: the reference raises DatastoreCorrupt
        }
        s->rest_match_len = s->t_rest.match_len;
        if (!(s->scale == 1.0 && s->power == 1.0))
            for (auto& q : s->t_rest.probs)  // pow(1, y) is 1 exactly (most REST probs are 1)
                q = s->scale * (q == 1.0 ? 1.0 : scratch.pow.pow(q, s->power));
    }
    if (s->pld) {
        s->pld->extend(s->context);
        s->pld->propose(s->context, budget, s->max_depth, s->t_pld, scratch);
        s->pld_match_len = s->t_pld.match_len;
    }
    return 0;
}

// The second part: the learned outputs' draft (which must see every token learned before
// the step), and the merge.
// Python: redraft.datastore.drafting.session_drafter.SessionDrafter.propose
void propose_learned(SessionState* s, int64_t budget, Scratch& scratch) {
    const Tree* drafts[3];
    int nd = 0;
    if (s->store != nullptr && !s->context.empty()) drafts[nd++] = &s->t_rest;
    if (s->pld) drafts[nd++] = &s->t_pld;
    if (s->learned != nullptr && s->learned_drafts) {
        Learned& index = *s->learned;
        {
            std::shared_lock<std::shared_mutex> lock(index.mu);
            index.propose(s->writer.tenant, s->context.data(),
                          static_cast<int64_t>(s->context.size()), budget, s->max_depth,
                          s->t_learned, scratch);
        }
        s->learned_match_len = s->t_learned.match_len;
        drafts[nd++] = &s->t_learned;
    }
    merge_trees(drafts, nd, budget, s->out, scratch);
    s->out.match_len = s->rest_match_len;
}

// Both parts. 0, or an error code.
// Python: redraft.datastore.drafting.session_drafter.SessionDrafter.propose
int session_propose(SessionState* s, int64_t budget, Scratch& scratch, bool closed) {
    int err = propose_own(s, budget, scratch, closed);
    if (err == 0) propose_learned(s, budget, scratch);
    return err;
}

}  // namespace
