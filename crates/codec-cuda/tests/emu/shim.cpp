// Host build of kernels.cu for the emulation tests: every launch runs its
// threads one after another. The kernels never depend on another thread of
// the same launch, so this gives the GPU's results exactly.
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

struct Dim { unsigned x, y, z; };
// Per OS thread: the test harness runs several emulated encoders at once.
static thread_local Dim threadIdx, blockIdx, blockDim;
#define __global__
#define __device__
#define __forceinline__ inline

#include KERNELS

typedef unsigned long long arg_t;

template <typename T> static T conv(arg_t v) {
    if constexpr (std::is_pointer_v<T>) return reinterpret_cast<T>(static_cast<std::uintptr_t>(v));
    else return static_cast<T>(v);
}

template <typename... P, std::size_t... I>
static void call(void (*f)(P...), const arg_t *a, std::index_sequence<I...>) { f(conv<P>(a[I])...); }

template <typename... P>
static void run(void (*f)(P...), unsigned threads, const arg_t *a) {
    const unsigned block = 128;
    blockDim = {block, 1, 1};
    for (unsigned b = 0; b * block < threads || b == 0; b++) {
        blockIdx = {b, 0, 0};
        for (unsigned t = 0; t < block; t++) {
            threadIdx = {t, 0, 0};
            call(f, a, std::index_sequence_for<P...>{});
        }
    }
}

#define EXPORT(name) \
    extern "C" void emu_##name(unsigned threads, const arg_t *args) { run(name, threads, args); }

EXPORT(zero_chunks)
EXPORT(xbz_lookup)
EXPORT(rle_chunks)
EXPORT(dedup_chunks)
EXPORT(page_sizes)
EXPORT(scan_offsets)
EXPORT(pack)
EXPORT(xbz_touch)
EXPORT(dedup_touch)
