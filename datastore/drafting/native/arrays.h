// The working arrays' element storage: vectors whose resize leaves new elements unset, and
// the 128-bit integer that rank keys are.
//
// Part of the compiled drafting core: included by _core.cpp only, so that the core stays one
// translation unit (everything in the anonymous namespace, inlined as it was in one file).

#pragma once

#include <cstdint>
#include <memory>
#include <new>
#include <utility>
#include <vector>

namespace {

// An allocator whose resize leaves new elements unset: a tree's arrays and most working
// arrays are resized, then written in full, every step; zeroing them first cost a memset
// per array per step. (assign and resize with a value still fill.)
template <class T>
struct Unset : std::allocator<T> {
    template <class U>
    struct rebind {
        using other = Unset<U>;
    };
    Unset() = default;
    template <class U>
    Unset(const Unset<U>&) noexcept {}
    template <class U, class... Args>
    void construct(U* p, Args&&... args) {
        if constexpr (sizeof...(Args) == 0)
            ::new (static_cast<void*>(p)) U;
        else
            ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
    }
};
template <class T>
using Array = std::vector<T, Unset<T>>;

using u128 = unsigned __int128;

}  // namespace
