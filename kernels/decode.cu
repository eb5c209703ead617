// decodev2 decode-step kernels, compiled at load by NVRTC (no CUDA headers needed).
//
// Layouts (see src/nf4.rs for the NF4 packing):
//   NF4 matrix [rows, cols]: packed bytes [rows][cols/2] (element 2i in the high nibble of
//     byte i), absmax f32 [rows][cols/64]. A 16-byte chunk holds 32 elements of one block.
//   Activations f32. KV cache bf16 [kv_stride slots][n_kv][head_dim] per layer.
//   State int32[8]: the STATE_* indices (src/cuda/kernels.rs `state`).
//
// File order: helpers, GEMV family (shared row-dot), attention, small kernels.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

// Shapes and state indices shared with the host are -D options from src/cuda/kernels.rs
// (`shared_defines`), so the two sides cannot drift: GEMV_THREADS, ATTN_THREADS, MAX_HEAD_DIM,
// ATTN2_CHUNK, ATTN2_MAX_GROUP, ATTN2_MAX_GROUP_X_HD, ATTN2_MAX_CHUNKS and STATE_TOKEN,
// STATE_POSITION, STATE_VALID_LEN, STATE_NEXT_TOKEN, STATE_FINISHED, STATE_RING_COUNT.
#if !defined(GEMV_THREADS) || !defined(ATTN_THREADS) || !defined(MAX_HEAD_DIM) || !defined(ATTN2_CHUNK) || \
    !defined(ATTN2_MAX_GROUP) || !defined(ATTN2_MAX_GROUP_X_HD) || !defined(ATTN2_MAX_CHUNKS) ||            \
    !defined(STATE_TOKEN) || !defined(STATE_POSITION) || !defined(STATE_VALID_LEN) ||                      \
    !defined(STATE_NEXT_TOKEN) || !defined(STATE_FINISHED) || !defined(STATE_RING_COUNT)
#error "the host passes the shared constants as -D options (src/cuda/kernels.rs)"
#endif
#define GEMV_WARPS (GEMV_THREADS / 32)
#define NEG_INF __int_as_float(0xff800000u)
#define ATTN_WARPS (ATTN_THREADS / 32)

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

// Round to nearest even, NaN kept NaN.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

// f16 pair {lo, hi} (lo in the low half, the lower index) from two floats.
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    unsigned short r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// Stores elements i and i + 1 (i even) of a row of activations: f32, or with `f16` an f16
// pair at the same element indices (the tensor-core GEMM's input in prefill).
__device__ __forceinline__ void store_pair(float* out, size_t i, float lo, float hi, bool f16) {
    if (f16) {
        *reinterpret_cast<u32*>(reinterpret_cast<u16*>(out) + i) = pack_f16x2(lo, hi);
    } else {
        out[i] = lo;
        out[i + 1] = hi;
    }
}

__device__ __forceinline__ float sq(float v) { return v * v; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// log2 of n, a power of two (1 << log2_pow2(n) == n): a shift where code would divide.
__device__ __forceinline__ int log2_pow2(int n) { return __ffs(n) - 1; }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// CTA_TIMELINE (an NVRTC define, DV2_CTA_TIMELINE=1; a measuring tool, off by default): each
// CTA's thread 0 appends records to dv2_timeline (read by CudaBackend::cta_timeline): at its
// PDL wait {grid id, kind 0 | SM | grid size | CTA, globaltimer before the wait, after it}, and
// where the GEMV and attention kernels end {grid id, kind 1 | ..., the end, 0}. Why: the
// kernel-level trace showed each kernel's first CTAs start well before the previous kernel
// ends and its last ones after, and skewing gate/up's rows by when its CTAs start gained 0.024
// ms/token (docs/lab.md, session 17); this shows which CTAs start, wait and end when.
#ifndef CTA_TIMELINE
#define CTA_TIMELINE 0
#endif
#if CTA_TIMELINE
#define CTA_TIMELINE_RECORDS (1 << 17)
__device__ unsigned long long dv2_timeline[CTA_TIMELINE_RECORDS * 4];
__device__ unsigned dv2_timeline_n;
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ void timeline_record(unsigned long long kind, unsigned long long t0, unsigned long long t1) {
    if (threadIdx.x | threadIdx.y | threadIdx.z) return;
    unsigned long long grid_id;
    unsigned sm;
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(grid_id));
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const unsigned ctas = gridDim.x * gridDim.y * gridDim.z;
    const unsigned i = atomicAdd(&dv2_timeline_n, 1u);
    if (i >= CTA_TIMELINE_RECORDS) return;
    unsigned long long* r = dv2_timeline + 4 * (size_t)i;
    r[0] = grid_id;
    r[1] = kind << 56 | (unsigned long long)(sm & 0xffu) << 48 | (unsigned long long)(ctas & 0xffffffu) << 24 |
           (cta & 0xffffffu);
    r[2] = t0;
    r[3] = t1;
}
#endif
// Where a GEMV or attention CTA ends (CTA_TIMELINE).
__device__ __forceinline__ void timeline_end() {
#if CTA_TIMELINE
    timeline_record(1, global_ns(), 0);
#endif
}
// Where it starts (kind 2; thread 0's atomic here delays its CTA by one round trip, so a
// start-to-wait time from the timeline is that much too long).
__device__ __forceinline__ void timeline_start() {
#if CTA_TIMELINE
    timeline_record(2, global_ns(), 0);
#endif
}


// Programmatic dependent launch (sm_90+; the host asks for it per launch, src/cuda/device.rs):
// a kernel may start while the one before it still runs. pdl_wait() returns once the earlier
// kernels of the stream have finished and their writes are visible, so every kernel calls it
// before it reads or writes any buffer that another kernel touches; only the constant
// weights may be loaded before it. pdl_release() lets the next kernel start launching; each
// kernel calls it right after its wait, so at most one kernel waits ahead of the running one.
// Both are no-ops in a launch without the attribute.
__device__ __forceinline__ void pdl_wait() {
#if CTA_TIMELINE
    const unsigned long long t0 = global_ns();
#endif
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#if CTA_TIMELINE
    timeline_record(0, t0, global_ns());
#endif
}

__device__ __forceinline__ void pdl_release() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The start of every kernel that loads nothing before waiting.
__device__ __forceinline__ void pdl_enter() {
    pdl_wait();
    pdl_release();
}

// Thread-block clusters (Hopper; the GEMM's K split, attention v3): the cluster's size and
// this CTA's rank in it (1 and 0 in a launch without clusters).
__device__ __forceinline__ int cluster_size() {
    u32 r;
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
    return (int)r;
}
__device__ __forceinline__ int cluster_rank() {
    u32 r;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return (int)r;
}
// Every thread of every CTA of the cluster arrives, then waits (alternating).
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
// An arrive that orders this thread's earlier writes for the cluster only (arrive.release
// fences the whole GPU: MEMBAR.ALL.GPU in the SASS).
__device__ __forceinline__ void cluster_arrive_cluster_release() {
    asm volatile("fence.acq_rel.cluster;\n\tbarrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
// Stores v at `local`'s offset in the shared memory of the cluster's CTA `rank`.
__device__ __forceinline__ void store_in_cta(float* local, int rank, float v) {
    const u32 addr = (u32)__cvta_generic_to_shared(local);
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(v) : "memory");
}
// A float at `local`'s offset in the shared memory of the cluster's CTA `rank`.
__device__ __forceinline__ float load_from_cta(const float* local, int rank) {
    const u32 addr = (u32)__cvta_generic_to_shared(local);
    u32 remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}

// The bitsandbytes NF4 codebook (an initializer, so every kernel that copies it keeps its
// own local table).
#define NF4_CODEBOOK                                                                               \
    {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f, \
     -0.18477343022823334f, -0.09105003625154495f, 0.0f, 0.07958029955625534f, 0.16093020141124725f,  \
     0.24611230194568634f, 0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,           \
     0.7229568362236023f, 1.0f}

// The codebook, copied to shared memory once per CTA: lanes index different entries, which a
// __constant__ table would serialize.
__device__ __forceinline__ void load_codebook(float* lut) {
    const float nf4[16] = NF4_CODEBOOK;
    if (threadIdx.x < 16) lut[threadIdx.x] = nf4[threadIdx.x];
}

struct Nf4Ref {
    const u8* packed;
    const float* absmax;
    float mma_scale;  // the tensor-core GEMM's power of two on absmax (kernels/prefill.cu)
};

// q, k and v in one grid sharing x: rows [0, rows0) from m0, then m1, then m2, written
// contiguously to out with their biases (each bias may be null).
struct QkvArgs {
    Nf4Ref m[3];
    const float* bias[3];
    int rows[3];
};

// ---------------------------------------------------------------------------------------
// GEMV v2 (the larger matrices). Persistent CTAs walk a block of rows; each warp holds its
// slice of x in registers for the whole walk (x is read once per warp, not once per row: the
// v1 kernels, removed after a1b9aaa, re-read 128 bytes of x for every 16 bytes of weights,
// with lanes 128 bytes apart, which made L1 the bottleneck), and issues the loads of R rows
// before using any of them.
//
// A row's 16-byte chunks are split over `kparts` warps (runtime: 1, 2, 4 or 8); each warp's
// lane holds J chunks (compile time: 1..3) of the row part, so a part covers 32*J chunks.
// The CTA's 8 warps are (8 / kparts) row lanes x kparts parts. Every warp runs the same
// number of iterations, so the per-iteration part reduction may use __syncthreads.

#define GEMV2_MAX_LANES_X_R 32  // (row lanes) x (rows in flight) held in shared memory
#define GEMV2_LATE_FLOATS 1024  // K-part sums of a CTA's rows kept for one final reduction
// x is staged in shared memory from f32 (stage_x) or, in the _x16 kernels, from f16 (down's
// input, written so by SwiGLU: DV2_FFN_F16). A kernel holds one x path: a warp runs it once,
// and paths it never takes cost their fetch (docs/lab.md, session 13: 600-1,100 SASS
// instructions a path).

// A row's epilogue operands (its bias, the old y a residual adds to), which GEMV v2 loads
// right after its wait instead of after the row's sums (see gemv2_walk).
struct RowEpi {
    float bias, old;
};

template <int J>
struct XSlice {
    float v[J][32];
};

// RMSNorm folded into the x load (DV2_FUSE_RMS): when `w` is not null, x is replaced by
// x * rsqrt(mean(x^2) + eps) * w, where sum(x^2) comes as `ss_parts` partial sums that the
// kernel which wrote x left in `ss` (one per CTA, see block_sum_to), so no kernel and no
// extra pass over x stands between the producer and this GEMV.
struct NormArgs {
    const u16* w;
    float eps;
    int ss_parts;
    const float* ss;
};

// 1 / rms(x) from the producer's partial sums; every lane of every warp gets it (the sums
// are added in the same order everywhere, so all CTAs agree to the bit).
// NORM_BATCH loads per lane go out before their adds (a plain loop waits on each in turn).
// 12: a GEMV v2 producer on 132 SMs leaves 264 partial sums, which 8 per lane (before session
// 11) fetched in two round trips. Each lane adds its values in index order either way, so the
// batch does not change the sum.
#define NORM_BATCH 12
__device__ __forceinline__ float norm_factor(NormArgs norm, int n) {
    float s = 0.0f;
    for (int base = threadIdx.x & 31; base < norm.ss_parts; base += NORM_BATCH * 32) {
        float v[NORM_BATCH];
#pragma unroll
        for (int u = 0; u < NORM_BATCH; u++) v[u] = base + 32 * u < norm.ss_parts ? norm.ss[base + 32 * u] : 0.0f;
#pragma unroll
        for (int u = 0; u < NORM_BATCH; u++) s += v[u];
    }
    return rsqrtf(warp_sum(s) / (float)n + norm.eps);
}

// Writes the sum of `v` over the CTA to *out (one barrier; every thread must call it).
__device__ __forceinline__ void block_sum_to(float v, float* out) {
    __shared__ float red[32];
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) total += red[w];
        *out = total;
    }
}

// x and the RMSNorm's weights, 16 and 8 bytes a thread at a time, for a kernel staging x in
// shared memory: use(q, x quad q, its 4 bf16 norm weights, 1 / rms) for q = threadIdx.x,
// + THREADS, ... < cols / 4, coalesced. X_BATCH quads per thread are loaded before any is
// used (a loop that stored each before loading the next waited one round trip per quad: 11
// in a row at K = 11008), the first batch in flight during the norm's own round trip. The
// weights are not loaded without a norm (norm.w null, r = 1).
#define X_BATCH 8
// XB: quads per thread per round of loads (X_BATCH, or GEMV v3's GEMV3_X_BATCH).
template <int THREADS, int XB = X_BATCH, typename Use>
// [q_begin, q_end): the quads taken (default: all; GEMV v3's K halves take theirs), the norm
// still over all cols.
__device__ __forceinline__ void for_each_x_quad(const float* __restrict__ x, int cols, NormArgs norm, Use use,
                                                int q_begin = 0, int q_end = -1) {
    const int quads = q_end < 0 ? cols >> 2 : q_end;
    float4 xv[XB];
    uint2 wv[XB];
    auto load = [&](int base) {
#pragma unroll
        for (int u = 0; u < XB; u++) {
            const int q = base + u * THREADS;
            if (q < quads) {
                xv[u] = reinterpret_cast<const float4*>(x)[q];
                if (norm.w) wv[u] = reinterpret_cast<const uint2*>(norm.w)[q];
            }
        }
    };
    load(q_begin + threadIdx.x);
    const float r = norm.w ? norm_factor(norm, cols) : 1.0f;
    for (int base = q_begin + threadIdx.x;;) {
#pragma unroll
        for (int u = 0; u < XB; u++) {
            const int q = base + u * THREADS;
            if (q >= quads) break;
            use(q, xv[u], wv[u], r);
        }
        base += XB * THREADS;
        if (base >= quads) break;
        load(base);
    }
}

// GEMV v2's x staged once per CTA in dynamic shared memory: the
// CTA loads x (and the norm's weights) coalesced, applies the norm, and stores chunk c (32
// floats) at X_STAGE_STRIDE * c; each lane then reads its own chunks with 16-byte shared
// loads, which the stride keeps conflict-free (the 8 lanes of a quarter-warp, on consecutive
// chunks, start 4 banks apart). Why: read straight from global memory (until a1b9aaa), each
// 16-byte load of a warp touches 32 cache lines (a chunk is one 128-byte line per lane), 8x
// the L1 wavefronts of a coalesced load; the same pattern in the norm's weights (2-byte
// loads, 16 lines each) cost ~3 us per kernel (docs/lab.md, session 7). Same values in the
// same order. X_STAGE_STRIDE comes from the host (src/cuda/kernels.rs), which sizes the
// dynamic shared memory.
// GEMV2_X_BATCH: quads per thread per round of loads; 4 stage K up to 4,096 in one round
// (gate/up and lm_head at K = 2,048 need 2) in fewer instructions than 8, code each warp runs
// once (docs/lab.md, session 13).
#define GEMV2_X_BATCH 4
__device__ __forceinline__ void stage_x(const float* __restrict__ x, int cols, NormArgs norm, float* x_staged) {
    for_each_x_quad<GEMV_THREADS, GEMV2_X_BATCH>(x, cols, norm, [&](int q, float4 v, uint2 w, float r) {
        float e[4] = {v.x, v.y, v.z, v.w};
        if (norm.w) {
            const u32 w2[2] = {w.x, w.y};
#pragma unroll
            for (int i = 0; i < 4; i++) e[i] = e[i] * r * bf16_to_f32((u16)(w2[i >> 1] >> (16 * (i & 1))));
        }
        *reinterpret_cast<float4*>(x_staged + (q >> 3) * X_STAGE_STRIDE + (q & 7) * 4) = make_float4(e[0], e[1], e[2], e[3]);
    });
}

// This lane's chunks of x from the staged copy (zeros past the last chunk).
template <int J>
__device__ __forceinline__ void read_x_slice(const float* x_staged, int part, int cols, XSlice<J>& xs) {
    const int lane = threadIdx.x & 31, n_chunks = cols >> 5;
#pragma unroll
    for (int j = 0; j < J; j++) {
        const int c = (part * J + j) * 32 + lane;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const float4 v = c < n_chunks ? *reinterpret_cast<const float4*>(x_staged + c * X_STAGE_STRIDE + 4 * k)
                                          : make_float4(0.f, 0.f, 0.f, 0.f);
            xs.v[j][4 * k] = v.x, xs.v[j][4 * k + 1] = v.y, xs.v[j][4 * k + 2] = v.z, xs.v[j][4 * k + 3] = v.w;
        }
    }
}

// x given as f16 (the _x16 kernels: down's input, written so by SwiGLU), staged as the f16-pair
// walk reads it: chunk c's 16 words (its 32 halves, element 2i in the low half of word i) at
// X16_STAGE_STRIDE * c, whose 4 words of padding keep a quarter-warp's 16-byte reads of
// consecutive chunks conflict-free. Why: f32 x staged at K = 11008 is 44 KB of L2 reads per
// CTA, as many bytes as the CTA's weights, in two round trips of X_BATCH loads; f16 halves
// them and fits one round trip. The bits are those of the f32 path (the same rounding, done
// by the writer).
__device__ __forceinline__ void stage_x16(const u16* __restrict__ x, int cols, u32* staged) {
    const int pieces = cols >> 3;  // 16 bytes each, 4 per chunk
    for (int base = threadIdx.x; base < pieces; base += X_BATCH * GEMV_THREADS) {
        uint4 v[X_BATCH];
#pragma unroll
        for (int u = 0; u < X_BATCH; u++) {
            const int i = base + u * GEMV_THREADS;
            if (i < pieces) v[u] = reinterpret_cast<const uint4*>(x)[i];
        }
#pragma unroll
        for (int u = 0; u < X_BATCH; u++) {
            const int i = base + u * GEMV_THREADS;
            if (i < pieces) *reinterpret_cast<uint4*>(staged + (i >> 2) * X16_STAGE_STRIDE + (i & 3) * 4) = v[u];
        }
    }
}

template <int J>
struct XHalves;

// This lane's chunks of x as f16 pairs from stage_x16's copy (zeros past the last chunk).
template <int J>
__device__ __forceinline__ void read_x16_slice(const u32* staged, int part, int cols, XHalves<J>& xh) {
    const int lane = threadIdx.x & 31, n_chunks = cols >> 5;
#pragma unroll
    for (int j = 0; j < J; j++) {
        const int c = (part * J + j) * 32 + lane;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const uint4 v = c < n_chunks ? *reinterpret_cast<const uint4*>(staged + c * X16_STAGE_STRIDE + 4 * q)
                                         : make_uint4(0u, 0u, 0u, 0u);
            xh.h[j][4 * q] = v.x, xh.h[j][4 * q + 1] = v.y, xh.h[j][4 * q + 2] = v.z, xh.h[j][4 * q + 3] = v.w;
        }
    }
}

template <int J>
struct RowChunks {
    uint4 q[J];
    float s[J];
};

// GEMV v2's weight loads as ld.global.nc.L1::no_allocate (each 16-byte piece is read once). Why: with
// L1 cut to 28 KiB the decode step lost 0.069 ms (docs/lab.md, session 15, run 8), so L1 may
// bound the weight loads in flight; a load that allocates no line is not. Measured: -0.004
// ms/token against __ldg (session 16, runs 1-2).
__device__ __forceinline__ uint4 load_weights16(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// Issues the loads of this lane's chunks of one row part (zero scale past the row's end).
template <int J>
__device__ __forceinline__ void load_row(Nf4Ref m, int row, int cols, int part, RowChunks<J>& rc) {
    const int lane = threadIdx.x & 31, n_chunks = cols >> 5;
    const uint4* w = reinterpret_cast<const uint4*>(m.packed + (size_t)row * (cols >> 1));
    const float* a = m.absmax + (size_t)row * (cols >> 6);
#pragma unroll
    for (int j = 0; j < J; j++) {
        const int c = (part * J + j) * 32 + lane;
        const bool in = c < n_chunks;
        rc.q[j] = in ? load_weights16(w + c) : make_uint4(0u, 0u, 0u, 0u);
        rc.s[j] = in ? __ldg(a + (c >> 1)) : 0.0f;
    }
}

// One row part's dot product with this lane's x, shared by the v2 tables: each chunk's four
// 32-bit words of weights (four bytes each, each byte two weights) summed GROUP words at a
// time by `group_sum(j, w0, words)` (words w0 .. w0 + GROUP - 1 of chunk j), the groups
// added in f32, then times the chunk's absmax.
template <int J, int GROUP, typename GroupSum>
__device__ __forceinline__ float dot_chunks(const RowChunks<J>& rc, GroupSum group_sum) {
    static_assert(GROUP == 1 || GROUP == 2 || GROUP == 4, "groups of 1, 2 or 4 words");
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < J; j++) {
        const u32 words[4] = {rc.q[j].x, rc.q[j].y, rc.q[j].z, rc.q[j].w};
        float part = 0.0f;
#pragma unroll
        for (int w0 = 0; w0 < 4; w0 += GROUP) part += group_sum(j, w0, words);
        acc = fmaf(part, rc.s[j], acc);
    }
    return acc;
}

// Fills a byte-indexed table of LANES copies per entry (entry b of lane l at LUT index
// LANES * b + l) with pair(codebook(high nibble of b), codebook(low nibble of b)): the
// f16-pair table below (32 lanes). An entry's copies fill one 128-byte line, written as eight
// 16-byte stores of the entry repeated. Why: with a store per copy the loop
// waited on the codebook's loads 32 times in a row; it took ~20% of GEMV v2's samples at K
// = 11008 under ncu, and the CTAs of the kernel after a GEMV v2 build it on the critical
// path, as they cannot be resident before that GEMV's CTAs leave (docs/lab.md, session 11).
// The table must be 16-byte aligned.
template <typename Entry>
__device__ __forceinline__ uint4 repeat16(Entry e) {
    static_assert(sizeof(Entry) == 4 || sizeof(Entry) == 8, "4- or 8-byte entries");
    union {
        Entry e[16 / sizeof(Entry)];
        uint4 v;
    } u;
#pragma unroll
    for (int i = 0; i < (int)(16 / sizeof(Entry)); i++) u.e[i] = e;
    return u.v;
}

// Each thread makes its pieces from the codebook's immediates, no shared codebook and no barrier before the
// stores. With 256 threads thread t's pieces are i = t + 256 u (u < 8), of entry b = i / 8 =
// t / 8 + 32 u: its low nibble (t / 8) % 16 is the thread's for every u, its high nibble
// 2 u + t / 128 one of two immediates per u. Why: a CTA that starts as the previous kernel's
// leave builds its table on the kernel's critical path (the last CTAs to start end last,
// docs/lab.md, session 19), and the shared codebook put a store, a barrier and a shared load
// round trip before the first table store. Measured: -0.019..-0.021 ms/token (session 20,
// runs 2-5); picking the f16 entries by byte permutes of f16 words instead (a shorter chain
// than the compiler's 16 predicated moves for the low nibble) measured +0.0025 (run 5).
// LINES: 128-byte lines from one entry to the next (2: lm_head's PRMT-addressed table, whose
// second line of each entry is never written or read). THREADS: the CTA's threads.
template <int THREADS, int LANES, int LINES = 1, typename Entry, typename Pair>
__device__ __forceinline__ void load_byte_table(Entry* lut, Pair pair) {
    static_assert(LANES * sizeof(Entry) == 128, "an entry's copies fill one 128-byte line");
    constexpr int PIECES = 256 * 8;  // 16-byte pieces: eight per entry
    uint4* lines = reinterpret_cast<uint4*>(lut);
    auto piece_at = [](int i) { return LINES == 1 ? i : (i >> 3) * 8 * LINES + (i & 7); };
    static_assert(THREADS == 256, "the direct table build assumes 256 threads");
    const float nf4[16] = NF4_CODEBOOK;
    const int t = threadIdx.x;
    const float lo = nf4[(t >> 3) & 15];
    const bool odd = t & 128;
#pragma unroll
    for (int u = 0; u < PIECES / THREADS; u++)
        lines[piece_at(t + THREADS * u)] = repeat16(pair(odd ? nf4[2 * u + 1] : nf4[2 * u], lo));
}

// The byte offset of byte k (0..3) of `word`'s entry in a byte-indexed table of 128 bytes per
// entry (the f16-pair table below): 128 * byte, to be ORed
// with the lane's offset inside the entry. The two parts share no bits, so a shift and one
// LOP3 (mask, then OR) make the address; indexing by byte * lanes + lane took ~4 instructions.
__device__ __forceinline__ u32 byte_entry_offset(u32 word, int k) {
    return (k == 0 ? word << 7 : word >> (8 * k - 7)) & 0x7f80u;
}

// A 256-entry table maps a packed byte to its f16 pair {codebook(high nibble) in the low
// half, codebook(low nibble) in the high half}, replicated once per bank (entry b of lane l
// at word 32b + l) so a warp's 32 lookups never conflict: one shared load per two weights.
// Used by GEMV v2 (below), the GEMM with f16 activations
// (prefill.cu) and GEMV v3 (gemv_mma.cu).
#define BYTE_LUT_WORDS (256 * 32)

// The entry of byte k (0..3) of `word` for this lane (lane4 = 4 * lane).
__device__ __forceinline__ u32 byte_lut_entry(const u32* lut, u32 word, int k, u32 lane4) {
    return *reinterpret_cast<const u32*>(reinterpret_cast<const char*>(lut) + (byte_entry_offset(word, k) | lane4));
}

template <int THREADS>
__device__ __forceinline__ void load_byte_codebook(u32* lut) {
    load_byte_table<THREADS, BYTE_LUT_WORDS / 256>(lut, [](float hi, float lo) { return pack_f16x2(hi, lo); });
}

// lm_head's argmax kernels take the f16-pair table with 256 bytes from entry to entry (PRMT_LUT_WORDS words of dynamic shared
// memory before x, the copies in the first 128 bytes of each), so that one PRMT makes a
// lookup's address (byte k of the word into bits 8..15, the lane's offset below them) where a
// shift and a LOP3 did. Why lm_head only: its walk is the step's longest (576 rows a CTA) and
// gained 48.0 -> 44.5 us with it, while gate/up and down lost more (their larger footprint
// kept down's CTAs from starting beside gate/up's; docs/lab.md, session 15, run 4); nothing
// after lm_head can be resident beside it (registers), so its footprint costs no start.
template <int THREADS>
__device__ __forceinline__ void load_byte_codebook_prmt(u32* lut) {
    load_byte_table<THREADS, BYTE_LUT_WORDS / 256, 2>(lut, [](float hi, float lo) { return pack_f16x2(hi, lo); });
}
// The entry of byte k (0..3) of `word` for this lane in that table (lane4 = 4 * lane < 256).
__device__ __forceinline__ u32 prmt_lut_entry(const u32* lut, u32 word, int k, u32 lane4) {
    const u32 offset = __byte_perm(lane4, word, 0x1140u | ((u32)k << 4));  // {lane4, byte k, 0, 0}
    return *reinterpret_cast<const u32*>(reinterpret_cast<const char*>(lut) + offset);
}

// GEMV v2's table: the byte -> f16-pair table above, 4 bytes per lookup instead of the f32
// pairs' 8 (removed after a1b9aaa, as was the 16-entry codebook), so a warp's lookup is one
// shared-memory wavefront instead of two (the v2 loop is bound by these lookups, docs/lab.md
// session 9). The pairs multiply x as f16x2 (x packed once per walk),
// each word's four pairs summed by two lanes of an f16x2 FMA chain, then added in f32: the
// products and those 4-term sums are f16, whose rounding (~2e-5 of the terms' magnitude in a
// numpy model at K = 2048) is of the order of x's own f16 rounding in GEMV v3; like v3, an |x|
// past 65504 would overflow.
__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

__device__ __forceinline__ float half2_sum(u32 h) {
    float lo, hi;
    asm("{.reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h;}" : "=f"(lo), "=f"(hi) : "r"(h));
    return lo + hi;
}

// A lane's x as f16 pairs (element 2i in the low half of h[j][i]).
template <int J>
struct XHalves {
    u32 h[J][16];
};

template <int J>
__device__ __forceinline__ void pack_x_halves(const XSlice<J>& xs, XHalves<J>& xh) {
#pragma unroll
    for (int j = 0; j < J; j++)
#pragma unroll
        for (int i = 0; i < 16; i++) xh.h[j][i] = pack_f16x2(xs.v[j][2 * i], xs.v[j][2 * i + 1]);
}

#define GEMV2_CHAIN 2
// GEMV2_CHAIN: words of a chunk
// whose pairs one f16x2 FMA chain sums before it is added in f32 (1: each word's four pairs,
// as before session 15). Longer chains convert and add fewer times: per chunk of 16 bytes 17
// instructions of sums with 1, 9 with 2, 5 with 4, against 64 for the lookups and products,
// and the walk is issue-bound (docs/lab.md, session 15). Each f16 partial sum holds 8 (16)
// products instead of 4: its rounding grows (the gates' logit errors with every linear on
// v2 moved by up to 0.004, cap 0.05), as does the reach of an |x| outlier toward f16's
// 65504, which is why the default is 2, not 4.
// dot_chunks with the f16-pair table (lane4 = 4 * lane): each group of GEMV2_CHAIN words one
// f16x2 FMA chain, summed in f32. PRMT: the table laid out for prmt_lut_entry.
template <int J, bool PRMT = false>
__device__ __forceinline__ float dot_row_pair16(const RowChunks<J>& rc, const XHalves<J>& xh, const u32* lut,
                                                u32 lane4) {
    return dot_chunks<J, GEMV2_CHAIN>(rc, [&](int j, int w0, const u32* words) {
        u32 h = 0u;
#pragma unroll
        for (int w = w0; w < w0 + GEMV2_CHAIN; w++)
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const u32 e = PRMT ? prmt_lut_entry(lut, words[w], k, lane4) : byte_lut_entry(lut, words[w], k, lane4);
                h = hfma2(e, xh.h[j][4 * w + k], h);
            }
        return half2_sum(h);
    });
}

// The walk shared by the v2 kernels. `Rows` maps a row index to its matrix and epilogue:
//   Nf4Ref matrix(int row, int* local_row); void store(int row, float sum[NM]) for NM
//   matrices per row (1, or 2 for SwiGLU's gate and up); void tail(), run as the walk ends,
//   and void finish() after the epilogues (every thread of the CTA).
// X16: x comes as f16 (stage_x16), else f32 (stage_x).
template <int J, int R, int NM, bool X16, typename Rows>
__device__ __forceinline__ void gemv2_walk(Rows rows_of, int rows, int cols, const float* __restrict__ x,
                                           NormArgs norm, int kparts, const int* skip_if, int early_ctas = 0,
                                           int early_rows = 0) {
    // Rows::prmt_table: the f16-pair table in dynamic shared memory as load_byte_codebook_prmt
    // lays it out, before x; else in static shared memory.
    constexpr bool prmt_table = Rows::prmt_table;
    __shared__ __align__(16) u32 pair16_static[prmt_table ? 1 : BYTE_LUT_WORDS];
    __shared__ float partial[GEMV2_MAX_LANES_X_R * NM][GEMV_WARPS];
    __shared__ float late_partial[GEMV2_LATE_FLOATS];
    // Dynamic shared memory: that table (PRMT_LUT_WORDS words), then x as staged: cols / 32 *
    // X_STAGE_STRIDE floats, or cols / 32 * X16_STAGE_STRIDE words from f16.
    extern __shared__ __align__(16) float gemv2_dyn[];
    u32* pair16_lut = prmt_table ? reinterpret_cast<u32*>(gemv2_dyn) : pair16_static;
    float* x_staged = gemv2_dyn + (prmt_table ? PRMT_LUT_WORDS : 0);
    timeline_start();
    if (prmt_table) load_byte_codebook_prmt<GEMV_THREADS>(pair16_lut);
    else load_byte_codebook<GEMV_THREADS>(pair16_lut);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 lane4 = lane * 4;
    // kparts is 1, 2, 4 or 8 (the host's gemv2_shape): the warp's roles by shifts and masks.
    const int kshift = log2_pow2(kparts);
    const int part = warp & (kparts - 1), row_lane = warp >> kshift, row_lanes = GEMV_WARPS >> kshift;
    // Rows by CTA: an equal share each, or (early_ctas > 0; SwiGLU, GEMV2_SWIGLU_SKEW on the
    // host) early_rows for each of the first early_ctas CTAs and an equal share of the rest for
    // the others. Why: the CTAs the scheduler places first (beside the previous kernel's)
    // start ~1-2 us before those that wait for its CTAs to leave, and the kernel ends with its
    // last CTA. The plain and lm_head kernels measured slower with it (session 18) and hold no
    // such code.
    if (NM != 2) early_ctas = 0;
    const int late_rows =
        early_ctas > 0 ? (rows - early_ctas * early_rows + (int)gridDim.x - early_ctas - 1) / ((int)gridDim.x - early_ctas)
                       : 0;
    const int per_cta = early_ctas == 0 ? (rows + gridDim.x - 1) / gridDim.x
                        : (int)blockIdx.x < early_ctas ? early_rows
                                                       : late_rows;
    const int r0 = early_ctas == 0 || (int)blockIdx.x < early_ctas
                       ? blockIdx.x * per_cta
                       : early_ctas * early_rows + ((int)blockIdx.x - early_ctas) * late_rows;
    const int r1 = min(rows, r0 + per_cta);
    const int block = row_lanes * R;  // rows per iteration
    // Late sums: each iteration leaves its K-part sums in shared memory and the CTA adds them
    // and runs the epilogue once, after its last iteration: one barrier instead of two per
    // iteration, every row's epilogue loads (a residual's old y) in flight together instead of
    // one round trip per iteration, and without a K split (gate/up, lm_head) a warp's rows'
    // epilogues (SwiGLU's exp and division by lane 0) leave the walk and run in parallel at
    // its end. Same sums in the same order. A CTA whose sums do not fit shared memory stores
    // as it goes.
    const bool late = (r1 - r0) * NM * kparts <= GEMV2_LATE_FLOATS;
    // Software pipeline: the loads of the next block are issued before this block's math.
    RowChunks<J> cur[R][NM], nxt[R][NM];
    auto load_block = [&](int base, RowChunks<J> (&rc)[R][NM]) {
#pragma unroll
        for (int i = 0; i < R; i++) {
            const int r = base + i * row_lanes + row_lane;
            if (r < r1) {
#pragma unroll
                for (int k = 0; k < NM; k++) load_row<J>(rows_of.matrix(r, k), rows_of.local(r), cols, part, rc[i][k]);
            }
        }
    };
    // The first block's weights go out before the wait on the previous kernel (weights are
    // constant; it pays where the CTA is resident early, as the 128-register kernels are
    // beside a GEMV v3 CTA: 0.01-0.02 ms/token, docs/lab.md session 10).
    load_block(r0, cur);
    pdl_enter();
    if (skip_if && *skip_if) return;
    // With late sums the epilogue operands of the CTA's first blockDim.x rows (thread i: row
    // r0 + i, as in the final reduction below) load now, so their round trip overlaps the walk
    // instead of following the last barrier.
    RowEpi early_epi{0.0f, 0.0f};
    if (late && (int)threadIdx.x < r1 - r0) early_epi = rows_of.epi(r0 + threadIdx.x);
    XHalves<J> xh;
    if (X16) {
        stage_x16(reinterpret_cast<const u16*>(x), cols, reinterpret_cast<u32*>(x_staged));
        __syncthreads();
        read_x16_slice<J>(reinterpret_cast<const u32*>(x_staged), part, cols, xh);
    } else {
        XSlice<J> xs;
        stage_x(x, cols, norm, x_staged);
        __syncthreads();
        read_x_slice<J>(x_staged, part, cols, xs);
        pack_x_halves<J>(xs, xh);
    }
    float ss = 0.0f;  // squares of the values this thread stored
    for (int base = r0; base < r1; base += block) {
        if (base + block < r1) load_block(base + block, nxt);
        float sums[R][NM];
#pragma unroll
        for (int i = 0; i < R; i++)
#pragma unroll
            for (int k = 0; k < NM; k++)
                sums[i][k] = warp_sum(dot_row_pair16<J, prmt_table>(cur[i][k], xh, pair16_lut, lane4));
#pragma unroll
        for (int i = 0; i < R; i++)
#pragma unroll
            for (int k = 0; k < NM; k++) cur[i][k] = nxt[i][k];
        if (late) {
            if (lane == 0) {
#pragma unroll
                for (int i = 0; i < R; i++) {
                    const int r = base + i * row_lanes + row_lane;
                    if (r < r1) {
#pragma unroll
                        for (int k = 0; k < NM; k++) late_partial[((r - r0) * NM + k) * kparts + part] = sums[i][k];
                    }
                }
            }
            continue;
        }
        if (kparts == 1) {
            if (lane == 0) {
#pragma unroll
                for (int i = 0; i < R; i++) {
                    const int r = base + i * row_lanes + row_lane;
                    if (r < r1) ss += sq(rows_of.store(r, sums[i]));
                }
            }
            continue;
        }
        if (lane == 0) {
#pragma unroll
            for (int i = 0; i < R; i++)
#pragma unroll
                for (int k = 0; k < NM; k++) partial[(i * row_lanes + row_lane) * NM + k][part] = sums[i][k];
        }
        __syncthreads();
        if (threadIdx.x < block) {
            const int r = base + threadIdx.x;
            if (r < r1) {
                const int i = threadIdx.x >> log2_pow2(row_lanes), rl = threadIdx.x & (row_lanes - 1);
                float total[NM];
#pragma unroll
                for (int k = 0; k < NM; k++) {
                    total[k] = 0.0f;
                    for (int p = 0; p < kparts; p++) total[k] += partial[(i * row_lanes + rl) * NM + k][p];
                }
                ss += sq(rows_of.store(r, total));
            }
        }
        __syncthreads();
    }
    rows_of.tail();
    if (late) {
        __syncthreads();
        for (int idx = threadIdx.x; idx < r1 - r0; idx += blockDim.x) {
            float total[NM];
#pragma unroll
            for (int k = 0; k < NM; k++) {
                total[k] = 0.0f;
                for (int p = 0; p < kparts; p++) total[k] += late_partial[(idx * NM + k) * kparts + p];
            }
            const RowEpi e = idx == (int)threadIdx.x ? early_epi : rows_of.epi(r0 + idx);
            ss += sq(rows_of.store(r0 + idx, total, e));
        }
    }
    if (float* out = rows_of.ss_out()) block_sum_to(ss, out + blockIdx.x);
    rows_of.finish();
    timeline_end();
}

// Each Rows type's store returns the value it wrote; ss_out() (may be null) is where the
// walk leaves this CTA's sum of their squares, for the next RMSNorm (NormArgs).
struct PlainRows {
    static constexpr bool prmt_table = false;
    Nf4Ref m;
    float* y;
    const float* bias;
    int accumulate;
    float* ss;
    __device__ void tail() const {}
    __device__ void finish() const {}
    __device__ Nf4Ref matrix(int, int) const { return m; }
    __device__ int local(int r) const { return r; }
    __device__ RowEpi epi(int r) const { return {bias ? bias[r] : 0.0f, accumulate ? y[r] : 0.0f}; }
    __device__ float store(int r, const float* s, RowEpi e) const {
        const float v = s[0] + e.bias;
        const float out = accumulate ? e.old + v : v;
        y[r] = out;
        return out;
    }
    __device__ float store(int r, const float* s) const { return store(r, s, epi(r)); }
    __device__ float* ss_out() const { return ss; }
};

struct QkvRows {
    static constexpr bool prmt_table = false;
    QkvArgs a;
    float* out;
    __device__ void tail() const {}
    __device__ void finish() const {}
    __device__ int seg(int r) const { return r < a.rows[0] ? 0 : (r < a.rows[0] + a.rows[1] ? 1 : 2); }
    __device__ Nf4Ref matrix(int r, int) const {
        const int s = seg(r);
        return s == 0 ? a.m[0] : (s == 1 ? a.m[1] : a.m[2]);
    }
    __device__ int local(int r) const {
        const int s = seg(r);
        return s == 0 ? r : (s == 1 ? r - a.rows[0] : r - a.rows[0] - a.rows[1]);
    }
    __device__ RowEpi epi(int r) const {
        const int g = seg(r);
        const float* b = g == 0 ? a.bias[0] : (g == 1 ? a.bias[1] : a.bias[2]);
        return {b ? b[local(r)] : 0.0f, 0.0f};
    }
    __device__ float store(int r, const float* s, RowEpi e) const {
        const float v = s[0] + e.bias;
        out[r] = v;
        return v;
    }
    __device__ float store(int r, const float* s) const { return store(r, s, epi(r)); }
    __device__ float* ss_out() const { return nullptr; }
};

struct SwigluRows {
    static constexpr bool prmt_table = false;
    Nf4Ref gate, up;
    float* out;
    bool out_f16;  // for a down GEMV that stages f16 (DV2_FFN_F16)
    __device__ void tail() const {}
    __device__ void finish() const {}
    __device__ Nf4Ref matrix(int, int k) const { return k == 0 ? gate : up; }
    __device__ int local(int r) const { return r; }
    __device__ RowEpi epi(int) const { return {0.0f, 0.0f}; }
    __device__ float store(int r, const float* s, RowEpi) const { return store(r, s); }
    __device__ float store(int r, const float* s) const {
        const float v = s[0] / (1.0f + expf(-s[0])) * s[1];
        if (out_f16) reinterpret_cast<u16*>(out)[r] = f32_to_f16(v);
        else out[r] = v;
        return v;
    }
    __device__ float* ss_out() const { return nullptr; }
};

// Whether (v, i) beats (best, best_i) in the argmax: a lower index wins ties, a NaN or a
// missing entry (i < 0) never wins.
__device__ __forceinline__ bool argmax_beats(float v, int i, float best, int best_i) {
    return i >= 0 && (best_i < 0 || v > best || (v == best && i < best_i));
}

// The CTA's argmax of every thread's (best, best_i), left in thread 0's (one barrier).
__device__ __forceinline__ void block_argmax(float& best, int& best_i) {
    __shared__ float s_v[32];
    __shared__ int s_i[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
        if (argmax_beats(ov, oi, best, best_i)) best = ov, best_i = oi;
    }
    if ((threadIdx.x & 31) == 0) {
        s_v[threadIdx.x >> 5] = best;
        s_i[threadIdx.x >> 5] = best_i;
    }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int w = 1; w < (int)(blockDim.x >> 5); w++)
            if (argmax_beats(s_v[w], s_i[w], best, best_i)) best = s_v[w], best_i = s_i[w];
}

// The argmax over the grid's CTAs, after block_argmax left each CTA's (best, best_i) in its
// thread 0: that pair goes to scratch (1 + 2 * gridDim.x words: an arrival count, then the
// pairs), and the CTA that arrives last takes the argmax over the pairs in CTA order, resets
// the count and returns true, the winner in its thread 0; the other CTAs return false.
__device__ __forceinline__ bool argmax_across_ctas(float& best, int& best_i, int* scratch) {
    __shared__ bool last;
    if (threadIdx.x == 0) {
        scratch[1 + 2 * blockIdx.x] = __float_as_int(best);
        scratch[2 + 2 * blockIdx.x] = best_i;
        __threadfence();  // the pair is visible before the count says so
        last = atomicAdd(scratch, 1) == (int)gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return false;
    __threadfence();
    const volatile int* pairs = scratch + 1;
    best = NEG_INF;
    best_i = -1;
    for (int c = threadIdx.x; c < (int)gridDim.x; c += blockDim.x) {
        const float v = __int_as_float(pairs[2 * c]);
        const int i = pairs[2 * c + 1];
        if (argmax_beats(v, i, best, best_i)) best = v, best_i = i;
    }
    block_argmax(best, best_i);
    if (threadIdx.x == 0) scratch[0] = 0;
    return true;
}

// lm_head with the greedy argmax folded in (DV2_LOGITS_ARGMAX, default): the logits are
// stored as by PlainRows, each thread keeps the best of the rows it stored (rows in rising
// order, so the strict > keeps the lowest index of a tie; NaN never wins), and finish() takes
// the argmax over the CTAs as argmax_logits does (argmax_across_ctas); the CTA that arrives
// last writes state[NEXT_TOKEN]. Why: the argmax kernel after lm_head added
// 4.75-5.25 us a step in the graph (docs/lab.md, sessions 15-16): its launch, wait and second
// read of the 600 KB of logits. Measured: -0.0017 ms/token (session 16, run 2). With
// `ring` (the decode step's graph), that CTA also commits the id as
// commit_step would, one kernel fewer a step (its launch added 1.0 us, session 16's trace).
struct LogitRows {
    static constexpr bool prmt_table = true;  // the walk's table for PRMT
    Nf4Ref m;
    float* y;
    int* state;
    int* scratch;
    int eos;
    int* ring;  // null: no commit
    mutable float best;
    mutable int best_i;
    __device__ Nf4Ref matrix(int, int) const { return m; }
    __device__ int local(int r) const { return r; }
    __device__ RowEpi epi(int) const { return {0.0f, 0.0f}; }
    __device__ float store(int r, const float* s, RowEpi) const { return store(r, s); }
    __device__ float store(int r, const float* s) const {
        y[r] = s[0];
        if (s[0] > best || (best_i < 0 && s[0] == s[0])) best = s[0], best_i = r;
        return s[0];
    }
    __device__ float* ss_out() const { return nullptr; }
    __device__ void tail() const {}
    __device__ void finish() const {
        float b = best;
        int bi = best_i;
        block_argmax(b, bi);
        if (!argmax_across_ctas(b, bi, scratch)) return;
        if (threadIdx.x == 0) {
            const int next = bi < 0 ? 0 : bi;
            state[STATE_NEXT_TOKEN] = next;
            if (ring) commit(next);
        }
    }
    // commit_step's work: the CTAs skipped this launch while finished was
    // set, so finished is clear here.
    __device__ void commit(int next) const {
        ring[state[STATE_RING_COUNT]++] = next;
        state[STATE_TOKEN] = next;
        state[STATE_POSITION] += 1;
        state[STATE_VALID_LEN] = state[STATE_POSITION];
        if (next == eos) state[STATE_FINISHED] = 1;
    }
};

// The kernels of one J by what the rows feed: a plain matrix (nf4; _x16: its x in f16),
// q/k/v, SwiGLU, and lm_head with the argmax (logits). R: rows in flight per warp, half of
// what fits 255 registers, so that each kernel stays within 128 (no spills but SwiGLU's at J
// = 3, 240 bytes): a CTA fits beside a GEMV v3 CTA (o's, before gate/up), so it becomes
// resident and builds its table while that kernel runs, and two fit an SM (GEMV2_CTAS_PER_SM
// on the host): 6% faster decode than one CTA of twice the rows (docs/lab.md, session 10).
// The _narrow suffix names that bound.
#define GEMV2_NF4_KERNEL(J, R, X16, SUFFIX)                                                                    \
    extern "C" __global__ void __maxnreg__(128)                                                                \
        gemv2_nf4_j##J##SUFFIX(Nf4Ref m, const float* __restrict__ x, NormArgs norm, float* y,                 \
                               const float* __restrict__ bias, int rows, int cols, int kparts, int accumulate, \
                               const int* skip_if, float* ss_out) {                                            \
        PlainRows p{m, y, bias, accumulate, ss_out};                                                           \
        gemv2_walk<J, R, 1, X16>(p, rows, cols, x, norm, kparts, skip_if);                                     \
    }
#define GEMV2_KERNELS(J, R)                                                                                    \
    GEMV2_NF4_KERNEL(J, R, false, _narrow)                                                                     \
    GEMV2_NF4_KERNEL(J, R, true, _narrow_x16)                                                                  \
    extern "C" __global__ void __maxnreg__(128)                                                                \
        gemv2_qkv_j##J##_narrow(QkvArgs a, const float* __restrict__ x, NormArgs norm, float* out, int cols,   \
                                int kparts) {                                                                  \
        QkvRows q{a, out};                                                                                     \
        gemv2_walk<J, R, 1, false>(q, a.rows[0] + a.rows[1] + a.rows[2], cols, x, norm, kparts, nullptr);      \
    }                                                                                                          \
    extern "C" __global__ void __maxnreg__(128)                                                                \
        gemv2_swiglu_j##J##_narrow(Nf4Ref gate, Nf4Ref up, const float* __restrict__ x, NormArgs norm,         \
                                   float* out, int rows, int cols, int kparts, int out_f16, int early_ctas,    \
                                   int early_rows) {                                                           \
        SwigluRows g{gate, up, out, out_f16 != 0};                                                             \
        gemv2_walk<J, (R > 1 ? R / 2 : 1), 2, false>(g, rows, cols, x, norm, kparts, nullptr, early_ctas,     \
                                                     early_rows);                                              \
    }                                                                                                          \
    GEMV2_LOGITS_KERNEL(J, R)
// lm_head and the argmax in one (LogitRows; DV2_LOGITS_ARGMAX, default), compiled only with
// the switch (GEMV2_LOGITS, from the host's config).
#if GEMV2_LOGITS
#define GEMV2_LOGITS_KERNEL(J, R)                                                                              \
    extern "C" __global__ void __maxnreg__(128)                                                                \
        gemv2_logits_j##J##_narrow(Nf4Ref m, const float* __restrict__ x, NormArgs norm, float* y, int rows,   \
                                   int cols, int kparts, const int* skip_if, int* state, int* scratch, int eos, \
                                   int* ring) {                                                                \
        LogitRows p{m, y, state, scratch, eos, ring, NEG_INF, -1};                                             \
        gemv2_walk<J, R, 1, false>(p, rows, cols, x, norm, kparts, skip_if);                                   \
    }
#else
#define GEMV2_LOGITS_KERNEL(J, R)
#endif
GEMV2_KERNELS(1, 2)
GEMV2_KERNELS(2, 2)
GEMV2_KERNELS(3, 1)

// out = x * rsqrt(mean(x^2) + eps) * w over n elements; CTA b takes row b of x and out.
// With `out_f16` the output row is f16 (n even).
extern "C" __global__ void rms_norm(const float* __restrict__ x, const u16* __restrict__ w, float* out, int n,
                                    float eps, int out_f16) {
    pdl_enter();
    x += (size_t)blockIdx.x * n;
    out = out_f16 ? reinterpret_cast<float*>(reinterpret_cast<u16*>(out) + (size_t)blockIdx.x * n)
                  : out + (size_t)blockIdx.x * n;
    // Pairs of elements, RMS_BATCH pairs per thread loaded together: a strided loop issues
    // one round of loads per iteration and waits for it before the next.
    constexpr int RMS_BATCH = 4;
    const int pairs = n >> 1;  // n is even (head_dim and hidden are)
    const float2* x2 = reinterpret_cast<const float2*>(x);
    __shared__ float sums[32];
    float ss = 0.0f;
    for (int base = threadIdx.x; base < pairs; base += RMS_BATCH * blockDim.x) {
        float2 v[RMS_BATCH];
#pragma unroll
        for (int u = 0; u < RMS_BATCH; u++) {
            const int p = base + u * blockDim.x;
            v[u] = p < pairs ? x2[p] : make_float2(0.0f, 0.0f);
        }
#pragma unroll
        for (int u = 0; u < RMS_BATCH; u++) ss += v[u].x * v[u].x + v[u].y * v[u].y;
    }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) sums[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < (blockDim.x >> 5) ? sums[threadIdx.x] : 0.0f;
        v = warp_sum(v);
        if (threadIdx.x == 0) sums[0] = v;
    }
    __syncthreads();
    const float r = rsqrtf(sums[0] / (float)n + eps);
    const u32* w2 = reinterpret_cast<const u32*>(w);
    for (int base = threadIdx.x; base < pairs; base += RMS_BATCH * blockDim.x) {
        float2 v[RMS_BATCH];
        u32 wp[RMS_BATCH];
#pragma unroll
        for (int u = 0; u < RMS_BATCH; u++) {
            const int p = base + u * blockDim.x;
            if (p < pairs) {
                v[u] = x2[p];
                wp[u] = w2[p];
            }
        }
#pragma unroll
        for (int u = 0; u < RMS_BATCH; u++) {
            const int p = base + u * blockDim.x;
            if (p < pairs)
                store_pair(out, 2 * (size_t)p, v[u].x * r * bf16_to_f32((u16)(wp[u] & 0xffffu)),
                           v[u].y * r * bf16_to_f32((u16)(wp[u] >> 16)), out_f16);
        }
    }
}

// out = dequantized embedding row of `token` (one CTA; no dense table on the device). Returns
// the sum of the squares of the values this thread wrote.
__device__ __forceinline__ float embed_token(int token, Nf4Ref embed, float* out, int hidden, int vocab) {
    if (token < 0 || token >= vocab) token = 0;  // the engine never lets this happen
    const u8* row = embed.packed + (size_t)token * (hidden >> 1);
    const float* scales = embed.absmax + (size_t)token * (hidden >> 6);
    __shared__ float lut[16];
    load_codebook(lut);
    __syncthreads();
    float ss = 0.0f;
    for (int i = threadIdx.x; i < (hidden >> 1); i += blockDim.x) {
        const u8 b = row[i];
        const float s = scales[i >> 5];
        out[2 * i] = lut[b >> 4] * s;
        out[2 * i + 1] = lut[b & 15] * s;
        ss += sq(out[2 * i]) + sq(out[2 * i + 1]);
    }
    return ss;
}

// x = embedding row of state[TOKEN]; with ss_out, its sum of squares there (NormArgs).
extern "C" __global__ void embed_row(const int* __restrict__ state, Nf4Ref embed, float* x, int hidden,
                                     int vocab, float* ss_out) {
    pdl_enter();
    const float ss = embed_token(state[STATE_TOKEN], embed, x, hidden, vocab);
    if (ss_out) block_sum_to(ss, ss_out);
}

// GEMV3_KHALVES (an NVRTC define the host sets, DV2_QKV_KHALVES; 1 by default): q/k/v's
// GEMV v3 in K halves (kernels/gemv_mma.cu, gemv3_store_lean_kh2), the attention adding the
// two parts (AttnArgs::qkv2: the second, or zeros where q/k/v ran in one).
#ifndef GEMV3_KHALVES
#define GEMV3_KHALVES 0
#endif

// Flash-decode attention, one (q head, time split) per CTA, RoPE and the KV write fused.
//
// Reads position p from the state; valid_len = p + 1. Every CTA rotates q and the current k
// itself (the live slot is taken from the projections, never read back from the cache, so
// sibling heads cannot race the write); the first q head of each KV group, split 0, writes
// the slot. Slots t < valid_len are split evenly over n_splits; each CTA writes its online-
// softmax partial (max, sum, acc[head_dim]) for attn_merge.
struct AttnArgs {
    const float* qkv;  // this step's q [n_q*hd] | k [n_kv*hd] | v [n_kv*hd]
    u16* k_cache;      // this layer: [kv_stride][n_kv][hd]
    u16* v_cache;
    const float* rope_cos;  // [max_seq][hd/2]
    const float* rope_sin;
    const int* state;
    float* part_acc;  // [n_q][n_splits][hd]
    float* part_ml;   // [n_q][n_splits][2]
    int n_q, n_kv, head_dim, max_seq, n_splits;
    float scale;
    int heads_per_cta;  // attention v3: q heads per CTA (the host's division)
    const float* qkv2;  // GEMV3_KHALVES: q/k/v's K-half-1 sums (half 0's, with the bias, at qkv), or zeros
};

extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_decode(AttnArgs a) {
    pdl_enter();
    const int h = blockIdx.x, split = blockIdx.y, hd = a.head_dim, half = hd >> 1;
    const int group = a.n_q / a.n_kv, kvh = h / group;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int pos = a.state[STATE_POSITION];
    if (pos >= a.max_seq) return;  // no slot: nothing to write or read
    const int valid = pos + 1;

    __shared__ float q_s[MAX_HEAD_DIM], k_s[MAX_HEAD_DIM], v_s[MAX_HEAD_DIM];
    const float* q = a.qkv + h * hd;
    const float* k = a.qkv + a.n_q * hd + kvh * hd;
    const float* v = a.qkv + (a.n_q + a.n_kv) * hd + kvh * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        int i = d < half ? d : d - half;
        float c = a.rope_cos[pos * half + i], s = a.rope_sin[pos * half + i];
        q_s[d] = d < half ? q[i] * c - q[i + half] * s : q[i + half] * c + q[i] * s;
        k_s[d] = d < half ? k[i] * c - k[i + half] * s : k[i + half] * c + k[i] * s;
        v_s[d] = v[d];
    }
    __syncthreads();
    const size_t slot_stride = (size_t)a.n_kv * hd;
    if (h % group == 0 && split == 0) {
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            a.k_cache[pos * slot_stride + kvh * hd + d] = f32_to_bf16(k_s[d]);
            a.v_cache[pos * slot_stride + kvh * hd + d] = f32_to_bf16(v_s[d]);
        }
    }

    const int chunk = (valid + a.n_splits - 1) / a.n_splits;
    const int t0 = split * chunk, t1 = min(valid, t0 + chunk);
    constexpr int MAX_E = MAX_HEAD_DIM / 32;
    float m = NEG_INF, l = 0.0f, acc[MAX_E];
#pragma unroll
    for (int e = 0; e < MAX_E; e++) acc[e] = 0.0f;
    for (int t = t0 + warp; t < t1; t += ATTN_WARPS) {
        const u16* kc = a.k_cache + t * slot_stride + kvh * hd;
        const u16* vc = a.v_cache + t * slot_stride + kvh * hd;
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < MAX_E; e++) {
            int d = e * 32 + lane;
            if (d < hd) dot += q_s[d] * (t == pos ? k_s[d] : bf16_to_f32(kc[d]));
        }
        float score = warp_sum(dot) * a.scale;
        float m_new = fmaxf(m, score);
        float corr = expf(m - m_new), p = expf(score - m_new);
        l = l * corr + p;
#pragma unroll
        for (int e = 0; e < MAX_E; e++) {
            int d = e * 32 + lane;
            if (d < hd) acc[e] = acc[e] * corr + p * (t == pos ? v_s[d] : bf16_to_f32(vc[d]));
        }
        m = m_new;
    }

    // Combine the warps of this CTA.
    __shared__ float w_m[ATTN_WARPS], w_l[ATTN_WARPS], w_acc[ATTN_WARPS][MAX_HEAD_DIM];
    if (lane == 0) {
        w_m[warp] = m;
        w_l[warp] = l;
    }
#pragma unroll
    for (int e = 0; e < MAX_E; e++) {
        int d = e * 32 + lane;
        if (d < hd) w_acc[warp][d] = acc[e];
    }
    __syncthreads();
    float M = NEG_INF;
    for (int w = 0; w < ATTN_WARPS; w++) M = fmaxf(M, w_m[w]);
    float* out_acc = a.part_acc + ((size_t)h * a.n_splits + split) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < ATTN_WARPS; w++)
            if (w_m[w] != NEG_INF) sum += w_acc[w][d] * expf(w_m[w] - M);
        out_acc[d] = sum;
    }
    if (threadIdx.x == 0) {
        float L = 0.0f;
        for (int w = 0; w < ATTN_WARPS; w++)
            if (w_m[w] != NEG_INF) L += w_l[w] * expf(w_m[w] - M);
        a.part_ml[((size_t)h * a.n_splits + split) * 2] = M;
        a.part_ml[((size_t)h * a.n_splits + split) * 2 + 1] = L;
    }
}

// Attention v2 (without clusters, or DV2_ATTN_CLUSTERS=0; the kernels above where its shared memory does not fit the model): CTAs per (KV head, chunk
// of ATTN2_CHUNK slots), each computing several q heads of the GQA group, so each K/V row is
// read from memory once per step (and from L2 by the KV head's other CTAs) instead of once
// per q head. The group's heads are split over up to 8 CTAs (ATTN_SPLIT on the host): the
// scores and the weighted sum of V are serial loops per thread over heads, so a CTA with a
// quarter of the heads finishes them in a quarter of the rounds (docs/lab.md, session 8).
// The chunk's K and V are staged in shared memory with 16-byte loads issued together;
// scores, softmax and the weighted sum of V run from shared memory. Chunks past valid_len
// exit at once (the grid stays static). The live slot (t == position) comes from the
// rotated projections, never from the cache; the KV head's first CTA of chunk 0 writes it.
// Partials per (q head, chunk) go to attn2_merge.

// Every global load of the prologue (the chunk's K and V rows, the q/k pairs to rotate with
// their cos and sin, the live v) is issued before its first shared store. Interleaved, each
// round of loads waited for the previous round's data to be stored (in program order a load
// may not pass a store the compiler cannot prove to be elsewhere): nine round trips in a row
// at head_dim 128 (docs/lab.md, session 12).
// The chunk's K and V rows are loaded before the wait on the q/k/v GEMV, so their round trip overlaps its tail (an attention CTA,
// 128 threads, fits beside the GEMV's CTAs). They were written by earlier steps, and so was
// the position; a kernel starts only after the one before it has passed its own wait, so
// every step before this one's q/k/v GEMV is complete when these loads issue. The live slot
// and this step's q/k/v are read after the wait, as before.
// Attention's RoPE: pair i (of (gn + 1) * half: the gn q heads from q0, then the live k of
// KV head kvh) is elements (j, j + half) of its vector, j = i % half; the source row, and the
// rotated pair into q_s (scale folded in) or kcur.
// hd is the head_dim: a constant where the caller's kernel has it built in (its divisions
// then shifts), else a.head_dim.
__device__ __forceinline__ const float* rope_pair_src(const AttnArgs& a, int hd, int kvh, int q0, int gn, int i) {
    const int half = hd >> 1;
    return i / half < gn ? a.qkv + (q0 + i / half) * hd : a.qkv + a.n_q * hd + kvh * hd;
}
__device__ __forceinline__ void rope_rotate(const AttnArgs& a, int hd, int gn, int i, float c, float s, float x1,
                                            float x2, float* q_s, float* kcur) {
    const int half = hd >> 1;
    const int g = i / half, j = i % half;
    const float lo = x1 * c - x2 * s, hi = x2 * c + x1 * s;
    if (g < gn) {
        q_s[g * hd + j] = lo * a.scale;
        q_s[g * hd + j + half] = hi * a.scale;
    } else {
        kcur[j] = lo;
        kcur[j + half] = hi;
    }
}

// The prologue after the wait: every load (the live v, RoPE pairs
// with cos/sin, RB pairs per thread at once) before the stores they feed, the caller's
// `stage()` (K/V rows from registers into shared memory) between the rotations' stores and v's.
// HD: the largest head_dim it takes (smaller: fewer loads unrolled per thread); EXACT: the
// head_dim when the kernel has it built in (0: a.head_dim).
template <int HD = MAX_HEAD_DIM, int EXACT = 0, typename Stage>
__device__ __forceinline__ void rotate_live_batched(const AttnArgs& a, int kvh, int q0, int gn, int pos, float* q_s,
                                                    float* kcur, float* vcur, Stage stage) {
    const int hd = EXACT ? EXACT : a.head_dim, half = hd >> 1;
    const float* qkv_v = a.qkv + (a.n_q + a.n_kv) * hd + kvh * hd;
    const float* cos_p = a.rope_cos + pos * half;
    const float* sin_p = a.rope_sin + pos * half;
    constexpr int RB = HD <= 128 ? 2 : 8;  // pairs per thread loaded together
    constexpr int VL = (HD + ATTN_THREADS - 1) / ATTN_THREADS;
    float vl[VL];
#pragma unroll
    for (int u = 0; u < VL; u++) {
        const int d = threadIdx.x + u * ATTN_THREADS;
        vl[u] = d < hd ? qkv_v[d] : 0.0f;
#if GEMV3_KHALVES
        if (d < hd) vl[u] += a.qkv2[(a.n_q + a.n_kv) * hd + kvh * hd + d];  // half 0 (with the bias) first
#endif
    }
    for (int base = threadIdx.x; base < (gn + 1) * half; base += RB * ATTN_THREADS) {
        float c[RB], sn[RB], x1[RB], x2[RB];
#pragma unroll
        for (int u = 0; u < RB; u++) {
            const int i = base + u * ATTN_THREADS;
            if (i < (gn + 1) * half) {
                const float* src = rope_pair_src(a, hd, kvh, q0, gn, i);
                c[u] = cos_p[i % half];
                sn[u] = sin_p[i % half];
                x1[u] = src[i % half];
                x2[u] = src[i % half + half];
#if GEMV3_KHALVES
                const float* src2 = a.qkv2 + (src - a.qkv);
                x1[u] += src2[i % half];
                x2[u] += src2[i % half + half];
#endif
            }
        }
#pragma unroll
        for (int u = 0; u < RB; u++) {
            const int i = base + u * ATTN_THREADS;
            if (i < (gn + 1) * half) rope_rotate(a, hd, gn, i, c[u], sn[u], x1[u], x2[u], q_s, kcur);
        }
    }
    stage();
#pragma unroll
    for (int u = 0; u < VL; u++) {
        const int d = threadIdx.x + u * ATTN_THREADS;
        if (d < hd) vcur[d] = vl[u];
    }
}

// HD: the largest head_dim the kernel takes (MAX_HEAD_DIM, or 128 for attn2_decode_hd128):
// the batched prologue's per-thread loads are unrolled for it.
template <int HD = MAX_HEAD_DIM>
__device__ __forceinline__ void attn2_decode_body(const AttnArgs& a) {
    const int chunk = blockIdx.y, hd = a.head_dim, half = hd >> 1;
    // gridDim.x = n_kv * parts: `parts` CTAs share a KV head's chunk, each taking gn of its
    // group's q heads from q head q0 (ATTN_SPLIT on the host).
    const int group = a.n_q / a.n_kv, parts = gridDim.x / a.n_kv, gn = group / parts;
    const int kvh = blockIdx.x / parts, q0 = kvh * group + (blockIdx.x % parts) * gn;
    const int pos = a.state[STATE_POSITION];
    if (pos >= a.max_seq) return;
    const int valid = pos + 1, t0 = chunk * ATTN2_CHUNK;
    if (t0 >= valid) return;
    const int n_t = min(ATTN2_CHUNK, valid - t0);
    const int row_words = (hd >> 1) + 1;  // bf16 pairs per staged row, +1 word of padding

    __shared__ float q_s[ATTN2_MAX_GROUP_X_HD];
    __shared__ float kcur[MAX_HEAD_DIM], vcur[MAX_HEAD_DIM];
    __shared__ u32 k_s[ATTN2_CHUNK * (MAX_HEAD_DIM / 2 + 1)], v_s[ATTN2_CHUNK * (MAX_HEAD_DIM / 2 + 1)];
    __shared__ float p_s[ATTN2_MAX_GROUP][ATTN2_CHUNK];
    const size_t slot_stride = (size_t)a.n_kv * hd;

    // Rows t0 .. t0+n_t-1 of K and V (16-byte loads), skipping the live slot.
    const int vec_per_row = hd >> 3;  // uint4 = 8 bf16
    auto kv_offset = [&](int i) { return (size_t)(t0 + i / vec_per_row) * slot_stride + kvh * hd + (i % vec_per_row) * 8; };
    auto stage = [&](int i, uint4 kv, uint4 vv) {
        u32* kd = k_s + (i / vec_per_row) * row_words + (i % vec_per_row) * 4;
        u32* vd = v_s + (i / vec_per_row) * row_words + (i % vec_per_row) * 4;
        kd[0] = kv.x; kd[1] = kv.y; kd[2] = kv.z; kd[3] = kv.w;
        vd[0] = vv.x; vd[1] = vv.y; vd[2] = vv.z; vd[3] = vv.w;
    };
    auto live = [&](int i) { return t0 + i / vec_per_row == pos; };
    constexpr int KV_VECS = ATTN2_CHUNK * (HD / 8) / ATTN_THREADS;  // per thread, at most
    uint4 kreg[KV_VECS], vreg[KV_VECS];
#pragma unroll
    for (int u = 0; u < KV_VECS; u++) {
        const int i = threadIdx.x + u * ATTN_THREADS;
        if (i < n_t * vec_per_row && !live(i)) {
            kreg[u] = *reinterpret_cast<const uint4*>(a.k_cache + kv_offset(i));
            vreg[u] = *reinterpret_cast<const uint4*>(a.v_cache + kv_offset(i));
        }
    }
    pdl_enter();
    // Rotate the group's q heads (scale folded in) and the live k; take the live v.
    rotate_live_batched<HD>(a, kvh, q0, gn, pos, q_s, kcur, vcur, [&] {
#pragma unroll
        for (int u = 0; u < KV_VECS; u++) {
            const int i = threadIdx.x + u * ATTN_THREADS;
            if (i < n_t * vec_per_row && !live(i)) stage(i, kreg[u], vreg[u]);
        }
    });
    __syncthreads();
    if (pos >= t0 && pos < t0 + n_t) {
        const int t = pos - t0;
        for (int w = threadIdx.x; w < half; w += blockDim.x) {
            k_s[t * row_words + w] = (u32)f32_to_bf16(kcur[2 * w]) | ((u32)f32_to_bf16(kcur[2 * w + 1]) << 16);
            v_s[t * row_words + w] = (u32)f32_to_bf16(vcur[2 * w]) | ((u32)f32_to_bf16(vcur[2 * w + 1]) << 16);
        }
    }
    if (chunk == 0 && q0 == kvh * group) {  // one CTA of the KV head writes its slot
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            a.k_cache[pos * slot_stride + kvh * hd + d] = f32_to_bf16(kcur[d]);
            a.v_cache[pos * slot_stride + kvh * hd + d] = f32_to_bf16(vcur[d]);
        }
    }
    __syncthreads();

    // Scores: a warp takes one q head at a time, a lane one slot.
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int g = warp; g < gn; g += ATTN_WARPS) {
        float score = NEG_INF;
        if (lane < n_t) {
            const u32* krow = k_s + lane * row_words;
            const float* q = q_s + g * hd;
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // independent chains
            for (int w = 0; w < half; w += 2) {
#pragma unroll
                for (int u = 0; u < 2; u++) {
                    const u32 pair = krow[w + u];
                    acc[2 * u] = fmaf(q[2 * (w + u)], bf16_to_f32((u16)(pair & 0xffffu)), acc[2 * u]);
                    acc[2 * u + 1] = fmaf(q[2 * (w + u) + 1], bf16_to_f32((u16)(pair >> 16)), acc[2 * u + 1]);
                }
            }
            score = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        }
        const float m = warp_max(score);
        const float p = lane < n_t ? expf(score - m) : 0.0f;
        const float l = warp_sum(p);
        p_s[g][lane] = p;
        if (lane == 0) {
            const size_t at = ((size_t)(q0 + g) * gridDim.y + chunk) * 2;
            a.part_ml[at] = m;
            a.part_ml[at + 1] = l;
        }
    }
    __syncthreads();
    // Weighted sum of V: a thread takes one bf16 pair of dims for some heads of the group.
    const int pairs = half;
    for (int i = threadIdx.x; i < gn * pairs; i += blockDim.x) {
        const int g = i / pairs, w = i % pairs;
        float ax = 0.0f, ay = 0.0f;
        for (int t = 0; t < n_t; t++) {
            const u32 pair = v_s[t * row_words + w];
            const float p = p_s[g][t];
            ax = fmaf(p, bf16_to_f32((u16)(pair & 0xffffu)), ax);
            ay = fmaf(p, bf16_to_f32((u16)(pair >> 16)), ay);
        }
        float* out = a.part_acc + ((size_t)(q0 + g) * gridDim.y + chunk) * hd;
        out[2 * w] = ax;
        out[2 * w + 1] = ay;
    }
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn2_decode(AttnArgs a) {
    attn2_decode_body(a);
}
// The kernel for head_dim <= 128: its prologue unrolled for 128
// dims, 1,720 SASS instructions against 2,896. Why: each warp runs this code once, and its
// fetch is cold every layer; session 13 measured attention's time following its code size
// (-0.57 us a layer here; attention v3: 8,440 -> 4,984 instructions, -5 us).
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn2_decode_hd128(AttnArgs a) {
    attn2_decode_body<128>(a);
}

// Attention v3 (the default where clusters exist; DV2_ATTN_CLUSTERS=0 takes v2): attention v2's CTAs in
// thread-block clusters that merge their partials through distributed shared memory, so no
// merge kernel runs. Grid (parts, splits, n_kv), clusters of (1, splits): the CTAs of a
// cluster take the same q heads (as in v2) and split the valid slots into `splits` equal
// slices, each walking its slice in 32-slot chunks with an online softmax (the next chunk's K
// and V rows in registers while this one is used; the first before the wait, as v2's
// PRE_WAIT). Then rank r writes dims [r hd / splits, (r + 1) hd / splits) of the heads,
// combining every rank's max, sum and partial output from its shared memory.
// Why: the merge kernel added 2.1 us a layer in the graph (docs/lab.md, session 12) and v2's
// grid has a column per 32-slot chunk of max_seq (1,024 CTAs at 2,048 slots, most of which
// only read the position and leave); here the grid is n_kv * parts * splits CTAs whatever
// the context. Needs head_dim a multiple of splits (the host checks). Measured: -0.027
// ms/token against v2 and its merge at 1,728 instructions; it lost at 8,440 (+0.27) and 4,984
// (+0.076), its cluster barrier and GPU-scope fence costing less than the code did
// (docs/lab.md, sessions 13-14).
// HD: the head_dim when known at compile time (64 or 128: the K/V indexing by shifts, half
// the vectors unrolled), 0 for any. Loops stay rolled (#pragma unroll 1): each warp runs this
// code about once, and its cold fetch is the cost (docs/lab.md, session 13).
#define ATTN3_MAX_SPLITS 8
// The score and
// weighted-sum loops unrolled by 2 and 4 so that their shared loads issue together, and the
// softmax's max and sum over only the lanes that can hold a slot (3 shuffle rounds at <= 8
// slots, 4 at <= 16); the same values in the same order. Why: one q head per CTA leaves those
// loops one shared-load round trip per iteration on the kernel's serial chain (the weighted
// sum: 6-22 of them at the 3B shape's 8 splits), and the kernel mostly waits (docs/lab.md,
// session 15: 0.08 issued per scheduler cycle). Measured: -0.0055 ms/token (session 16, run 2).
template <int HD>
__device__ __forceinline__ void attn3_decode_body(const AttnArgs& a, float* out) {
    timeline_start();
    const int hd = HD ? HD : a.head_dim, half = hd >> 1;
    // Grid (parts, splits, n_kv): KV head z, its q heads [q0, q0 + gn) from the host's count.
    const int gn = a.heads_per_cta, group = gn * gridDim.x;
    const int kvh = blockIdx.z, q0 = kvh * group + blockIdx.x * gn;
    const int splits = cluster_size(), rank = cluster_rank();
    const int split_shift = log2_pow2(splits);  // splits: 1, 2, 4 or 8 (the host checks)
    const int pos = a.state[STATE_POSITION];
    if (pos >= a.max_seq) return;  // every CTA: no slot to write or read
    const int valid = pos + 1, per = (valid + splits - 1) >> split_shift;
    const int t_begin = min(valid, rank * per), t_end = min(valid, t_begin + per);
    const int row_words = half + 1;  // bf16 pairs per staged row, +1 word of padding

    __shared__ float q_s[ATTN2_MAX_GROUP_X_HD];
    __shared__ float kcur[MAX_HEAD_DIM], vcur[MAX_HEAD_DIM];
    __shared__ u32 k_s[ATTN2_CHUNK * (MAX_HEAD_DIM / 2 + 1)], v_s[ATTN2_CHUNK * (MAX_HEAD_DIM / 2 + 1)];
    __shared__ float p_s[ATTN2_MAX_GROUP][ATTN2_CHUNK];
    // Per head: the running max and sum, and the last chunk's rescale of the older terms.
    __shared__ float m_run[ATTN2_MAX_GROUP], l_run[ATTN2_MAX_GROUP], corr_s[ATTN2_MAX_GROUP];
    const size_t slot_stride = (size_t)a.n_kv * hd;

    // Rows t0 .. of K and V (16-byte loads) into registers, skipping the live slot.
    const int vec_per_row = hd >> 3;  // uint4 = 8 bf16
    constexpr int KV_VECS = ATTN2_CHUNK * ((HD ? HD : MAX_HEAD_DIM) / 8) / ATTN_THREADS;  // per thread, at most
    uint4 kreg[KV_VECS], vreg[KV_VECS];
    auto kv_vec = [&](int t0, int u, int n_t) {
        const int i = threadIdx.x + u * ATTN_THREADS;
        return i < n_t * vec_per_row && t0 + i / vec_per_row != pos ? i : -1;
    };
    auto load_rows = [&](int t0) {
        const int n_t = min(ATTN2_CHUNK, t_end - t0);
#pragma unroll
        for (int u = 0; u < KV_VECS; u++) {
            const int i = kv_vec(t0, u, n_t);
            if (i >= 0) {
                const size_t at = (size_t)(t0 + i / vec_per_row) * slot_stride + kvh * hd + (i % vec_per_row) * 8;
                kreg[u] = *reinterpret_cast<const uint4*>(a.k_cache + at);
                vreg[u] = *reinterpret_cast<const uint4*>(a.v_cache + at);
            }
        }
    };
    auto stage_rows = [&](int t0) {
        const int n_t = min(ATTN2_CHUNK, t_end - t0);
#pragma unroll
        for (int u = 0; u < KV_VECS; u++) {
            const int i = kv_vec(t0, u, n_t);
            if (i >= 0) {
                u32* kd = k_s + (i / vec_per_row) * row_words + (i % vec_per_row) * 4;
                u32* vd = v_s + (i / vec_per_row) * row_words + (i % vec_per_row) * 4;
                kd[0] = kreg[u].x; kd[1] = kreg[u].y; kd[2] = kreg[u].z; kd[3] = kreg[u].w;
                vd[0] = vreg[u].x; vd[1] = vreg[u].y; vd[2] = vreg[u].z; vd[3] = vreg[u].w;
            }
        }
    };
    if (t_begin < t_end) load_rows(t_begin);  // written by earlier steps: before the wait
    pdl_enter();
    rotate_live_batched<HD ? HD : MAX_HEAD_DIM, HD>(a, kvh, q0, gn, pos, q_s, kcur, vcur, [] {});
    if ((int)threadIdx.x < gn) {
        m_run[threadIdx.x] = NEG_INF;
        l_run[threadIdx.x] = 0.0f;
    }
    // The heads' running partial outputs, [gn][hd] (dynamic: gn * hd floats); a thread
    // keeps the same pairs of dims in every chunk.
    extern __shared__ __align__(16) float acc_s[];
    for (int i = threadIdx.x; i < gn * hd; i += blockDim.x) acc_s[i] = 0.0f;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int t0 = t_begin; t0 < t_end; t0 += ATTN2_CHUNK) {
        const int n_t = min(ATTN2_CHUNK, t_end - t0);
        stage_rows(t0);
        if (t0 + ATTN2_CHUNK < t_end) load_rows(t0 + ATTN2_CHUNK);
        __syncthreads();
        if (t0 == t_begin && rank == 0 && blockIdx.x == 0) {  // one CTA of the KV head writes its slot
            for (int d = threadIdx.x; d < hd; d += blockDim.x) {
                a.k_cache[pos * slot_stride + kvh * hd + d] = f32_to_bf16(kcur[d]);
                a.v_cache[pos * slot_stride + kvh * hd + d] = f32_to_bf16(vcur[d]);
            }
        }
        if (pos >= t0 && pos < t0 + n_t) {  // the live row, from the projections
            const int t = pos - t0;
            for (int w = threadIdx.x; w < half; w += blockDim.x) {
                k_s[t * row_words + w] = (u32)f32_to_bf16(kcur[2 * w]) | ((u32)f32_to_bf16(kcur[2 * w + 1]) << 16);
                v_s[t * row_words + w] = (u32)f32_to_bf16(vcur[2 * w]) | ((u32)f32_to_bf16(vcur[2 * w + 1]) << 16);
            }
            __syncthreads();
        }
        // Scores: a warp takes one q head at a time, `lanes` lanes a slot, each a 1/lanes of the
        // dims, added by shuffles; then lane t holds slot t's: 4 lanes a slot up to 8 slots, 2
        // up to 16 (docs/lab.md, session 16): the serial
        // dot product is 1/4 or 1/2 as long (a lane a slot walked every dim, most lanes idle at
        // a split's few slots). The running max and sum move on by this chunk.
        const int lanes = n_t <= 8 && half % 8 == 0 ? 4
                          : n_t <= 16 && half % 4 == 0 ? 2
                                                       : 1;
        const int lane_shift = lanes >> 1;  // log2(lanes) for 1, 2, 4
        const int slot = lane >> lane_shift, words = half >> lane_shift;
        for (int g = warp; g < gn; g += ATTN_WARPS) {
            float dot = 0.0f;
            if (slot < n_t) {
                const int w0 = (lane & (lanes - 1)) * words;
                const u32* krow = k_s + slot * row_words + w0;
                const float* q = q_s + g * hd + 2 * w0;
                float sacc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // independent chains
#pragma unroll 2
                for (int w = 0; w < words; w += 2) {
#pragma unroll
                    for (int u = 0; u < 2; u++) {
                        const u32 pair = krow[w + u];
                        sacc[2 * u] = fmaf(q[2 * (w + u)], bf16_to_f32((u16)(pair & 0xffffu)), sacc[2 * u]);
                        sacc[2 * u + 1] = fmaf(q[2 * (w + u) + 1], bf16_to_f32((u16)(pair >> 16)), sacc[2 * u + 1]);
                    }
                }
                dot = (sacc[0] + sacc[1]) + (sacc[2] + sacc[3]);
            }
            for (int o = 1; o < lanes; o <<= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
            if (lanes > 1) dot = __shfl_sync(0xffffffffu, dot, (lane << lane_shift) & 31);
            const float score = lane < n_t ? dot : NEG_INF;
            const float m_old = m_run[g];
            // The max and sum over lanes 0 .. span - 1 (every lane that can hold
            // a slot): lanes below n_t, which use the max, and lane 0, which keeps the sum, get
            // the warp-wide values, in the same order (the skipped rounds add zeros).
            const int span = n_t > 16 ? 32 : n_t > 8 ? 16 : 8;
            float m_chunk = score;
            for (int o = span >> 1; o > 0; o >>= 1) m_chunk = fmaxf(m_chunk, __shfl_xor_sync(0xffffffffu, m_chunk, o));
            const float m_new = fmaxf(m_old, m_chunk);
            const float p = lane < n_t ? expf(score - m_new) : 0.0f;
            float l = p;
            for (int o = span >> 1; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
            p_s[g][lane] = p;
            __syncwarp();  // every lane has read m_run[g]
            if (lane == 0) {
                const float corr = expf(m_old - m_new);
                corr_s[g] = corr;
                m_run[g] = m_new;
                l_run[g] = l_run[g] * corr + l;
            }
        }
        __syncthreads();
        // Weighted sum of V: a thread takes bf16 pairs of dims (g, w) of the group's heads.
        for (int i = threadIdx.x; i < gn * half; i += blockDim.x) {
            const int g = i / half, w = i % half;
            float ax = 0.0f, ay = 0.0f;
            constexpr int U = 4;  // slots per iteration, their loads together
#pragma unroll 1
            for (int t = 0; t < n_t; t += U) {
#pragma unroll
                for (int u = 0; u < U; u++) {
                    // Past n_t: p_s holds 0, and a zero pair keeps a stale row's bits out.
                    const u32 pair = t + u < n_t ? v_s[(t + u) * row_words + w] : 0u;
                    const float p = p_s[g][t + u];
                    ax = fmaf(p, bf16_to_f32((u16)(pair & 0xffffu)), ax);
                    ay = fmaf(p, bf16_to_f32((u16)(pair >> 16)), ay);
                }
            }
            const float c = corr_s[g];
            float2* acc = reinterpret_cast<float2*>(acc_s + g * hd + 2 * w);
            *acc = make_float2(fmaf(acc->x, c, ax), fmaf(acc->y, c, ay));
        }
        __syncthreads();  // k_s, v_s, p_s and corr_s free for the next chunk
    }
    // The merge across the cluster: rank r's dims of each head from every rank's max, sum and
    // partial output.
    const float* part = acc_s;
    cluster_arrive_cluster_release();  // m_run, l_run and acc_s are complete
    cluster_wait();
    const int dims = hd >> split_shift;
    for (int i = threadIdx.x; i < gn * dims; i += blockDim.x) {
        // HD a power of two: dims too, so i's split is shifts and masks.
        const int g = HD ? i >> log2_pow2(dims) : i / dims;
        const int d = rank * dims + (HD ? i & (dims - 1) : i % dims);
        float m[ATTN3_MAX_SPLITS], l[ATTN3_MAX_SPLITS], o[ATTN3_MAX_SPLITS];
#pragma unroll
        for (int r = 0; r < ATTN3_MAX_SPLITS; r++) {
            if (r < splits) {
                m[r] = load_from_cta(&m_run[g], r);
                l[r] = load_from_cta(&l_run[g], r);
                o[r] = load_from_cta(&part[g * hd + d], r);
            }
        }
        float M = NEG_INF;
#pragma unroll
        for (int r = 0; r < ATTN3_MAX_SPLITS; r++)
            if (r < splits) M = fmaxf(M, m[r]);
        float L = 0.0f, sum = 0.0f;
#pragma unroll
        for (int r = 0; r < ATTN3_MAX_SPLITS; r++) {
            if (r < splits) {
                const float w = expf(m[r] - M);  // 0 for an empty slice (m = -inf)
                L = fmaf(l[r], w, L);
                sum = fmaf(o[r], w, sum);
            }
        }
        out[(size_t)(q0 + g) * hd + d] = sum / L;
    }
    cluster_arrive_relaxed();  // this CTA has read its peers' shared memory (the values are used)
    cluster_wait();
    timeline_end();
}
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn3_decode(AttnArgs a, float* out) {
    attn3_decode_body<0>(a, out);
}
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn3_decode_hd128(AttnArgs a, float* out) {
    attn3_decode_body<128>(a, out);
}
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn3_decode_hd64(AttnArgs a, float* out) {
    attn3_decode_body<64>(a, out);
}

// Combines the chunks 0 .. ceil(valid_len / ATTN2_CHUNK)-1 of each q head. Grid n_q; the
// chunk weights exp(m_c - M) / L are computed once, in parallel, then every output sums its
// chunks with the loads in flight together.
// The first MERGE_AHEAD chunks' partials are loaded
// together with the position, before the number of chunks in use is known: their addresses
// do not depend on it (the buffers hold n_chunks chunks), so the state, m/l and acc round
// trips become one. Values loaded for chunks past the used ones are never used. Same
// arithmetic in the same order.
// With at most 32 chunks in use, every warp finds M,
// the weights and L itself, lane c taking chunk c, and keeps the weights in its own slice of
// shared memory: no CTA barrier (three before). The same values: the CTA-wide path has only
// warp 0 holding chunks then, and adds the other warps' zeros.
#define MERGE_AHEAD 8
#define MERGE_MAX_WARPS (MAX_HEAD_DIM / 32)
extern "C" __global__ void attn2_merge(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                       const int* __restrict__ state, float* out, int head_dim, int n_chunks,
                                       int max_seq) {
    pdl_enter();
    const int h = blockIdx.x;
    const float* ml = part_ml + (size_t)h * n_chunks * 2;
    const float* acc = part_acc + (size_t)h * n_chunks * head_dim;
    // m and l of chunk `lane` (the per-warp path's) and of chunk d0 (the CTA-wide path's first).
    float2 ml_lane = make_float2(NEG_INF, 0.0f), ml_d0 = ml_lane;
    float acc_ahead[MERGE_AHEAD];
    const int d0 = threadIdx.x, lane = threadIdx.x & 31;
    if (lane < n_chunks) ml_lane = reinterpret_cast<const float2*>(ml)[lane];
    if (d0 != lane && d0 < n_chunks) ml_d0 = reinterpret_cast<const float2*>(ml)[d0];
#pragma unroll
    for (int c = 0; c < MERGE_AHEAD; c++) acc_ahead[c] = c < n_chunks && d0 < head_dim ? acc[(size_t)c * head_dim + d0] : 0.0f;
    const int pos = state[STATE_POSITION];
    if (pos >= max_seq) return;
    const int used = min(pos / ATTN2_CHUNK + 1, ATTN2_MAX_CHUNKS);
    // m and l of chunk c (chunks `lane` and d0 from the early loads).
    auto ml_of = [&](int c) {
        return c == lane ? ml_lane : (c == d0 ? ml_d0 : reinterpret_cast<const float2*>(ml)[c]);
    };
    // out[d] for this thread's d's: the chunks' partial sums weighted by weight[c], times inv.
    auto weighted = [&](const float* weight, float inv) {
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
            float sum = 0.0f;
            int c = 0;
            if (d == d0) {
#pragma unroll
                for (; c < MERGE_AHEAD; c++) {
                    if (c >= used) break;
                    sum = fmaf(acc_ahead[c], weight[c], sum);
                }
            }
#pragma unroll 8
            for (; c < used; c++) sum = fmaf(acc[(size_t)c * head_dim + d], weight[c], sum);
            out[h * head_dim + d] = sum * inv;
        }
    };
    if (used <= 32) {
        __shared__ float warp_weight[MERGE_MAX_WARPS][32];
        const float2 mlc = lane < used ? ml_of(lane) : make_float2(NEG_INF, 0.0f);
        const float M = warp_max(mlc.x);
        const float w = lane < used ? expf(mlc.x - M) : 0.0f;
        const float L = warp_sum(mlc.y * w);
        float* mine = warp_weight[threadIdx.x >> 5];
        mine[lane] = w;
        __syncwarp();
        weighted(mine, 1.0f / L);
        return;
    }
    __shared__ float weight[ATTN2_MAX_CHUNKS];
    __shared__ float red[32];
    float m = NEG_INF;
    for (int c = threadIdx.x; c < used; c += blockDim.x) m = fmaxf(m, ml_of(c).x);
    m = warp_max(m);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    float M = NEG_INF;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) M = fmaxf(M, red[w]);
    __syncthreads();
    float l = 0.0f;
    for (int c = threadIdx.x; c < used; c += blockDim.x) {
        const float2 mlc = ml_of(c);
        const float w = expf(mlc.x - M);
        weight[c] = w;
        l += mlc.y * w;
    }
    l = warp_sum(l);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = l;
    __syncthreads();
    float L = 0.0f;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) L += red[w];
    weighted(weight, 1.0f / L);
}

// out[h*hd + d] = softmax-weighted sum over the splits of head h. Grid n_q, one thread per d.
extern "C" __global__ void attn_merge(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                      const int* __restrict__ state, float* out, int head_dim, int n_splits,
                                      int max_seq) {
    pdl_enter();
    if (state[STATE_POSITION] >= max_seq) return;
    const int h = blockIdx.x;
    const float* ml = part_ml + (size_t)h * n_splits * 2;
    float M = NEG_INF;
    for (int s = 0; s < n_splits; s++) M = fmaxf(M, ml[2 * s]);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float num = 0.0f, den = 0.0f;
        for (int s = 0; s < n_splits; s++) {
            if (ml[2 * s] == NEG_INF) continue;
            float w = expf(ml[2 * s] - M);
            num += part_acc[((size_t)h * n_splits + s) * head_dim + d] * w;
            den += ml[2 * s + 1] * w;
        }
        out[h * head_dim + d] = num / den;
    }
}

// state[NEXT_TOKEN] = argmax(logits): lowest index wins ties, NaN never wins. Does nothing
// once the request is finished (next_token stays the EOS id).
// The grid's CTAs (one per SM) each take a contiguous slice of the
// logits and leave their (value, index) in `scratch` (1 + 2 * gridDim.x words: an arrival
// count, then the pairs); the CTA that arrives last adds nothing but the final argmax over
// the pairs, in CTA order (so the result does not depend on which CTA is last), and resets
// the count for the next launch. Why: one CTA reading the whole vocabulary (600 KB at 152k
// ids) runs at one SM's share of the L2 bandwidth, several microseconds a token.
extern "C" __global__ void argmax_logits(const float* __restrict__ logits, int n, int* state, int* scratch) {
    pdl_enter();
    if (state[STATE_FINISHED]) return;
    float best = NEG_INF;
    int best_i = -1;
    auto take = [&](float v, int i) {
        if (v > best || (best_i < 0 && v == v)) {
            best = v;
            best_i = i;
        }
    };
    // Load latency bounds a slice, so each thread keeps four 16-byte loads in flight per
    // round. A thread's indices only rise, so the strict > above keeps the lowest index of a
    // tie. The last CTA also takes the n % 4 logits past the last float4.
    const int n4 = n >> 2, per = (n4 + gridDim.x - 1) / gridDim.x;
    const int q0 = blockIdx.x * per, q1 = min(n4, q0 + per);
    const float4* l4 = reinterpret_cast<const float4*>(logits);
    for (int base = q0 + threadIdx.x; base < q1; base += 4 * blockDim.x) {
        float4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int i = base + u * blockDim.x;
            if (i < q1) v[u] = l4[i];
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int i = base + u * blockDim.x;
            if (i >= q1) break;
            take(v[u].x, 4 * i);
            take(v[u].y, 4 * i + 1);
            take(v[u].z, 4 * i + 2);
            take(v[u].w, 4 * i + 3);
        }
    }
    if (blockIdx.x == gridDim.x - 1)
        for (int i = 4 * n4 + threadIdx.x; i < n; i += blockDim.x) take(logits[i], i);
    block_argmax(best, best_i);
    if (gridDim.x == 1) {
        if (threadIdx.x == 0) state[STATE_NEXT_TOKEN] = best_i < 0 ? 0 : best_i;
        return;
    }
    if (!argmax_across_ctas(best, best_i, scratch)) return;
    if (threadIdx.x == 0) state[STATE_NEXT_TOKEN] = best_i < 0 ? 0 : best_i;
}

// Prefill: the token of prompt position i (eager only: i is a launch argument).
extern "C" __global__ void load_token(int* state, const int* __restrict__ ids, int i) {
    pdl_enter();
    state[STATE_TOKEN] = ids[i];
}

// After a teacher-forced forward: the slot is written, move on.
extern "C" __global__ void advance(int* state) {
    pdl_enter();
    state[STATE_POSITION] += 1;
    state[STATE_VALID_LEN] = state[STATE_POSITION];
}

// After the last prompt id: feed the greedy id next; finished iff it is EOS (eos < 0: none).
extern "C" __global__ void finish_prefill(int* state, int eos) {
    pdl_enter();
    int next = state[STATE_NEXT_TOKEN];
    state[STATE_TOKEN] = next;
    state[STATE_FINISHED] = next == eos ? 1 : 0;
}

// The greedy commit: token = next_token, position += 1, valid_len = position,
// finished |= (next_token == eos), and the id appended to the step ring. A step that runs
// after the request finished (a replay past EOS) commits nothing.
extern "C" __global__ void commit_step(int* state, int eos, int* ring) {
    pdl_enter();
    if (state[STATE_FINISHED]) return;
    int next = state[STATE_NEXT_TOKEN];
    ring[state[STATE_RING_COUNT]++] = next;
    state[STATE_TOKEN] = next;
    state[STATE_POSITION] += 1;
    state[STATE_VALID_LEN] = state[STATE_POSITION];
    if (next == eos) state[STATE_FINISHED] = 1;
}

// Empties the step ring before a batch of steps.
extern "C" __global__ void ring_reset(int* state) {
    pdl_enter();
    state[STATE_RING_COUNT] = 0;
}
