// Benchmark-only kernels: the streaming-read floor every GEMV is measured against, and what
// a kernel boundary, a grid-wide barrier and a persistent kernel's hand-over cost.

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

__device__ __forceinline__ unsigned long long atom_add_release_u64(unsigned long long* p, unsigned long long v) {
    unsigned long long old;
    asm volatile("atom.add.release.gpu.global.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
    return old;
}
__device__ __forceinline__ unsigned long long ld_relaxed_u64(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// The polls of a grid barrier give up after 2^18 loads, so a grid that is not all resident
// ends (with a wrong time, and grid_phases with wrong sums) instead of hanging.
#define BARRIER_POLLS (1u << 18)

// A grid-wide barrier by a generation: thread 0 reads the generation, arrives on the count
// (bar[0]); the last to arrive resets the count and publishes the next generation (the
// release orders the reset before it), the others poll it. Four dependent trips through L2
// for the last arrival's news: the read, the add, the publish, the poll that sees it.
__device__ __forceinline__ void grid_barrier_by_generation(u32* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 gen = ld_acquire_u32(bar + 1);
        if (add_acq_rel_u32(bar, 1) == gridDim.x - 1) {
            bar[0] = 0;
            st_release_u32(bar + 1, gen + 1);
        } else {
            for (u32 polls = 0; ld_acquire_u32(bar + 1) == gen && polls < BARRIER_POLLS; polls++) {
            }
        }
    }
    __syncthreads();
}

// A grid-wide barrier on one 64-bit count that only grows: thread 0 adds 1 (release), and
// from the count before its add knows the round's end, the next multiple of the grid (every
// launch adds a multiple of it, so the count never needs a reset); it polls with relaxed loads
// and takes one acquire fence after. Two trips: the add, and the poll that sees the last add.
__device__ __forceinline__ void grid_barrier_by_count(unsigned long long* count) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned long long n = gridDim.x, end = (atom_add_release_u64(count, 1) / n + 1) * n;
        for (u32 polls = 0; ld_relaxed_u64(count) < end && polls < BARRIER_POLLS; polls++) {
        }
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
    }
    __syncthreads();
}

// `rounds` grid-wide barriers in one launch: what a persistent decode kernel (issue 36) pays
// per dependency where today's step pays a kernel boundary (chain_link). Launched with one CTA
// per SM, all resident. `by_count` picks grid_barrier_by_count (on bar as one 64-bit count)
// over grid_barrier_by_generation (bar[0] the count, bar[1] the generation).
extern "C" __global__ void __launch_bounds__(256, 1) grid_barriers(u32* bar, int rounds, int by_count) {
    for (int r = 0; r < rounds; r++) {
        if (by_count) grid_barrier_by_count(reinterpret_cast<unsigned long long*>(bar));
        else grid_barrier_by_generation(bar);
    }
}

// The weight of row `row`, column `k` of grid_phases' matrix: a hash's 10 bits as an integer
// in [-512, 511] over 2^14 (bench.rs computes the same).
__device__ __forceinline__ float phase_weight(u32 row, u32 k, u32 n) {
    u32 h = (row * n + k) * 0x9E3779B1u;
    h ^= h >> 15;
    h *= 0x85EBCA77u;
    h ^= h >> 13;
    return (float)((int)(h & 1023u) - 512) * (1.0f / 16384.0f);
}

// A persistent kernel's hand-over with data, `rounds` times in one launch: each round every
// CTA reads the whole vector the last round wrote (n floats, from L2: __ldcg), multiplies its
// rows of an n x n matrix held in shared memory (a weight tile loaded before its input is
// ready, as issue 36's kernel would hold it; f32 here, the bytes do not matter to the
// latency), writes tanh of each sum, and waits at a grid barrier. Round 0 reads x_in; the
// rounds then alternate between writing x_a and x_b. One CTA per SM, a warp a row at a time.
// Dynamic shared memory: rows_per_cta * n floats of weights, then n of x. n a multiple of 4.
extern "C" __global__ void __launch_bounds__(256, 1) grid_phases(u32* bar, const float* x_in, float* x_a, float* x_b,
                                                                  int n, int rows_per_cta, int rounds, int by_count) {
    extern __shared__ __align__(16) unsigned char phase_smem[];
    float* w = reinterpret_cast<float*>(phase_smem);
    float* xs = w + (size_t)rows_per_cta * n;
    const int row0 = blockIdx.x * rows_per_cta;
    for (int i = threadIdx.x; i < rows_per_cta * n; i += blockDim.x)
        w[i] = phase_weight(row0 + i / n, i % n, n);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    for (int r = 0; r < rounds; r++) {
        const float* src = r == 0 ? x_in : (r & 1) ? x_a : x_b;
        float* dst = (r & 1) ? x_b : x_a;
        for (int i = 4 * threadIdx.x; i < n; i += 4 * blockDim.x)
            *reinterpret_cast<float4*>(xs + i) = __ldcg(reinterpret_cast<const float4*>(src + i));
        __syncthreads();
        for (int lr = warp; lr < rows_per_cta && row0 + lr < n; lr += warps) {
            float acc = 0.0f;
            for (int k = lane; k < n; k += 32) acc = fmaf(w[lr * n + k], xs[k], acc);
            for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
            if (lane == 0) dst[row0 + lr] = tanhf(acc);
        }
        if (by_count) grid_barrier_by_count(reinterpret_cast<unsigned long long*>(bar));
        else grid_barrier_by_generation(bar);
    }
}
