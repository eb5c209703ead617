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
// `cta_sync` meets the CTA's threads that take part (grid_layers': its consumer warps).
template <typename CtaSync>
__device__ __forceinline__ void grid_barrier_by_count(unsigned long long* count, CtaSync cta_sync) {
    cta_sync();
    if (threadIdx.x == 0) {
        const unsigned long long n = gridDim.x, end = (atom_add_release_u64(count, 1) / n + 1) * n;
        for (u32 polls = 0; ld_relaxed_u64(count) < end && polls < BARRIER_POLLS; polls++) {
        }
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
    }
    cta_sync();
}
__device__ __forceinline__ void grid_barrier_by_count(unsigned long long* count) {
    grid_barrier_by_count(count, [] { __syncthreads(); });
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
// first store, as the walks stage x: `store(i, v)` takes floats 4i .. 4i + 3. `threads`: the
// CTA's threads 0 .. threads - 1 share the work.
template <typename Store>
__device__ __forceinline__ void stage_vector(const float* src, int n, int threads, Store store) {
    const float4* src4 = reinterpret_cast<const float4*>(src);
    for (int base = threadIdx.x; base < n / 4; base += 12 * threads) {
        float4 v[12];
#pragma unroll
        for (int u = 0; u < 12; u++) {
            const int i = base + u * threads;
            if (i < n / 4) v[u] = __ldcg(src4 + i);
        }
#pragma unroll
        for (int u = 0; u < 12; u++) {
            const int i = base + u * threads;
            if (i < n / 4) store(i, v[u]);
        }
    }
}

// A hand-over without a barrier (NCCL's LL protocol): a writer stores each float with the
// round that wrote it, one 8-byte store (value bits low, tag high), and a reader polls each
// pair until it carries the round it waits for. An aligned 8-byte access is single-copy
// atomic, so a reader that sees the tag sees the value: no fence, no count, no atomics on one
// address from every SM, and a reader waits only for the writes it reads, where a barrier
// waits for the grid and then reads. Tags grow by round and the buffers alternate, so a stale
// pair never carries the tag waited for (a writer two rounds ahead would need this round's
// reads done everywhere first).
__device__ __forceinline__ void store_flagged(u32* dst, int i, float v, u32 tag) {
    const unsigned long long pair = ((unsigned long long)tag << 32) | __float_as_uint(v);
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(dst + 2 * i), "l"(pair) : "memory");
}
__device__ __forceinline__ uint4 load_flagged(const uint4* p) {  // two pairs: {v0, tag0, v1, tag1}
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}

// stage_vector for a vector of flagged pairs (n floats, 2n words): every pair polled until it
// carries `tag`, then `store(i, v)` takes floats 4i .. 4i + 3 (threads as stage_vector's). A
// pair that never does gives up after BARRIER_POLLS polls of the thread (the round goes on
// with a stale value: a wrong sum or time, not a hang).
// FLAGGED_QUADS: quads of x a thread asks for at once, 8 loads (12 spilled in a grid_layers of
// 512 threads and 128 registers).
#define FLAGGED_QUADS 4
template <typename Store>
__device__ __forceinline__ void stage_flagged(const u32* src, int n, int threads, u32 tag, Store store) {
    const uint4* src4 = reinterpret_cast<const uint4*>(src);
    u32 polls = 0;
    for (int base = threadIdx.x; base < n / 4; base += FLAGGED_QUADS * threads) {
        uint4 v[2 * FLAGGED_QUADS];
#pragma unroll
        for (int u = 0; u < 2 * FLAGGED_QUADS; u++) {
            const int i = base + (u / 2) * threads;
            if (i < n / 4) v[u] = load_flagged(src4 + 2 * i + u % 2);
        }
        // Every stale piece asked for again together: one round trip a poll, not one a piece.
        for (bool stale = true; stale && polls < BARRIER_POLLS; polls++) {
            stale = false;
#pragma unroll
            for (int u = 0; u < 2 * FLAGGED_QUADS; u++) {
                const int i = base + (u / 2) * threads;
                if (i < n / 4 && (v[u].y != tag || v[u].w != tag)) {
                    v[u] = load_flagged(src4 + 2 * i + u % 2);
                    stale = true;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < FLAGGED_QUADS; u++) {
            const int i = base + u * threads;
            if (i < n / 4)
                store(i, make_float4(__uint_as_float(v[2 * u].x), __uint_as_float(v[2 * u].z),
                                     __uint_as_float(v[2 * u + 1].x), __uint_as_float(v[2 * u + 1].z)));
        }
    }
}

// How a persistent kernel's rounds hand a vector on (grid_phases, grid_layers).
#define HANDOVER_BY_GENERATION 0  // plain floats, grid_barrier_by_generation
#define HANDOVER_BY_COUNT 1       // plain floats, grid_barrier_by_count
#define HANDOVER_FLAGGED 2        // flagged pairs (store_flagged), no barrier
#define HANDOVER_NONE 3           // none (grid_layers): the stream and the walks alone, a floor

// Waits for the phase of `parity` of a shared-memory mbarrier; false if it gave up (after 2^22
// tries: a broken pipeline ends with a wrong time, not a hang). sm_90.
__device__ __forceinline__ bool mbarrier_wait(unsigned long long* bar, u32 parity) {
    u32 done = 0;
#if __CUDA_ARCH__ >= 900
    const u32 mbar = (u32)__cvta_generic_to_shared(bar);
    for (u32 tries = 0; !done && tries < (1u << 22); tries++)
        asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(done)
                     : "r"(mbar), "r"(parity)
                     : "memory");
#endif
    return done;
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
// latency), writes tanh of each sum, and hands it on by `handover` (HANDOVER_*: a barrier
// after plain floats, or flagged pairs of round r + 1's tag). Round 0 reads x_in; the rounds
// then alternate between writing x_a and x_b (2n words each when flagged). One CTA per SM, a
// warp a row at a time. Dynamic shared memory: rows_per_cta * n floats of weights, then n of
// x. n a multiple of 4.
extern "C" __global__ void __launch_bounds__(256, 1) grid_phases(u32* bar, const float* x_in, float* x_a, float* x_b,
                                                                  int n, int rows_per_cta, int rounds, int handover) {
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
        const auto stage = [&](int i, float4 v) { reinterpret_cast<float4*>(xs)[i] = v; };
        if (handover == HANDOVER_FLAGGED && r > 0) stage_flagged(reinterpret_cast<const u32*>(src), n, blockDim.x, r, stage);
        else stage_vector(src, n, blockDim.x, stage);
        __syncthreads();
        for (int lr = warp; lr < rows_per_cta && row0 + lr < n; lr += warps) {
            float acc = 0.0f;
            for (int k = lane; k < n; k += 32) acc = fmaf(w[lr * n + k], xs[k], acc);
            for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
            if (lane == 0) {
                if (handover == HANDOVER_FLAGGED) store_flagged(reinterpret_cast<u32*>(dst), row0 + lr, tanhf(acc), r + 1);
                else dst[row0 + lr] = tanhf(acc);
            }
        }
        if (handover == HANDOVER_BY_COUNT) grid_barrier_by_count(reinterpret_cast<unsigned long long*>(bar));
        else if (handover == HANDOVER_BY_GENERATION) grid_barrier_by_generation(bar);
        else __syncthreads();  // xs is read by all before the next round stages over it
    }
}

// A skeleton of issue 36's persistent decode step, for its timing: `layers` layers of the 3B
// shape's five operators in one launch, a CTA an SM. Each operator's weights stream through a
// ring of `pages` shared-memory pages of `page` bytes by bulk copies (cp.async.bulk), which a
// producer warp asks for as soon as a page is free (its `empty` mbarrier, on which each consumer
// warp arrives after reading it) and the consumers wait for on its `full` mbarrier: the ring runs
// ahead across operators and layers, so the next operator's first pages load while this one
// finishes and its output is handed over (issue 36's design). Each operator's input vector is
// read from L2 after the hand-over (`handover`, HANDOVER_*: a grid barrier by count, flagged
// pairs, or none), and the NF4 walk's work done on every 16-byte chunk of weights as GEMV v2
// does it (16 lookups in the lane-copied f16-pair table, 16 f16x2 FMAs against the 16 pairs of
// x a thread holds in registers): what a persistent step would take before its real walks'
// scales, reductions and attention. Which pairs of x meet which chunk is a stand-in: a thread
// holds chunk tid % (K / 32) of x for the operator and meets every chunk it reads with it (a
// real walk's rows line up with its lanes; the skeleton's pages hold no rows), so the
// shared-memory traffic a chunk costs is the walk's: one 16-byte read of the page, 16
// conflict-free table reads. The attention is an operator of no weights (its hand-over alone).
// Each operator writes, per CTA, its rows' outputs (one value from the CTA's sum over its
// slice, enough to make the next operator depend on it). ops_rows / ops_k: the operators'
// rows and K; bytes of a CTA's slice: its rows x K x 17/32 (codes and f16 scales), in pages
// (the last one partial). `failed` is set where a wait gave up.
// Lost and removed (docs/lab.md, session 48, with the commits that held them): x read from
// shared memory beside each word with one copy of the table (58-62 us a layer: a quarter
// warp's x reads 4-way conflicted, its table reads ~3-way); each page refilled by thread 0
// after a __syncthreads of all (the ring alone 16-18 us a layer at 8 x 16 KB, a fixed ~0.6 us
// a page; the producer warp: 11.4); each operator's pages asked for only after its barrier
// (+0.6-2.9 us a layer); 16 walking warps (+4 us a layer); two chunks at a time into eight
// sums (17.5 against 17.8 us without hand-overs, 31.6 against 30.7 with barriers).
#define GL_MAX_PAGES 16
#define GL_OPS 5
#define GL_MAX_K 11008
#define GL_THREADS 256  // the consumers; one more warp is the producer
struct GridLayerArgs {
    const unsigned char* w;  // layers x (the slices of every operator, CTA by CTA)
    float* x_a;              // the vectors handed over, GL_MAX_K floats each
    float* x_b;
    u32* bar;                // grid_barrier_by_count's count (8 bytes)
    u32* failed;
    int ops_rows[GL_OPS];
    int ops_k[GL_OPS];
    int layers;
    int handover;  // HANDOVER_BY_COUNT, _FLAGGED (x_a and x_b hold GL_MAX_K pairs) or _NONE
    int walk;      // 0: each page waited for and released unread (the ring's own pace)
    int page;      // bytes of a page, a multiple of 16
    int pages;     // pages of the ring, up to GL_MAX_PAGES
    int _pad;
};
static_assert(sizeof(GridLayerArgs) == 104, "GridLayerArgs differs from the host's (src/cuda/bench.rs)");

__device__ __forceinline__ u32 gl_slice_bytes(int rows, int k) {
    const u32 rows_cta = (rows + gridDim.x - 1) / gridDim.x;
    return (rows_cta * (u32)k * 17u / 32u + 15u) & ~15u;
}

// The consumer warps' own barrier (named barrier 1): the producer never meets them.
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(GL_THREADS) : "memory"); }

extern "C" __global__ void __launch_bounds__(GL_THREADS + 32, 1) grid_layers(GridLayerArgs a) {
#if __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) unsigned char gl_smem[];
    const u32 page_bytes = a.page, ring = a.pages;
    unsigned char* pages = gl_smem;                                  // ring x page_bytes
    u32* xh = reinterpret_cast<u32*>(gl_smem + ring * page_bytes);  // x as f16 pairs
    __shared__ __align__(16) u32 lut[BYTE_LUT_WORDS];
    __shared__ __align__(8) unsigned long long full[GL_MAX_PAGES], empty[GL_MAX_PAGES];
    __shared__ float sums[GL_THREADS / 32];
    const int tid = threadIdx.x;
    const u32 lane4 = 4u * (tid & 31);
    if (tid < GL_THREADS) load_byte_codebook<GL_THREADS>(lut);
    if (tid == 0)
        for (u32 p = 0; p < ring; p++) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"((u32)__cvta_generic_to_shared(&full[p])));
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"((u32)__cvta_generic_to_shared(&empty[p])),
                         "n"(GL_THREADS / 32));
        }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();

    // The pages of the whole launch in order: operator o of layer l, page i of the CTA's slice.
    u32 per_layer = 0, op_off[GL_OPS], op_pages[GL_OPS], total_pages = 0;
    for (int o = 0; o < GL_OPS; o++) {
        op_off[o] = per_layer;
        const u32 s = a.ops_rows[o] ? gl_slice_bytes(a.ops_rows[o], a.ops_k[o]) : 0;
        op_pages[o] = (s + page_bytes - 1) / page_bytes;
        per_layer += s * gridDim.x;
        total_pages += op_pages[o];
    }

    if (tid >= GL_THREADS) {  // the producer: one lane asks for every page once its slot is free
        if (tid == GL_THREADS)
            for (u32 g = 0; g < total_pages * a.layers; g++) {
                const u32 slot = g % ring;
                if (g >= ring && !mbarrier_wait(&empty[slot], (g / ring - 1) & 1)) {
                    atomicExch(a.failed, 1u);
                    break;
                }
                const u32 l = g / total_pages;
                u32 i = g % total_pages;
                int o = 0;
                for (; i >= op_pages[o]; o++) i -= op_pages[o];
                const u32 s = gl_slice_bytes(a.ops_rows[o], a.ops_k[o]);
                const u32 bytes = min(page_bytes, s - i * page_bytes);
                const unsigned char* src =
                    a.w + (size_t)l * per_layer + op_off[o] + (size_t)blockIdx.x * s + (size_t)i * page_bytes;
                push_barrier_expect(&full[slot], bytes);  // common.cuh: the page's bytes armed
                const u32 mbar = (u32)__cvta_generic_to_shared(&full[slot]);
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                                 (u32)__cvta_generic_to_shared(pages + slot * page_bytes)),
                             "l"(src), "r"(bytes), "r"(mbar)
                             : "memory");
            }
        return;
    }

    u32 g = 0;  // the next page to consume
    int step = 0;
    for (int l = 0; l < a.layers; l++) {
        for (int o = 0; o < GL_OPS; o++, step++) {
            const float* src = (step & 1) ? a.x_a : a.x_b;
            float* dst = (step & 1) ? a.x_b : a.x_a;
            const int k = a.ops_k[o];
            if (step > 0 && a.handover == HANDOVER_BY_COUNT)
                grid_barrier_by_count(reinterpret_cast<unsigned long long*>(a.bar), consumers_sync);
            const auto stage = [&](int i, float4 v) {
                xh[2 * i] = pack_f16x2(v.x, v.y);
                xh[2 * i + 1] = pack_f16x2(v.z, v.w);
            };
            if (step > 0 && a.handover == HANDOVER_FLAGGED)
                stage_flagged(reinterpret_cast<const u32*>(src), k, GL_THREADS, step, stage);
            else if (step == 0 || a.handover != HANDOVER_NONE) stage_vector(src, k, GL_THREADS, stage);
            consumers_sync();
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
                const u32 slot = g % ring;
                if (!mbarrier_wait(&full[slot], (g / ring) & 1) && tid == 0) atomicExch(a.failed, 1u);
                const u32 bytes = min(page_bytes, s - i * page_bytes);
                const uint4* page = reinterpret_cast<const uint4*>(pages + slot * page_bytes);
                for (u32 j = tid; a.walk && j < bytes / 16; j += GL_THREADS) {
                    const uint4 q = page[j];
                    const u32 words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
                    for (int e = 0; e < 4; e++)
#pragma unroll
                        for (int b = 0; b < 4; b++)
                            acc[e] = hfma2(byte_lut_entry(lut, words[e], b, lane4), xr[4 * e + b], acc[e]);
                }
                __syncwarp();  // the warp's reads of the page done: one arrival for the warp
                if (tid % 32 == 0)
                    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"((u32)__cvta_generic_to_shared(&empty[slot]))
                                 : "memory");
            }
            // The CTA's sum, one value for each of its rows.
            float v = half2_sum(acc[0]) + half2_sum(acc[1]) + half2_sum(acc[2]) + half2_sum(acc[3]);
            for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
            if (tid % 32 == 0) sums[tid / 32] = v;
            consumers_sync();
            const int rows = a.ops_rows[o] ? a.ops_rows[o] : a.ops_k[(o + 1) % GL_OPS];  // the attention hands on q
            const int rows_cta = (rows + gridDim.x - 1) / gridDim.x;
            const int next_k = a.ops_k[(o + 1) % GL_OPS];
            for (int r = tid; r < rows_cta; r += GL_THREADS) {
                const int row = blockIdx.x * rows_cta + r;
                float t = 0.0f;
                for (int w = 0; w < GL_THREADS / 32; w++) t += sums[w];
                const float v = tanhf(t * 1e-3f + 1e-3f * r);
                if (row >= next_k) continue;
                if (a.handover == HANDOVER_FLAGGED) store_flagged(reinterpret_cast<u32*>(dst), row, v, step + 1);
                else dst[row] = v;
            }
        }
    }
#else
    if (threadIdx.x == 0 && blockIdx.x == 0) *a.failed = 2u;  // needs sm_90's bulk copies
#endif
}
