// decodev2 kernels: the helpers every kernel file uses (compiled first; the unit's files in
// order: common.cuh, gemv.cu, attention.cu, small.cu, gemm.cu, gemv_mma.cu, attention_prefill.cu,
// attention_long.cu, sample.cu: src/cuda/kernels.rs `DECODE`; and before bench.cu in `BENCH`).
//
// Layouts (see src/nf4.rs for the NF4 packing):
//   NF4 matrix [rows, cols]: packed bytes [rows][cols/2] (element 2i in the high nibble of
//     byte i), absmax f16 [rows][cols/64]. A 16-byte chunk holds 32 elements of one block.
//   Activations f32. KV cache bf16 [kv_stride slots][n_kv][head_dim] per layer.
//   State int32[8]: the STATE_* indices (src/cuda/kernels.rs `state`).
//   History int32[max_seq + 1]: the id fed at each position of the request (the commits
//     write it; the sampler's penalties read it).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// Shapes and state indices shared with the host are -D options from src/cuda/kernels.rs
// (`shared_defines`), so the two sides cannot drift: GEMV_THREADS, ATTN_THREADS, MAX_HEAD_DIM,
// ATTN2_CHUNK, ATTN2_MAX_GROUP, ATTN2_MAX_GROUP_X_HD, ATTN2_MAX_CHUNKS and STATE_TOKEN,
// STATE_POSITION, STATE_VALID_LEN, STATE_NEXT_TOKEN, STATE_FINISHED, STATE_RING_COUNT,
// STATE_NONFINITE, STATE_LEN.
#if !defined(GEMV_THREADS) || !defined(ATTN_THREADS) || !defined(MAX_HEAD_DIM) || !defined(ATTN2_CHUNK) || \
    !defined(ATTN2_MAX_GROUP) || !defined(ATTN2_MAX_GROUP_X_HD) || !defined(ATTN2_MAX_CHUNKS) ||            \
    !defined(STATE_TOKEN) || !defined(STATE_POSITION) || !defined(STATE_VALID_LEN) ||                      \
    !defined(STATE_NEXT_TOKEN) || !defined(STATE_FINISHED) || !defined(STATE_RING_COUNT) ||               \
    !defined(STATE_NONFINITE) || !defined(STATE_LEN)
#error "the host passes the shared constants as -D options (src/cuda/kernels.rs)"
#endif
#if !defined(GEMM_WARPS) || !defined(ATTNM_WARPS) || !defined(ATTNP_THREADS) || \
    !defined(ATTNP_TILE) || !defined(ATTNP_Q_FLOATS) || !defined(ATTNL_RANKS) || !defined(ATTNL_MAX_GROUP) || \
    !defined(ATTNL_MAX_CLUSTERS) || !defined(ATTNP_MERGE_WAYS) || !defined(ATTNF_MERGE_GROUP) ||    \
    !defined(ATTNF_MAX_MERGE) || !defined(ATTNF_COUNTS)
#error "the host passes the prefill and long-attention constants as -D options (src/cuda/kernels.rs)"
#endif
#if !defined(NF4_CODEBOOK) || !defined(GEMV2_CTAS_PER_SM) || !defined(GEMV3_CTAS_PER_SM) || \
    !defined(GEMV3_KH2_CTAS_PER_SM) || !defined(SIZEOF_NF4REF) || !defined(SIZEOF_QKVARGS) ||  \
    !defined(SIZEOF_NORMARGS) || !defined(SIZEOF_ATTNARGS) || !defined(SIZEOF_GEMMARGS) ||      \
    !defined(SIZEOF_PREFILLATTNARGS)
#error "the host passes the codebook, CTAs per SM and struct sizes as -D options (src/cuda/kernels.rs)"
#endif
#if !defined(SAMPLE_THREADS) || !defined(SAMPLE_BINS) || !defined(SAMPLE_MAX_CTAS) || \
    !defined(SAMPLE_WORK_WORDS) || !defined(SIZEOF_SAMPLEPARAMS) || !defined(SAMPLE_CANDIDATES)
#error "the host passes the sampler's constants as -D options (src/cuda/kernels.rs)"
#endif
// The switches that compile kernels in or out (src/config.rs, nvrtc_defines): no default here,
// so the two sides cannot disagree.
#if !defined(GEMV2_LOGITS) || !defined(GEMV3_KHALVES) || !defined(CTA_TIMELINE)
#error "the host passes GEMV2_LOGITS, GEMV3_KHALVES and CTA_TIMELINE as -D options (src/config.rs)"
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

// c + a * b on f16 pairs, and a pair's sum in f32 (GEMV v2's walks; the bench's stand-in).
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

__device__ __forceinline__ u16 f32_to_f16(float f) {
    unsigned short r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// An NF4 block's scale (absmax): kept in f16 (src/nf4.rs), computed with in f32.
__device__ __forceinline__ float scale_f32(u16 bits) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
    return f;
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

// RoPE on one pair of a head's vector (dims j and j + head_dim/2) by the angle whose cosine
// and sine are c and s. Every kernel that rotates q or k (the decode attentions, rope_kv_rows,
// the column kernels' q/k/v store) takes this one expression, so the KV cache holds the same
// bits whichever path wrote a slot.
__device__ __forceinline__ float2 rope_pair(float x1, float x2, float c, float s) {
    return make_float2(x1 * c - x2 * s, x2 * c + x1 * s);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// warp_sum of each of a lane's N values (N a power of two up to 32) in N - 1 + 5 - log2(N)
// shuffles and as many adds, where N warp_sums take 5 N of each: each of the butterfly's first
// log2(N) levels keeps the half of the values its lane's bit picks and sends the other half.
// Returns value lane / (32 / N) of v, summed with the same additions in the same order as
// warp_sum's (each level adds the partner's copy to the lane's own): the same bits.
template <int N>
__device__ __forceinline__ float warp_sum_spread(float* v) {
    static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "a power of two values");
    const int lane = threadIdx.x & 31;
    int o = 16;
#pragma unroll
    for (int n = N; n > 1; n >>= 1, o >>= 1) {
        const bool upper = lane & o;
#pragma unroll
        for (int i = 0; i < n / 2; i++) {
            const float send = upper ? v[i] : v[i + n / 2];
            const float keep = upper ? v[i + n / 2] : v[i];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
        }
    }
    float s = v[0];
#pragma unroll
    for (; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

// log2 of n, a power of two (1 << log2_pow2(n) == n): a shift where code would divide.
__device__ __forceinline__ int log2_pow2(int n) { return __ffs(n) - 1; }

// Slots of each of `splits` splits of `valid` slots in the decode attentions without clusters
// (attention v2, the flat long-context attention) and their merge (attn2_merge): at least
// ATTN2_CHUNK, whole 16-slot tiles; ceil(valid / this) of them are in use, at most `splits`.
__device__ __forceinline__ int attn2_split_slots(int valid, int splits) {
    return (max((valid + splits - 1) / splits, ATTN2_CHUNK) + 15) & ~15;
}
// Those splits in use: the ones holding a slot below `valid` (at most ATTN2_MAX_CHUNKS, the
// host's bound on `splits`).
__device__ __forceinline__ int attn2_splits_used(int valid, int splits) {
    const int per = attn2_split_slots(valid, splits);
    return min((valid + per - 1) / per, ATTN2_MAX_CHUNKS);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// CTA_TIMELINE (an NVRTC define, DV2_CTA_TIMELINE=1; a measuring tool, off by default): each
// CTA's thread 0 appends records to dv2_timeline (read by CudaBackend::cta_timeline): at its
// PDL wait {grid id, kind 0 | SM | grid size | CTA, globaltimer before the wait, after it}, and
// where the GEMV and attention kernels start (kind 2), mark a phase (3 and up) and end (kind 1)
// {grid id, kind | ..., the time, 0}. Why: the kernel-level trace showed each kernel's first
// CTAs start well before the previous kernel ends and its last ones after, and skewing gate/up's
// rows by when its CTAs start gained 0.024 ms/token (docs/lab.md, session 17); this shows which
// CTAs start, wait and end when.
// The kernels that mark their start (timeline_start, and pdl_enter<true> for their wait) keep
// their records in shared memory and append them at their end with one atomic: each record's
// own atomic had stalled thread 0 a round trip at every mark, after the PDL wait (before
// launch_dependents) and at the start, inflating the phases the marks measure (the solo
// attention, docs/lab.md session 37). Their records are lost where a CTA leaves before its end
// (skip_if, clusters not in use). Other kernels record their wait with its own atomic.
#if CTA_TIMELINE
// A step of the 32B shape writes ~210,000 (64 layers of ~1,100 CTAs, 3 records each).
#define CTA_TIMELINE_RECORDS (1 << 19)
// A marked CTA's records at most: start, wait, four phases, end.
#define CTA_TIMELINE_CTA_RECORDS 8
__device__ unsigned long long dv2_timeline[CTA_TIMELINE_RECORDS * 4];
__device__ unsigned dv2_timeline_n;
__shared__ unsigned long long dv2_timeline_cta[CTA_TIMELINE_CTA_RECORDS][3];  // kind, t0, t1
__shared__ unsigned dv2_timeline_cta_n;
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// Appends `n` records of thread 0 to dv2_timeline, with this CTA's grid id, SM and index.
__device__ __forceinline__ void timeline_append(const unsigned long long (*recs)[3], unsigned n) {
    unsigned long long grid_id;
    unsigned sm;
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(grid_id));
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const unsigned ctas = gridDim.x * gridDim.y * gridDim.z;
    const unsigned first = atomicAdd(&dv2_timeline_n, n);
    for (unsigned k = 0; k < n; k++) {
        const unsigned i = first + k;
        if (i >= CTA_TIMELINE_RECORDS) return;
        unsigned long long* r = dv2_timeline + 4 * (size_t)i;
        r[0] = grid_id;
        r[1] = recs[k][0] << 56 | (unsigned long long)(sm & 0xffu) << 48 |
               (unsigned long long)(ctas & 0xffffffu) << 24 | (cta & 0xffffffu);
        r[2] = recs[k][1];
        r[3] = recs[k][2];
    }
}
// One record: kept in shared memory (KEPT: a marked kernel's) or appended at once.
template <bool KEPT>
__device__ __forceinline__ void timeline_record(unsigned long long kind, unsigned long long t0, unsigned long long t1) {
    if (threadIdx.x | threadIdx.y | threadIdx.z) return;
    if (!KEPT) {
        const unsigned long long rec[1][3] = {{kind, t0, t1}};
        timeline_append(rec, 1);
        return;
    }
    const unsigned n = dv2_timeline_cta_n;
    if (n >= CTA_TIMELINE_CTA_RECORDS) return;
    dv2_timeline_cta[n][0] = kind;
    dv2_timeline_cta[n][1] = t0;
    dv2_timeline_cta[n][2] = t1;
    dv2_timeline_cta_n = n + 1;
}
#endif
// Where a GEMV or attention CTA ends (CTA_TIMELINE): its records kept since timeline_start
// appended, this one last.
__device__ __forceinline__ void timeline_end() {
#if CTA_TIMELINE
    timeline_record<true>(1, global_ns(), 0);
    if (threadIdx.x | threadIdx.y | threadIdx.z) return;
    timeline_append(dv2_timeline_cta, dv2_timeline_cta_n);
#endif
}
// Where it starts (kind 2); from here the CTA keeps its records until timeline_end.
__device__ __forceinline__ void timeline_start() {
#if CTA_TIMELINE
    if ((threadIdx.x | threadIdx.y | threadIdx.z) == 0) dv2_timeline_cta_n = 0;
    timeline_record<true>(2, global_ns(), 0);
#endif
}
// Where a CTA's thread 0 reaches a phase of its kernel (kinds 3 and up, named where the
// kernel marks them: the long-context attention's prologue, tiles, warps' merge and cluster
// merge).
__device__ __forceinline__ void timeline_mark(unsigned long long kind) {
#if CTA_TIMELINE
    timeline_record<true>(kind, global_ns(), 0);
#else
    (void)kind;
#endif
}


// Programmatic dependent launch (sm_90+; the host asks for it per launch, src/cuda/device.rs):
// a kernel may start while the one before it still runs. pdl_wait() returns once the earlier
// kernels of the stream have finished and their writes are visible, so every kernel calls it
// before it reads or writes any buffer that another kernel touches; only the constant
// weights may be loaded before it. pdl_release() lets the next kernel start launching; each
// kernel calls it right after its wait, so at most one kernel waits ahead of the running one.
// Both are no-ops in a launch without the attribute.
// MARKED: the kernel called timeline_start (its wait's record kept with its others).
template <bool MARKED = false>
__device__ __forceinline__ void pdl_wait() {
#if CTA_TIMELINE
    const unsigned long long t0 = global_ns();
#endif
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#if CTA_TIMELINE
    timeline_record<MARKED>(0, t0, global_ns());
#endif
}

__device__ __forceinline__ void pdl_release() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The start of every kernel that loads nothing before waiting (MARKED: as pdl_wait).
template <bool MARKED = false>
__device__ __forceinline__ void pdl_enter() {
    pdl_wait<MARKED>();
    pdl_release();
}

// atomicAdd with release and acquire semantics at GPU scope: after a __syncthreads(), thread
// 0's add publishes the CTA's earlier writes, and what other CTAs published before their adds
// is visible to this CTA after the next __syncthreads() (CUTLASS's semaphore pattern; one
// fence where __threadfence() in every thread and an atomicAdd would take two).
__device__ __forceinline__ int atomic_add_acq_rel(int* p, int v) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

// Thread-block clusters (Hopper; the GEMM's K split, the column kernels' pairs, the
// long-context attention): the cluster's size and this CTA's rank in it (1 and 0 in a launch
// without clusters). Before sm_90 there are no clusters: every launch is its own cluster of
// one, and the host never launches the kernels that need more there (src/cuda/ops: the long
// attention's flat walk, the GEMM without its K split across CTAs).
#if __CUDA_ARCH__ >= 900
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
// Stores v at `local`'s offset in the shared memory of the cluster's CTA `rank`.
__device__ __forceinline__ void store_in_cta(float* local, int rank, float v) {
    const u32 addr = (u32)__cvta_generic_to_shared(local);
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(v) : "memory");
}
// One-shot pushes into a peer CTA's shared memory (st.async), counted in bytes on the
// receiver's mbarrier: the receiver waits for its bytes alone, with no fence that orders
// every earlier write for the cluster (fence.acq_rel.cluster is a MEMBAR.ALL.GPU in the SASS).
// The receiver's thread 0 initialises `bar` before a cluster barrier the senders wait on (so
// no push finds it uninitialised) and arms it for its bytes after that barrier (a push that
// lands first counts below zero until then); its threads then wait on phase 0.
__device__ __forceinline__ void push_barrier_init(u64* bar) {
    asm volatile(
        "mbarrier.init.shared::cta.b64 [%0], 1;\n\t"
        "fence.mbarrier_init.release.cluster;" ::"r"((u32)__cvta_generic_to_shared(bar))
        : "memory");
}
__device__ __forceinline__ void push_barrier_expect(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"((u32)__cvta_generic_to_shared(bar)),
                 "r"(bytes)
                 : "memory");
}
// `local`'s and `bar`'s addresses in the shared memory of the cluster's CTA `rank`.
__device__ __forceinline__ void map_to_cta(const void* local, const u64* bar, int rank, u32& dst, u32& rbar) {
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(dst) : "r"((u32)__cvta_generic_to_shared(local)), "r"(rank));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rbar) : "r"((u32)__cvta_generic_to_shared(bar)), "r"(rank));
}
// `v` at `local`'s offset in CTA `rank`, counted on that CTA's `bar`.
__device__ __forceinline__ void push_to_cta(float* local, int rank, float4 v, u64* bar) {
    u32 dst, rbar;
    map_to_cta(local, bar, rank, dst, rbar);
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(dst),
                 "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(rbar)
                 : "memory");
}
__device__ __forceinline__ void push2_to_cta(float* local, int rank, float2 v, u64* bar) {
    u32 dst, rbar;
    map_to_cta(local, bar, rank, dst, rbar);
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];" ::"r"(dst), "f"(v.x),
                 "f"(v.y), "r"(rbar)
                 : "memory");
}
// Until every byte `bar` was armed for has landed; the pushes' data visible after it.
__device__ __forceinline__ void push_barrier_wait(u64* bar) {
    asm volatile(
        "{\n\t.reg .pred done;\n"
        "WAIT:\n\t"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], 0;\n\t"
        "@!done bra WAIT;\n\t}" ::"r"((u32)__cvta_generic_to_shared(bar))
        : "memory");
}
#else
__device__ __forceinline__ int cluster_size() { return 1; }
__device__ __forceinline__ int cluster_rank() { return 0; }
__device__ __forceinline__ void cluster_arrive_relaxed() {}
__device__ __forceinline__ void cluster_arrive() {}
__device__ __forceinline__ void cluster_wait() { __syncthreads(); }
__device__ __forceinline__ void store_in_cta(float* local, int, float v) { *local = v; }
// A cluster of one: the pushes are this CTA's own stores, seen after a barrier.
__device__ __forceinline__ void push_barrier_init(u64*) {}
__device__ __forceinline__ void push_barrier_expect(u64*, u32) {}
__device__ __forceinline__ void push_to_cta(float* local, int, float4 v, u64*) {
    local[0] = v.x, local[1] = v.y, local[2] = v.z, local[3] = v.w;
}
__device__ __forceinline__ void push2_to_cta(float* local, int, float2 v, u64*) { local[0] = v.x, local[1] = v.y; }
__device__ __forceinline__ void push_barrier_wait(u64*) { __syncthreads(); }
#endif

// The bitsandbytes NF4 codebook, an initializer from the host (src/nf4.rs CODEBOOK, as -D
// NF4_CODEBOOK), so every kernel that copies it keeps its own local table.

// The codebook, copied to shared memory once per CTA: lanes index different entries, which a
// __constant__ table would serialize.
__device__ __forceinline__ void load_codebook(float* lut) {
    const float nf4[16] = NF4_CODEBOOK;
    if (threadIdx.x < 16) lut[threadIdx.x] = nf4[threadIdx.x];
}

struct Nf4Ref {
    const u8* packed;
    const u16* absmax;  // f16 bits
    float mma_scale;  // the tensor-core GEMM's power of two on absmax (kernels/gemm.cu)
};
// The host passes these structs by value (src/cuda/ops, src/cuda/weights.rs): its sizes, as
// -D options, must be these.
static_assert(sizeof(Nf4Ref) == SIZEOF_NF4REF, "Nf4Ref differs from the host's");

// q, k and v in one grid sharing x: rows [0, rows0) from m0, then m1, then m2, written
// contiguously to out with their biases (each bias may be null).
struct QkvArgs {
    Nf4Ref m[3];
    const float* bias[3];
    int rows[3];
};
static_assert(sizeof(QkvArgs) == SIZEOF_QKVARGS, "QkvArgs differs from the host's");

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
static_assert(sizeof(NormArgs) == SIZEOF_NORMARGS, "NormArgs differs from the host's");

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
// (gemm.cu) and GEMV v3 (gemv_mma.cu).
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
// A logit of this forward is inf or NaN: STATE_NONFINITE becomes 1 + the forward's position
// unless an earlier forward's is there (the host reads and clears it with the state).
__device__ __forceinline__ void mark_non_finite(int* state) {
    atomicCAS(&state[STATE_NONFINITE], 0, state[STATE_POSITION] + 1);
}

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
