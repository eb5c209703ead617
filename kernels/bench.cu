// Benchmark-only kernels: the streaming-read floor every GEMV is measured against.

typedef unsigned int u32;

// Reads n16 16-byte words with 16-byte loads, four in flight per thread, grid-stride; folds
// them into one word so the loads cannot be dropped, and writes it only on an impossible value.
extern "C" __global__ void __launch_bounds__(256) stream_read(const uint4* __restrict__ p, unsigned long long n16,
                                                                u32* sink) {
    u32 acc = 0;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 a = __ldg(p + i), b = __ldg(p + i + stride), c = __ldg(p + i + 2 * stride),
              d = __ldg(p + i + 3 * stride);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n16; i += stride) {
        uint4 a = __ldg(p + i);
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    if (acc == 0x9e3779b9u) *sink = acc;
}

// One link of a chain of dependent launches (the kernel-boundary microbenchmark): waits for
// the launch before it (programmatic dependent launch; a no-op in a launch without the
// attribute), lets the next one start launching, and bumps its CTA's counter, so each link
// depends on the last and does nothing else. Launched with one CTA per SM; dynamic shared
// memory (unused) sized by the host decides whether the next link's CTA can be resident
// beside this one.
extern "C" __global__ void __launch_bounds__(256, 1) chain_link(u32* counters) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    if (threadIdx.x == 0) counters[blockIdx.x] += 1;
}

// Acquire load, release store and acquire-release add at GPU scope (grid_barriers).
__device__ __forceinline__ u32 ld_acquire_u32(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_u32(u32* p, u32 v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 add_acq_rel_u32(u32* p, u32 v) {
    u32 old;
    asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

// `rounds` grid-wide barriers in one launch: what a persistent decode kernel (issue 36) pays
// per dependency where today's step pays a kernel boundary (chain_link). Launched with one CTA
// per SM, all resident. bar[0] counts arrivals, bar[1] is the generation: thread 0 reads the
// generation, arrives; the last to arrive resets the count and publishes the next generation
// (the release orders the reset before it), the others poll it. The poll gives up after 2^18
// loads, so a grid that is not all resident ends (with a wrong time) instead of hanging.
extern "C" __global__ void __launch_bounds__(256, 1) grid_barriers(u32* bar, int rounds) {
    for (int r = 0; r < rounds; r++) {
        __syncthreads();
        if (threadIdx.x == 0) {
            const u32 gen = ld_acquire_u32(bar + 1);
            if (add_acq_rel_u32(bar, 1) == gridDim.x - 1) {
                bar[0] = 0;
                st_release_u32(bar + 1, gen + 1);
            } else {
                for (u32 polls = 0; ld_acquire_u32(bar + 1) == gen && polls < (1u << 18); polls++) {
                }
            }
        }
        __syncthreads();
    }
}
