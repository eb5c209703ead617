// Benchmark-only kernels: the streaming-read floor every GEMV is measured against, and what a
// kernel boundary, a grid-wide barrier and a persistent kernel's hand-over cost. Compiled after
// common.cuh (src/cuda/kernels.rs `BENCH`).

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

// Every CTA's copy of a vector another CTA of the launch wrote (n floats, n a multiple of 4,
// read from L2: __ldcg), 16 bytes at a time with up to 12 loads in flight a thread before the
// first store, as the walks stage x: `store(i, v)` takes floats 4i .. 4i + 3.
template <typename Store>
__device__ __forceinline__ void stage_vector(const float* src, int n, Store store) {
    const float4* src4 = reinterpret_cast<const float4*>(src);
    for (int base = threadIdx.x; base < n / 4; base += 12 * blockDim.x) {
        float4 v[12];
#pragma unroll
        for (int u = 0; u < 12; u++) {
            const int i = base + u * blockDim.x;
            if (i < n / 4) v[u] = __ldcg(src4 + i);
        }
#pragma unroll
        for (int u = 0; u < 12; u++) {
            const int i = base + u * blockDim.x;
            if (i < n / 4) store(i, v[u]);
        }
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
        stage_vector(src, n, [&](int i, float4 v) { reinterpret_cast<float4*>(xs)[i] = v; });
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

// A skeleton of issue 36's persistent decode step, for its timing: `layers` layers of the 3B
// shape's five operators in one launch, a CTA an SM, each operator's weights streamed through
// a ring of GL_PAGES shared-memory pages by bulk copies (cp.async.bulk, counted on a page's
// mbarrier), its input vector read from L2 after a grid barrier, and the NF4 walk's work on
// every 16-byte chunk of weights as GEMV v2 does it (16 lookups in the lane-copied f16-pair
// table, 16 f16x2 FMAs against the 16 pairs of x a thread holds in registers): what a
// persistent kernel's step would take before its real walks' scales, reductions and
// attention. Which pairs of x meet which chunk is a stand-in: a thread holds chunk tid % (K / 32)
// of x for the operator and meets every chunk it reads with it (a real walk's rows line up
// with its lanes; the skeleton's pages hold no rows), so the shared-memory traffic a chunk
// costs is the walk's: one 16-byte read of the page, 16 conflict-free table reads. Why not x
// read from shared memory beside each word with one copy of the table (bd2ed4c): a quarter
// warp's x reads, 64 bytes apart, conflicted 4-way and its table reads ~3-way, and those set
// the pace, 58-62 us a layer (docs/lab.md, session 48). With `ahead` the ring runs across
// operators and layers, so the next operator's first pages load while this one finishes and the grid waits (issue 36's design);
// without it, an operator's first pages are asked for only after its barrier (a kernel
// boundary's order, with the hand-over of a barrier). The attention is an operator of no
// weights (its hand-over alone). Each operator writes, per CTA, its rows' outputs (one value
// from the CTA's sum over its slice, enough to make the next operator depend on it).
// ops_rows / ops_k: the operators' rows and K; bytes of a CTA's slice: its rows x K x 17/32
// (codes and f16 scales), in pages of GL_PAGE bytes (the last one partial). `failed` is set
// where a wait gave up (a broken pipeline ends with a wrong time, not a hang).
#define GL_PAGE 16384
#define GL_PAGES 8
#define GL_OPS 5
#define GL_MAX_K 11008
struct GridLayerArgs {
    const unsigned char* w;  // layers x (the slices of every operator, CTA by CTA)
    float* x_a;              // the vectors handed over, GL_MAX_K floats each
    float* x_b;
    u32* bar;                // grid_barrier_by_count's count (8 bytes)
    u32* failed;
    int ops_rows[GL_OPS];
    int ops_k[GL_OPS];
    int layers;
    int ahead;
};
static_assert(sizeof(GridLayerArgs) == 88, "GridLayerArgs differs from the host's (src/cuda/bench.rs)");

__device__ __forceinline__ u32 gl_slice_bytes(int rows, int k) {
    const u32 rows_cta = (rows + gridDim.x - 1) / gridDim.x;
    return (rows_cta * (u32)k * 17u / 32u + 15u) & ~15u;
}

extern "C" __global__ void __launch_bounds__(256, 1) grid_layers(GridLayerArgs a) {
#if __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) unsigned char gl_smem[];
    unsigned char* pages = gl_smem;                                          // GL_PAGES x GL_PAGE
    u32* xh = reinterpret_cast<u32*>(gl_smem + GL_PAGES * GL_PAGE);          // x as f16 pairs
    __shared__ __align__(16) u32 lut[BYTE_LUT_WORDS];
    __shared__ __align__(8) unsigned long long full[GL_PAGES];
    __shared__ float sums[8];
    const int tid = threadIdx.x;
    const u32 lane4 = 4u * (tid & 31);
    load_byte_codebook<256>(lut);
    if (tid == 0)
        for (int p = 0; p < GL_PAGES; p++)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"((u32)__cvta_generic_to_shared(&full[p])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();

    // The pages of the whole launch in order: operator o of layer l, page i of the CTA's slice.
    u32 per_layer = 0, op_off[GL_OPS], op_pages[GL_OPS], total_pages = 0;
    for (int o = 0; o < GL_OPS; o++) {
        op_off[o] = per_layer;
        const u32 s = a.ops_rows[o] ? gl_slice_bytes(a.ops_rows[o], a.ops_k[o]) : 0;
        op_pages[o] = (s + GL_PAGE - 1) / GL_PAGE;
        per_layer += s * gridDim.x;
        total_pages += op_pages[o];
    }
    const u32 all_pages = total_pages * a.layers;
    // Global page g -> its layer, operator, page in the slice (loops over 5 operators).
    auto locate = [&](u32 g, u32& l, int& o, u32& i) {
        l = g / total_pages;
        i = g % total_pages;
        for (o = 0; i >= op_pages[o]; o++) i -= op_pages[o];
    };
    auto issue = [&](u32 g) {  // thread 0
        u32 l, i;
        int o;
        locate(g, l, o, i);
        const u32 s = gl_slice_bytes(a.ops_rows[o], a.ops_k[o]);
        const u32 bytes = min((u32)GL_PAGE, s - i * GL_PAGE);
        const unsigned char* src = a.w + (size_t)l * per_layer + op_off[o] + (size_t)blockIdx.x * s + (size_t)i * GL_PAGE;
        const u32 slot = g % GL_PAGES;
        const u32 mbar = (u32)__cvta_generic_to_shared(&full[slot]);
        const u32 dst = (u32)__cvta_generic_to_shared(pages + slot * GL_PAGE);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(mbar), "r"(bytes) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                     "l"(src), "r"(bytes), "r"(mbar)
                     : "memory");
    };
    u32 issued = 0;  // pages asked for (thread 0's count; the others never read it)
    if (tid == 0 && a.ahead)
        for (; issued < min((u32)GL_PAGES, all_pages); issued++) issue(issued);

    u32 g = 0;  // the next page to consume
    int step = 0;
    for (int l = 0; l < a.layers; l++) {
        for (int o = 0; o < GL_OPS; o++, step++) {
            const float* src = (step & 1) ? a.x_a : a.x_b;
            float* dst = (step & 1) ? a.x_b : a.x_a;
            const int k = a.ops_k[o];
            if (step > 0) grid_barrier_by_count(reinterpret_cast<unsigned long long*>(a.bar));
            if (tid == 0 && !a.ahead)  // a kernel boundary's order: this operator's pages now
                for (; issued < min(g + GL_PAGES, g + op_pages[o]); issued++) issue(issued);
            stage_vector(src, k, [&](int i, float4 v) {
                xh[2 * i] = pack_f16x2(v.x, v.y);
                xh[2 * i + 1] = pack_f16x2(v.z, v.w);
            });
            __syncthreads();
            u32 xr[16];  // this thread's chunk of x (see above), 16 f16 pairs
            const int chunk = tid % (k / 32);
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const uint4 v = reinterpret_cast<const uint4*>(xh + 16 * chunk)[q];
                xr[4 * q] = v.x, xr[4 * q + 1] = v.y, xr[4 * q + 2] = v.z, xr[4 * q + 3] = v.w;
            }
            u32 acc[4] = {0, 0, 0, 0};  // f16x2 sums, as the walks keep them
            const u32 s = a.ops_rows[o] ? gl_slice_bytes(a.ops_rows[o], k) : 0;
            for (u32 i = 0; i < op_pages[o]; i++, g++) {
                const u32 slot = g % GL_PAGES, parity = (g / GL_PAGES) & 1;
                const u32 mbar = (u32)__cvta_generic_to_shared(&full[slot]);
                u32 done = 0, tries = 0;
                while (!done && tries++ < (1u << 22))
                    asm volatile(
                        "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
                        : "=r"(done)
                        : "r"(mbar), "r"(parity)
                        : "memory");
                if (!done && tid == 0) atomicExch(a.failed, 1u);
                const u32 bytes = min((u32)GL_PAGE, s - i * GL_PAGE);
                const uint4* page = reinterpret_cast<const uint4*>(pages + slot * GL_PAGE);
                for (u32 j = tid; j < bytes / 16; j += blockDim.x) {
                    const uint4 q = page[j];
                    const u32 words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
                    for (int e = 0; e < 4; e++)
#pragma unroll
                        for (int b = 0; b < 4; b++)
                            acc[e] = hfma2(byte_lut_entry(lut, words[e], b, lane4), xr[4 * e + b], acc[e]);
                }
                __syncthreads();  // the page read by all: free for the copy GL_PAGES ahead
                if (tid == 0) {
                    const u32 limit = a.ahead ? all_pages : g + 1 + (op_pages[o] - 1 - i);
                    if (issued < min(g + 1 + GL_PAGES, limit)) issue(issued++);
                }
            }
            // The CTA's sum, one value for each of its rows.
            float v = half2_sum(acc[0]) + half2_sum(acc[1]) + half2_sum(acc[2]) + half2_sum(acc[3]);
            for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
            if (tid % 32 == 0) sums[tid / 32] = v;
            __syncthreads();
            const int rows = a.ops_rows[o] ? a.ops_rows[o] : a.ops_k[(o + 1) % GL_OPS];  // the attention hands on q
            const int rows_cta = (rows + gridDim.x - 1) / gridDim.x;
            const int next_k = a.ops_k[(o + 1) % GL_OPS];
            for (int r = tid; r < rows_cta; r += blockDim.x) {
                const int row = blockIdx.x * rows_cta + r;
                float t = 0.0f;
                for (int w8 = 0; w8 < 8; w8++) t += sums[w8];
                if (row < next_k) dst[row] = tanhf(t * 1e-3f + 1e-3f * r);
            }
        }
    }
#else
    if (threadIdx.x == 0 && blockIdx.x == 0) *a.failed = 2u;  // needs sm_90's bulk copies
#endif
}
