// The batched step: many sessions drafted in one call, on threads kept for it, each session's
// tree the one its own step would give.
// Python: redraft.datastore.drafting.batch_step.step_batch
//
// Part of the compiled drafting core: included by _core.cpp only, so that the core stays one
// translation unit (everything in the anonymous namespace, inlined as it was in one file).

#pragma once

#include "scratch.h"
#include "session.h"
#include "tree_ops.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace {

// Threads kept for the batched step (each keeps its own working memory warm): run(n, job)
// calls job(0) here and job(1..n-1) on n - 1 of them, and returns when all are done.
class Workers {
  public:
    void run(int n, const std::function<void(int)>& job) {
        std::unique_lock<std::mutex> lock(mu_);
        while (static_cast<int>(threads_.size()) < n - 1) {
            int index = static_cast<int>(threads_.size()) + 1;
            std::thread t([this, index] { serve(index); });
            t.detach();  // they live as long as the process
            threads_.push_back(index);
        }
        job_ = &job;
        wanted_ = n - 1;
        pending_ = n - 1;
        ++generation_;
        wake_.notify_all();
        lock.unlock();
        job(0);
        lock.lock();
        done_.wait(lock, [this] { return pending_ == 0; });
        job_ = nullptr;
    }

  private:
    void serve(int index) {
        uint64_t seen = 0;
        std::unique_lock<std::mutex> lock(mu_);
        for (;;) {
            wake_.wait(lock, [&] { return generation_ != seen; });
            seen = generation_;
            if (index > wanted_) continue;  // not needed this time
            const std::function<void(int)>* job = job_;
            lock.unlock();
            (*job)(index);
            lock.lock();
            if (--pending_ == 0) done_.notify_one();
        }
    }
    std::mutex mu_;
    std::condition_variable wake_, done_;
    std::vector<int> threads_;  // the indexes of the threads started
    const std::function<void(int)>* job_ = nullptr;
    int wanted_ = 0, pending_ = 0;
    uint64_t generation_ = 0;
};

// The batched step's threads, and the lock that lets one batch at a time use them. Neither
// is ever destroyed (the threads outlive main()). A forked child has none of its parent's
// threads, and may have inherited the lock held or the threads' condition variables waited
// on (a batch running in another thread): it starts afresh, the parent's objects left alone.
std::mutex* g_batch_lock = new std::mutex();
Workers* g_workers = nullptr;  // made by the first batch on more than one thread

void fresh_workers_after_fork() {
    g_batch_lock = new std::mutex();
    g_workers = nullptr;
}

Workers& workers() {  // the caller holds *g_batch_lock
    if (g_workers == nullptr) g_workers = new Workers();
    return *g_workers;
}

// The drafting of a batched step, once every session holds its accepted tokens (extended
// with learn_later): every session's tokens are learned, in order, and every session drafts
// with its budget, so that a session's tree is the same whatever the order or the threads.
// status[i] != 0: session i drafts nothing (an empty tree); closed[i]: session i's Reader
// was closed. Runs without the GIL (on `threads` threads when > 1): the sessions must not be
// used elsewhere meanwhile.
// Python: redraft.datastore.drafting.batch_step.step_batch
void draft_sessions(const std::vector<SessionState*>& st, const std::vector<int64_t>& budget,
                    std::vector<int32_t>& status, const std::vector<int32_t>& closed,
                    int threads, long long chain, Scratch& scratch) {
    int64_t n = static_cast<int64_t>(st.size());
    // A thread writes only to the sessions it drafts (and to `status` on a failure, which
    // is rare): threads drafting neighbours do not share cache lines.
    auto draft_own = [&](int64_t i, Scratch& sc) {
        int err = status[i];
        if (err == 0 && (err = propose_own(st[i], budget[i], sc, closed[i] != 0)) != 0)
            status[i] = err;
    };
    auto draft_finish = [&](int64_t i, Scratch& sc) {
        SessionState* s = st[i];
        if (status[i]) {
            s->out.clear();
            s->rest_match_len = s->pld_match_len = s->learned_match_len = 0;
        } else {
            propose_learned(s, budget[i], sc);
            if (chain > 0) best_chain(s->out, chain, sc);
        }
        s->expected = expected_accepted(s->out, sc);
        s->used = 0;
        for (uint8_t bit : s->out.bits) s->used |= bit;
    };
    int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, n)));
    if (nt == 1) {
        for (int64_t i = 0; i < n; ++i) learn_unlearned(st[i]);
        for (int64_t i = 0; i < n; ++i) {
            draft_own(i, scratch);
            draft_finish(i, scratch);
        }
    } else {
        std::lock_guard<std::mutex> lock(*g_batch_lock);
        // The first thread learns every session's tokens, in order, while the others
        // start drafting from the sessions' own contexts; the learned drafts wait until
        // it is done (a thread that drafted a session's first part before then keeps the
        // second for later). Sessions are handed out one at a time as threads come free:
        // a thread woken late or given long drafts does not hold the others back.
        std::atomic<bool> learned{false};
        std::atomic<int64_t> next{0};
        workers().run(nt, [&](int t) {
            Scratch& sc = step_scratch();
            if (t == 0) {
                for (int64_t i = 0; i < n; ++i) learn_unlearned(st[i]);
                learned.store(true, std::memory_order_release);
            }
            auto& later = sc.later;
            later.clear();
            for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
                draft_own(i, sc);
                if (learned.load(std::memory_order_acquire))
                    draft_finish(i, sc);
                else
                    later.push_back(i);
            }
            while (!later.empty() && !learned.load(std::memory_order_acquire))
                std::this_thread::yield();
            for (int64_t i : later) draft_finish(i, sc);
        });
    }
}

}  // namespace
