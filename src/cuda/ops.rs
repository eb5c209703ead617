//! Kernel launches with their launch shapes: the one place that knows each kernel's argument
//! list and grid. The backend and the microbenchmarks both launch through [`Ops`].
//!
//! Variants, chosen at load (each kept so its gain can be measured against its absence):
//! `DV2_GEMV=v1|v2|v3` (default: v3 below 8 MB of weights, v2 above; v2: persistent CTAs, x
//! held in registers; v3: tensor cores, kernels/gemv_mma.cu) and `DV2_ATTN=v1|v2|v3`
//! (default v3 where the device has thread-block clusters, else v2; v2: `DV2_ATTN_SPLIT=n`
//! CTAs per KV head and 32-slot chunk, default 8, each taking an equal share of the GQA
//! group's q heads, then the merge kernel; v3: the same CTAs per KV head in clusters of
//! `DV2_ATTN3_SPLITS=n` (default 8) that split the context and merge among themselves;
//! `DV2_ATTN_BATCH=0` makes v2's prologue load and store in turn instead of issuing every
//! load first; `DV2_MERGE_EARLY=0` makes its merge load the partials only once it has read the
//! position). `DV2_GEMV2_PAIRS=0` makes GEMV v2 look weights up one at a time in the
//! 16-entry codebook (default: two at a time in a byte -> f32-pair table);
//! `DV2_GEMV2_XSMEM=0` makes its lanes load x from global memory (default: staged once per
//! CTA in shared memory); `DV2_GEMV2_LATE=0` runs its K-split sums and
//! epilogue per iteration (default: once per CTA). `DV2_GEMV3_EPI_EARLY=0` makes GEMV v3 load
//! its epilogue's operands after the reduction (default: as each row group starts);
//! `DV2_GEMV3_PREWAIT=0` makes it issue its first weights after the wait on the previous
//! kernel (default: before). `DV2_GEMV_WFIRST=0` makes GEMV v2 and v3 load x before their
//! first weights (default: weights first). `DV2_FUSE_RMS=0` runs each RMSNorm as
//! its own kernel instead of folding it into the next GEMV's x load (default, GEMV v2/v3:
//! the kernel that wrote x leaves partial sums of squares, [`Ops::producer_sums`]). v1 GEMV
//! takes `DV2_GEMV_NR=1|2|4|8` (rows per CTA); v2 takes `DV2_GEMV_CTAS=n` (CTAs per SM,
//! default 2 with its 128-register kernels, 1 with `DV2_GEMV2_NARROW=0`) and
//! `DV2_GEMV2_PREWAIT=0` (its first weights after the wait on the previous kernel; default
//! before, as v3).
//! `DV2_GEMM=v1|v2` forces the tensor-core GEMM kernel (v2: B staged in shared memory by
//! cp.async, K split at most 4 ways; v1: B read by each warp from global memory; default:
//! v1, as measured). `DV2_GEMM_X16=0` keeps the prefill's GEMM inputs in f32 (default f16,
//! written so by their producers, for v1; with f32 the default is v2 above 64 columns).
//! `DV2_GEMM_SPREAD=0` runs the GEMM's epilogue on the warp of K part 0 alone (default: the
//! row tile's n8 tiles spread over the warps of all its K parts).
//! `DV2_PREFILL_TAIL=0` runs the last layer of a prompt's last chunk on every token (default:
//! attention, o and the FFN on the last token only, the one whose output is used).
//! `DV2_GEMM_EARLY=0` makes the v1 GEMM wait for the previous kernel before it loads anything
//! (default: its codebook table and first weights before).
//! `DV2_GEMM_CLUSTER=0` keeps the v1 GEMM out of thread-block clusters (default: clusters of
//! two CTAs splitting K where the grid would fill at most half the SMs).
//! `DV2_ATTNP=simt` runs the prefill's attention on CUDA cores (default: tensor cores where
//! head_dim is 16, 32, 64 or 128), with `DV2_ATTNP_ROWS=8|32` rows per CTA;
//! `DV2_ATTNP_STAGE=v1` stages the tensor-core kernel's KV tiles as first written (loads
//! awaited inside each tile, V transposed by 2-byte stores; default: one tile ahead).
//! `DV2_LINEAR=mma` runs the decode step's linears through the prefill's tensor-core GEMM
//! at N = 1 (default `gemv`), so the two can be compared on the same step.

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaFunction, DeviceRepr, LaunchConfig};

use super::device::{driver_error, Gpu};
use super::kernels::{
    down_skew, gemv2_skew, logits_skew, Kernels, ATTN2_CHUNK, ATTN2_MAX_CHUNKS, ATTN2_MAX_GROUP,
    ATTN2_MAX_GROUP_X_HD, ATTNM_ROWS, ATTNM_THREADS, ATTNP_Q_FLOATS, ATTNP_ROWS, ATTNP_THREADS,
    ATTN_THREADS, GEMM_B2_STRIDE, GEMM_NT, GEMM_V2_MAX_KW, GEMM_WARPS, GEMM_WARP_ROWS, GEMV2_MAX_K,
    GEMV2_PRMT_TABLE, GEMV2_X16_STRIDE, GEMV2_X_STRIDE, GEMV3_MAX_K, GEMV3_WARPS, GEMV_THREADS,
    GEMV_WARPS, MAX_HEAD_DIM,
};
use super::weights::Nf4Ref;
use super::{env_number, switch_on};
use crate::arch::ArchSpec;
use crate::error::{Error, Result};

/// kernels/decode.cu `QkvArgs`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct QkvArgs {
    pub m: [Nf4Ref; 3],
    pub bias: [u64; 3],
    pub rows: [i32; 3],
}
// SAFETY: plain old data matching the kernel's struct (pointers as u64, ints as i32).
unsafe impl DeviceRepr for QkvArgs {}

/// kernels/decode.cu `L2Next`: address ranges a down GEMV v2 prefetches into L2 as its walk
/// ends (the next layer's q, k and v weights; `DV2_QKV_L2`), CTA b bytes [b share, (b + 1)
/// share) of each.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct L2Next {
    addr: [u64; L2_NEXT_RANGES],
    bytes: [u32; L2_NEXT_RANGES],
    share: [u32; L2_NEXT_RANGES],
}
// SAFETY: plain old data matching the kernel's struct (pointers as u64, then unsigned ints).
unsafe impl DeviceRepr for L2Next {}

/// Ranges the kernels' `L2Next` holds: packed bytes and absmax of three matrices.
pub const L2_NEXT_RANGES: usize = 6;

/// The most bytes a CTA's share of a range may be: the pieces GEMV v3's L2 prefetch sends
/// (kernels/gemv_mma.cu, l2_prefetch), a size one bulk prefetch is known to take.
const L2_PREFETCH_MAX: usize = 32 * 1024;

impl L2Next {
    const NONE: L2Next = L2Next {
        addr: [0; L2_NEXT_RANGES],
        bytes: [0; L2_NEXT_RANGES],
        share: [0; L2_NEXT_RANGES],
    };

    /// The packed bytes and absmax of `matrices` (`rows` x `cols` each) in shares for `ctas`
    /// CTAs; none where a share would pass one prefetch's limit.
    fn of(matrices: &[(Nf4Ref, usize, usize)], ctas: usize) -> L2Next {
        let mut next = L2Next::NONE;
        let ranges = matrices.iter().flat_map(|(m, rows, cols)| {
            [(m.packed, rows * cols / 2), (m.absmax, rows * cols / 16)]
        });
        for (i, (addr, bytes)) in ranges.take(L2_NEXT_RANGES).enumerate() {
            let share = bytes.div_ceil(ctas.max(1)).next_multiple_of(16);
            if share <= L2_PREFETCH_MAX {
                next.addr[i] = addr;
                next.bytes[i] = bytes as u32;
                next.share[i] = share as u32;
            }
        }
        next
    }
}

/// Where lm_head's argmax kernel ([`Ops::logits_argmax`]) leaves its result: the decode
/// state (next_token), the argmax scratch ([`ARGMAX_SCRATCH`] words, zero between launches),
/// and with `ring` (a device address, 0: none) the commit of the greedy id, as commit_step
/// (appended to the ring, fed next, finished at `eos`, -1: none).
#[derive(Clone, Copy, Debug)]
pub struct LogitsHead {
    pub state: u64,
    pub scratch: u64,
    pub eos: i32,
    pub ring: u64,
}

/// kernels/decode.cu `AttnArgs`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct AttnArgs {
    pub qkv: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub rope_cos: u64,
    pub rope_sin: u64,
    pub state: u64,
    pub part_acc: u64,
    pub part_ml: u64,
    pub n_q: i32,
    pub n_kv: i32,
    pub head_dim: i32,
    pub max_seq: i32,
    pub n_splits: i32,
    pub scale: f32,
    /// Attention v3's q heads per CTA (set by [`Ops::attention`]).
    pub heads_per_cta: i32,
    /// Where kernels built with `DV2_QKV_KHALVES` (default) find q/k/v's second K-half sums, which
    /// the attention adds ([`Ops::qkv`] says whether it wrote them after its rows; else a
    /// zeroed buffer of the rows; unread otherwise).
    pub qkv2: u64,
}
// SAFETY: plain old data matching the kernel's struct.
unsafe impl DeviceRepr for AttnArgs {}

/// kernels/prefill.cu `GemmArgs`.
#[repr(C)]
#[derive(Clone, Copy)]
struct GemmArgs {
    m: [Nf4Ref; 3],
    bias: [u64; 3],
    rows: [i32; 3],
    x: u64,
    y: u64,
    skip_if: u64,
    n: i32,
    k: i32,
    ldy: i32,
    kw: i32,
    norm: NormArgs,
    ss_out: u64,
    early: i32,
    spread: i32,
    pf_groups: i32,
}
// SAFETY: plain old data matching the kernel's struct.
unsafe impl DeviceRepr for GemmArgs {}

/// kernels/prefill.cu `PrefillAttnArgs`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct PrefillAttnArgs {
    pub qkv: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub state: u64,
    pub out: u64,
    pub n: i32,
    pub ld: i32,
    pub n_q: i32,
    pub n_kv: i32,
    pub head_dim: i32,
    /// Tokens per CTA of the CUDA-core kernels: set by [`Ops::attn_prefill`].
    pub qb: i32,
    pub scale: f32,
    /// Nonzero: `out` is written as f16 (the next GEMM's input, see [`Ops::prefill_f16`]).
    pub out_f16: i32,
    /// The chunk's token at row 0 of `qkv` and `out` (0, or the last token alone: its
    /// position is the state's plus `first`; the KV slots of the whole chunk are written).
    pub first: i32,
}
// SAFETY: plain old data matching the kernel's struct.
unsafe impl DeviceRepr for PrefillAttnArgs {}

/// What the tensor-core GEMM does with its sums.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Epilogue {
    /// `y = W x (+ bias)`.
    Store,
    /// `y += W x` (the residual add).
    Accumulate,
    /// `y = silu(gate x) * (up x)`: the matrices are gate and up.
    Swiglu,
}

/// One matrix of a GEMM: stacked matrices (q, k, v) write consecutive rows of y.
#[derive(Clone, Copy, Debug)]
pub struct GemmMatrix {
    pub m: Nf4Ref,
    pub rows: usize,
    /// Device address of f32 [rows], or 0.
    pub bias: u64,
}

/// Tokens per CTA of the prefill attention for a model's group and head_dim, with at most
/// `rows` (token, q head) rows per CTA, or None when one token's rows do not fit a CTA.
pub fn attn_prefill_tokens(group: usize, head_dim: usize, rows: usize) -> Option<usize> {
    let rows = rows.min(ATTNP_ROWS).min(ATTNP_Q_FLOATS / head_dim);
    (group <= rows).then(|| rows / group)
}

/// kernels/decode.cu `NormArgs`: RMSNorm weights (bf16; 0 = no norm), epsilon, and the
/// producer's partial sums of squares of x.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct NormArgs {
    pub w: u64,
    pub eps: f32,
    pub ss_parts: i32,
    pub ss: u64,
}
// SAFETY: plain old data matching the kernel's struct (pointer, float, int, pointer).
unsafe impl DeviceRepr for NormArgs {}

impl NormArgs {
    const NONE: Self = Self {
        w: 0,
        eps: 0.0,
        ss_parts: 0,
        ss: 0,
    };
}

/// GEMV v2's `x_smem` argument for an f16 x (kernels/decode.cu, GEMV2_X_F16) and its `late`
/// flag for an f16 SwiGLU output (GEMV2_OUT_F16).
const GEMV2_X_F16: i32 = 2;
const GEMV2_OUT_F16: i32 = 8;

/// Room for partial sums of squares: more than any GEMV grid (v2: at most 8 CTAs per SM,
/// v3: 2) on a 132-SM device.
pub const MAX_PARTIAL_SUMS: usize = 4096;

/// The most CTAs argmax_logits runs; its scratch holds an arrival count and a (value,
/// index) pair per CTA.
pub const MAX_ARGMAX_CTAS: usize = 1024;
pub const ARGMAX_SCRATCH: usize = 1 + 2 * MAX_ARGMAX_CTAS;

/// Partial sums of squares of a vector, one per CTA of the kernel that wrote it: `parts`
/// f32 at device address `ptr`.
#[derive(Clone, Copy, Debug)]
pub struct PartialSums {
    pub ptr: u64,
    pub parts: usize,
}

/// An RMSNorm to apply to a GEMV's input: weights, epsilon, a buffer for the normed x when
/// the norm runs as its own kernel, and the partial sums of squares of x when its producer
/// left them (then the GEMV v2/v3 kernels fold the norm into their x load).
#[derive(Clone, Copy)]
pub struct Norm {
    pub w: u64,
    pub eps: f32,
    pub scratch: u64,
    pub sums: Option<PartialSums>,
}

/// A GEMV's input vector, raw or to be RMS-normed first; f32, or f16 where its writer made
/// it so ([`Ops::ffn_act_f16`]).
#[derive(Clone, Copy)]
pub struct Input {
    pub x: u64,
    pub norm: Option<Norm>,
    pub f16: bool,
}

impl Input {
    pub fn raw(x: u64) -> Self {
        Self {
            x,
            norm: None,
            f16: false,
        }
    }

    /// A raw input of f16 values.
    pub fn raw_f16(x: u64) -> Self {
        Self {
            f16: true,
            ..Self::raw(x)
        }
    }
}

/// Which kernels run the decode step's linears.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Linear {
    Gemv,
    Mma,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    V1,
    V2,
    /// GEMV: tensor cores (kernels/gemv_mma.cu); attention: clusters that merge their own
    /// partials (kernels/decode.cu, attn3_decode).
    V3,
}

/// The GEMV kernel: the default, or one forced by `DV2_GEMV`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemvChoice {
    /// v3 (tensor cores) for matrices under this many bytes of packed weights
    /// ([`GEMV3_AUTO_MAX_BYTES`] unless `DV2_GEMV3_MAX_MB` says otherwise), v2 for the larger
    /// ones: the faster of the two at each Qwen2.5-3B shape (docs/lab.md).
    Auto(usize),
    Fixed(Variant),
}

/// Packed NF4 bytes below which [`GemvChoice::Auto`] takes GEMV v3: v3 measured faster on
/// q/k/v (3.0 MB) and o (2.4 MB), v2 on down (12.7 MB), gate+up (25 MB) and lm_head.
pub const GEMV3_AUTO_MAX_BYTES: usize = 8 << 20;

/// The tensor-core GEMM kernel: the default, or one forced by `DV2_GEMM`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmVariant {
    /// v1 (with f16 activations; with `DV2_GEMM_X16=0`, v2 above 64 columns): the faster
    /// on the Qwen2.5-3B prefill (docs/lab.md).
    Auto,
    Fixed(Variant),
}

/// Attention time splits of a KV capacity: v1 splits it in up to 32 parts; v2 in chunks
/// of 32 slots. The arena holds partials for the larger of the two.
pub fn attn_partials(max_seq: usize) -> usize {
    attn_splits_v1(max_seq).max(max_seq.div_ceil(ATTN2_CHUNK))
}

fn attn_splits_v1(max_seq: usize) -> usize {
    (max_seq / 64).clamp(1, 32)
}

pub fn one_cta(threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub struct Ops {
    pub gpu: Gpu,
    pub k: Kernels,
    /// The GEMV kernels: [`GemvChoice::Auto`] (default) picks per matrix.
    pub gemv: GemvChoice,
    /// The decode attention: v3 (default where the device has thread-block clusters) runs
    /// v2's CTAs in clusters of [`Ops::attn3_splits`] that split the context and merge through
    /// distributed shared memory (no merge kernel); `DV2_ATTN=v2`: a CTA per 32-slot chunk
    /// and the merge kernel; `DV2_ATTN=v1`: a CTA per (q head, split).
    pub attn: Variant,
    /// Attention v3's CTAs per cluster, each taking an equal slice of the context
    /// (`DV2_ATTN3_SPLITS=1|2|4|8`, default 8).
    pub attn3_splits: usize,
    /// `DV2_GEMV2_SKEW=n` (rows; default 2, `0`: off): the SwiGLU GEMV v2's first half of CTAs
    /// takes n rows more each than an equal share, the rest share what is left
    /// ([`skewed_split`]). Measured -0.024/-0.026 ms/token at 2, the best of -8..8 (docs/lab.md,
    /// sessions 17-18).
    pub gemv2_skew: i32,
    /// The same for the plain GEMV v2 kernels (down at the 3B shape; `DV2_DOWN_SKEW=n`) and
    /// lm_head's argmax kernels (`DV2_LOGITS_SKEW=n`), default 0: measured slower at ±2 and
    /// ±16 (+0.004..0.008, session 18). Their kernels hold the split only with either set
    /// ([`super::kernels`]).
    pub down_skew: i32,
    pub logits_skew: i32,
    /// Attention v2 issues all its prologue loads before its first shared store (default;
    /// `DV2_ATTN_BATCH=0`: load and store in turn).
    pub attn_batch: bool,
    /// The v2 attention loads its chunk's K and V before waiting for the q/k/v GEMV (default
    /// with the batched prologue; `DV2_ATTN_PREWAIT=0`: after).
    pub attn_pre_wait: bool,
    /// Attention v2 (batched, loads before the wait) in its kernel unrolled for head_dim <=
    /// 128 where the model's is (default; `DV2_ATTN_HD128=0`: the kernel for any head_dim).
    /// The same arithmetic in less code, whose cold fetch each warp waits for.
    pub attn_hd128: bool,
    /// The CTAs that share a KV head's chunk in attention v2, each taking an equal share of
    /// its group's q heads (`DV2_ATTN_SPLIT=n`, default 8, at most the group: one q head per
    /// CTA on the Qwen2.5-3B shape, −0.005..−0.006 ms/token against 4, docs/lab.md session 12;
    /// 1: the whole group in one CTA).
    pub attn_split: usize,
    /// CTAs of argmax_logits (`DV2_ARGMAX_CTAS=n`, default one per SM; 1: one CTA of 1024
    /// threads reads all the logits).
    pub argmax_ctas: u32,
    /// The step's commit in lm_head's argmax kernel where that kernel runs ([`LogitsHead`];
    /// default; `DV2_COMMIT_FUSED=0`: commit_step after it).
    pub commit_fused: bool,
    /// GEMV v2 looks weights up two at a time in a byte -> pair table (default;
    /// `DV2_GEMV2_PAIRS=0`: one at a time in the 16-entry codebook).
    pub gemv2_pairs: bool,
    /// GEMV v1's rows per CTA (`DV2_GEMV_NR=1|2|4|8`; default by the matrix's rows).
    pub gemv_nr: Option<u32>,
    /// GEMV v2's CTAs per SM (`DV2_GEMV_CTAS=1..8`; default 2 with the narrow kernels, which
    /// fit two to an SM, else 1).
    pub gemv_ctas: u32,
    /// That table's pairs are f16, multiplied with x as f16x2 (default; `DV2_GEMV2_H16=0`: f32).
    pub gemv2_h16: bool,
    /// With the f16 pairs, half the rows in flight per warp in at most 128 registers, so that
    /// a CTA fits beside a GEMV v3 CTA and two fit an SM (default; `DV2_GEMV2_NARROW=0`: the
    /// 182-236-register kernels, one CTA per SM).
    pub gemv2_narrow: bool,
    /// GEMV v2 with K split over warps adds the parts and runs the epilogue once per CTA,
    /// after its last rows (default; `DV2_GEMV2_LATE=0`: per iteration, two barriers each).
    pub gemv2_late: bool,
    /// With late sums, GEMV v2 loads each row's epilogue operands (bias, the residual's old
    /// y) right after its wait, not after the last barrier (default; `DV2_GEMV2_EPI_EARLY=0`).
    pub gemv2_epi_early: bool,
    /// Late sums also without a K split: every row's epilogue after the walk (default;
    /// `DV2_GEMV2_LATE1=0`: lane 0 of each warp stores its rows as it goes).
    pub gemv2_late_one: bool,
    /// The SwiGLU output written as f16 for the down GEMV, which stages it so: half its bytes
    /// (default; `DV2_FFN_F16=0`: f32, rounded to f16 by the down GEMV; the same bits). Only
    /// where both are GEMV v2 with the f16-pair table and x staged ([`Ops::ffn_act_f16`]).
    pub ffn_f16: bool,
    /// GEMV v3 keeps about this many KB of each CTA's next weight rows prefetched into
    /// L2 (`DV2_L2_AHEAD_KB=n`; default 0, no prefetch: docs/lab.md, session 8).
    pub l2_ahead_kb: usize,
    /// GEMV v3 in kernels holding only the decode step's input and output code where a call is
    /// that use (default; `DV2_GEMV3_LEAN=0`: the kernels for any, choosing at run time).
    pub gemv3_lean: bool,
    /// RMSNorm folded into the next GEMV's x load from the producer's partial sums of squares
    /// (default; `DV2_FUSE_RMS=0`: the RMSNorm kernel).
    pub fuse_rms: bool,
    pub linear: Linear,
    /// The tensor-core GEMM: v2 stages B in shared memory, v1 reads it per warp.
    pub gemm: GemmVariant,
    /// Prefill chunks on the v1 GEMM keep the GEMMs' inputs in f16, written so by their
    /// producers (default; `DV2_GEMM_X16=0`: f32, rounded to f16 by the GEMM).
    pub gemm_x16: bool,
    /// The GEMM in 6 n8 tiles (33 to 48 columns; default) besides 1, 4 and 8
    /// (`DV2_GEMM_NT6=0`: 8 tiles there).
    pub gemm_nt6: bool,
    /// The v1 GEMM in clusters of two CTAs splitting K where its grid would fill at most
    /// half the SMs (default; `DV2_GEMM_CLUSTER=0`: never).
    pub gemm_cluster: bool,
    /// The v1 GEMM loads its codebook table and first weights before waiting for the
    /// previous kernel (default; `DV2_GEMM_EARLY=0`: after).
    pub gemm_early: bool,
    /// The last layer of a prompt's last chunk runs attention, o and the FFN on the last
    /// token only (default; `DV2_PREFILL_TAIL=0`: on every token).
    pub prefill_tail: bool,
    /// The GEMM's epilogue spread over the warps that summed a row tile's K parts (default;
    /// `DV2_GEMM_SPREAD=0`: on part 0's warp alone).
    pub gemm_spread: bool,
    /// The prefill attention on CUDA cores (`DV2_ATTNP=simt`) instead of tensor cores.
    pub attnp_simt: bool,
    /// The tensor-core prefill attention's KV tiles staged as first written
    /// (`DV2_ATTNP_STAGE=v1`) instead of one tile ahead.
    pub attnp_stage1: bool,
    /// (token, q head) rows per CTA of the CUDA-core prefill attention: `DV2_ATTNP_ROWS=32`,
    /// default 8 (more CTAs, measured faster).
    pub attnp_rows: usize,
    /// Streaming multiprocessors of the device.
    pub(super) sms: u32,
}

impl Ops {
    pub fn new(gpu: Gpu) -> Result<Self> {
        let k = Kernels::load(&gpu)?;
        let sms = gpu
            .ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver_error("multiprocessor count"))? as u32;
        let gemv2_narrow = switch_on("DV2_GEMV2_NARROW");
        let gpu_clusters = gpu.clusters;
        Ok(Self {
            gpu,
            k,
            gemv: match std::env::var("DV2_GEMV").as_deref() {
                Ok("v1") => GemvChoice::Fixed(Variant::V1),
                Ok("v2") => GemvChoice::Fixed(Variant::V2),
                Ok("v3") => GemvChoice::Fixed(Variant::V3),
                _ => GemvChoice::Auto(
                    env_number::<usize>("DV2_GEMV3_MAX_MB")
                        .map_or(GEMV3_AUTO_MAX_BYTES, |mb| mb << 20),
                ),
            },
            attn: match std::env::var("DV2_ATTN").as_deref() {
                Ok("v1") => Variant::V1,
                Ok("v2") => Variant::V2,
                _ if gpu_clusters => Variant::V3,
                _ => Variant::V2,
            },
            gemv2_skew: gemv2_skew(),
            down_skew: down_skew(),
            logits_skew: logits_skew(),
            attn3_splits: env_number("DV2_ATTN3_SPLITS")
                .filter(|n| matches!(n, 1 | 2 | 4 | 8))
                .unwrap_or(8),
            attn_batch: switch_on("DV2_ATTN_BATCH"),
            attn_pre_wait: switch_on("DV2_ATTN_PREWAIT"),
            attn_hd128: switch_on("DV2_ATTN_HD128"),
            attn_split: env_number("DV2_ATTN_SPLIT")
                .filter(|&n| n >= 1)
                .unwrap_or(8),
            argmax_ctas: env_number("DV2_ARGMAX_CTAS")
                .filter(|n| (1..=MAX_ARGMAX_CTAS as u32).contains(n))
                .unwrap_or(sms.min(MAX_ARGMAX_CTAS as u32)),
            commit_fused: switch_on("DV2_COMMIT_FUSED"),
            gemv2_pairs: switch_on("DV2_GEMV2_PAIRS"),
            gemv_nr: env_number("DV2_GEMV_NR").filter(|nr| matches!(nr, 1 | 2 | 4 | 8)),
            gemv_ctas: env_number("DV2_GEMV_CTAS")
                .filter(|n| (1..=8).contains(n))
                .unwrap_or(if gemv2_narrow { 2 } else { 1 }),
            gemv2_h16: switch_on("DV2_GEMV2_H16"),
            gemv2_narrow,
            gemv2_late: switch_on("DV2_GEMV2_LATE"),
            gemv2_epi_early: switch_on("DV2_GEMV2_EPI_EARLY"),
            gemv2_late_one: switch_on("DV2_GEMV2_LATE1"),
            ffn_f16: switch_on("DV2_FFN_F16"),
            l2_ahead_kb: env_number("DV2_L2_AHEAD_KB").unwrap_or(0),
            gemv3_lean: switch_on("DV2_GEMV3_LEAN"),
            fuse_rms: switch_on("DV2_FUSE_RMS"),
            attnp_simt: std::env::var("DV2_ATTNP").is_ok_and(|v| v == "simt"),
            attnp_stage1: std::env::var("DV2_ATTNP_STAGE").as_deref() == Ok("v1"),
            attnp_rows: match std::env::var("DV2_ATTNP_ROWS").as_deref() {
                Ok("32") => 32,
                _ => 8,
            },
            gemm: match std::env::var("DV2_GEMM").as_deref() {
                Ok("v1") => GemmVariant::Fixed(Variant::V1),
                Ok("v2") => GemmVariant::Fixed(Variant::V2),
                _ => GemmVariant::Auto,
            },
            gemm_x16: switch_on("DV2_GEMM_X16"),
            gemm_nt6: switch_on("DV2_GEMM_NT6"),
            gemm_cluster: switch_on("DV2_GEMM_CLUSTER"),
            gemm_early: switch_on("DV2_GEMM_EARLY"),
            prefill_tail: switch_on("DV2_PREFILL_TAIL"),
            gemm_spread: switch_on("DV2_GEMM_SPREAD"),
            linear: match std::env::var("DV2_LINEAR").as_deref() {
                Ok("mma") => Linear::Mma,
                _ => Linear::Gemv,
            },
            sms,
        })
    }

    /// Checks the shapes the chosen kernels take; attention v2 and v3 fall back to v1 where
    /// their shared-memory layout does not fit the model.
    pub fn fit(&mut self, s: &ArchSpec, max_seq: usize) -> Result<()> {
        if s.head_dim > MAX_HEAD_DIM || s.head_dim % 8 != 0 {
            return Err(Error::Unsupported(format!(
                "head_dim {} (the CUDA kernels take a multiple of 8 up to {MAX_HEAD_DIM})",
                s.head_dim
            )));
        }
        let group = s.n_q_heads / s.n_kv_heads;
        if group > ATTN2_MAX_GROUP
            || group * s.head_dim > ATTN2_MAX_GROUP_X_HD
            || max_seq.div_ceil(ATTN2_CHUNK) > ATTN2_MAX_CHUNKS
        {
            self.attn = Variant::V1;
        }
        for k in [s.hidden, s.intermediate] {
            gemv2_shape(k)?;
        }
        Ok(())
    }

    fn gemv_v1_launch(&self, rows: usize) -> (u32, LaunchConfig) {
        let kparts = match self.gemv_nr {
            Some(nr) => GEMV_WARPS / nr,
            _ if rows >= 4096 => 1,
            _ if rows >= 1024 => 2,
            _ => 8,
        };
        let rows_per_cta = (GEMV_WARPS / kparts) as usize;
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(rows_per_cta) as u32, 1, 1),
            block_dim: (GEMV_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        (kparts, cfg)
    }

    /// GEMV v2's codebook table, the first index of its kernel arrays: 0 byte -> f16 pair,
    /// 1 byte -> f32 pair, 2 nibble, 3 byte -> f16 pair with half the rows in flight in 128
    /// registers (the default).
    fn gemv2_table(&self) -> usize {
        match (self.gemv2_pairs, self.gemv2_h16) {
            (false, _) => 2,
            (true, false) => 1,
            (true, true) if self.gemv2_narrow => 3,
            (true, true) => 0,
        }
    }

    /// How many units of `rows` weight rows of K = `cols` fit a CTA's L2 prefetch window
    /// ([`Self::l2_ahead_kb`]; at least one unless the window is 0).
    fn l2_ahead(&self, rows: usize, cols: usize) -> usize {
        let unit = rows * (cols / 2 + cols / 16);
        match self.l2_ahead_kb {
            0 => 0,
            kb => (kb * 1024 / unit).max(1),
        }
    }

    /// argmax_logits' grid: one CTA of 1024 threads, or `argmax_ctas` of 256.
    pub fn argmax_launch(&self) -> LaunchConfig {
        let (ctas, threads) = match self.argmax_ctas {
            1 => (1, 1024),
            n => (n, 256),
        };
        LaunchConfig {
            grid_dim: (ctas, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// GEMV v2's switch arguments: x staged in shared memory, and the `late` flags
    /// (kernels/decode.cu: 1 late K sums, 2 the epilogue operands early, 4 late sums without a
    /// K split too). When it loads its first weights is an NVRTC define (kernels.rs, options).
    fn gemv2_switches(&self) -> (i32, i32) {
        (
            i32::from(self.k.gemv2_x_smem),
            i32::from(self.gemv2_late)
                | i32::from(self.gemv2_late && self.gemv2_epi_early) << 1
                | i32::from(self.gemv2_late && self.gemv2_late_one) << 2,
        )
    }

    /// v2: (chunks per lane J, warps per row) for K = cols, and the persistent grid (x staged
    /// from f16 with `x_f16`).
    fn gemv_v2_launch(
        &self,
        rows: usize,
        cols: usize,
        x_f16: bool,
    ) -> Result<(usize, u32, LaunchConfig)> {
        let (j, kparts) = gemv2_shape(cols)?;
        let row_lanes = (GEMV_WARPS / kparts) as usize;
        let ctas = (self.sms * self.gemv_ctas)
            .min(rows.div_ceil(row_lanes) as u32)
            .max(1);
        let cfg = LaunchConfig {
            grid_dim: (ctas, 1, 1),
            block_dim: (GEMV_THREADS, 1, 1),
            shared_mem_bytes: if x_f16 {
                (cols / 32 * GEMV2_X16_STRIDE * 4) as u32
            } else if self.k.gemv2_x_smem {
                (cols / 32 * GEMV2_X_STRIDE * 4) as u32
            } else {
                0
            },
        };
        Ok((j, kparts, cfg))
    }

    /// Resolves a GEMV input: with a norm whose partial sums the producer left and a GEMV v2
    /// or v3 kernel, the raw x and the norm arguments for the kernel's x load; otherwise the
    /// RMSNorm kernel writes the normed x to the scratch buffer, which the GEMV then reads.
    fn input(&self, input: Input, cols: usize, kernel: Variant) -> Result<(u64, NormArgs)> {
        match input.norm {
            None => Ok((input.x, NormArgs::NONE)),
            Some(Norm {
                w,
                eps,
                sums: Some(sums),
                ..
            }) if kernel != Variant::V1 && self.linear == Linear::Gemv => Ok((
                input.x,
                NormArgs {
                    w,
                    eps,
                    ss_parts: sums.parts as i32,
                    ss: sums.ptr,
                },
            )),
            Some(n) => {
                self.rms(input.x, n.w, n.scratch, cols, n.eps)?;
                Ok((n.scratch, NormArgs::NONE))
            }
        }
    }

    /// `out = x * rsqrt(mean(x^2) + eps) * w` over `n` elements (one CTA).
    pub fn rms(&self, x: u64, w: u64, out: u64, n: usize, eps: f32) -> Result<()> {
        self.rms_rows(x, w, out, n, eps, 1, false)
    }

    /// [`Self::rms`] on each of `rows` consecutive rows of `n` elements (a CTA per row);
    /// with `out_f16`, `out` is written as f16.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_rows(
        &self,
        x: u64,
        w: u64,
        out: u64,
        n: usize,
        eps: f32,
        rows: usize,
        out_f16: bool,
    ) -> Result<()> {
        let (n, f16) = (n as i32, out_f16 as i32);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            ..one_cta(512)
        };
        launch!(self.gpu, &self.k.rms_norm, cfg; x, w, out, n, eps, f16)
    }

    /// Whether the GEMM takes v2 (B staged in shared memory) at `n` columns: by default
    /// never while activations are f16 (v1 reading f16 beat v2 on the 3B prefill at chunk
    /// 512, docs/lab.md), else above 64 columns.
    fn gemm_v2(&self, n: usize) -> bool {
        match self.gemm {
            GemmVariant::Auto => !self.gemm_x16 && n > 64,
            GemmVariant::Fixed(v) => v == Variant::V2,
        }
    }

    /// Whether a prefill chunk of `n` tokens keeps its GEMM inputs in f16: the producers (the
    /// RMSNorm rows, the attention, the SwiGLU epilogue) write f16 and the GEMM (v1) reads
    /// it as is.
    pub fn prefill_f16(&self, n: usize) -> bool {
        self.gemm_x16 && !self.gemm_v2(n)
    }

    /// The NF4 tensor-core GEMM over `n` columns: `x` is f32 [n][k], `y` f32 [n][ldy]; the
    /// matrices are stacked by rows (SwiGLU: gate and up). With `f16` (only where
    /// [`Self::prefill_f16`] says so) x is f16 and the SwiGLU output too. Skipped on the
    /// device while `*skip_if != 0` (0: never).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        epilogue: Epilogue,
        mats: &[GemmMatrix],
        k: usize,
        x: u64,
        n: usize,
        y: u64,
        ldy: usize,
        skip_if: u64,
        f16: bool,
    ) -> Result<()> {
        let mut args = GemmArgs {
            m: [Nf4Ref::default(); 3],
            bias: [0; 3],
            rows: [0; 3],
            x,
            y,
            skip_if,
            n: n as i32,
            k: k as i32,
            ldy: ldy as i32,
            kw: 1,
            norm: NormArgs::NONE,
            ss_out: 0,
            early: i32::from(self.gemm_early),
            spread: i32::from(self.gemm_spread),
            pf_groups: 0,
        };
        for (i, m) in mats.iter().enumerate() {
            args.m[i] = m.m;
            args.bias[i] = m.bias;
            args.rows[i] = m.rows as i32;
        }
        // SwiGLU sums only the gate's rows into outputs; its warps take 16 outputs each.
        let (out_rows, warp_rows) = match epilogue {
            Epilogue::Swiglu => (mats[0].rows, GEMM_WARP_ROWS / 2),
            _ => (mats.iter().map(|m| m.rows).sum(), GEMM_WARP_ROWS),
        };
        let (width, ctas_n) = gemm_width(n, self.gemm_nt6);
        let tiles = out_rows.div_ceil(warp_rows);
        let v2 = self.gemm_v2(n);
        if f16 && v2 {
            return Err(Error::Unsupported(
                "the v2 GEMM takes f32 activations only".into(),
            ));
        }
        let max_kw = if v2 { GEMM_V2_MAX_KW } else { GEMM_WARPS };
        let kw = gemm_k_parts(tiles, ctas_n, k / 64, self.sms as usize, max_kw);
        args.kw = kw as i32;
        let ctas_m = tiles.div_ceil(GEMM_WARPS / kw);
        let cluster_z = if !v2 && self.gemm_cluster {
            gemm_cluster(ctas_m * ctas_n, kw, k / 64, self.sms as usize)
        } else {
            1
        };
        let cfg = LaunchConfig {
            grid_dim: (ctas_m as u32, ctas_n as u32, cluster_z),
            block_dim: ((GEMM_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: if v2 {
                gemm_v2_smem(GEMM_NT[width], kw) as u32
            } else {
                0
            },
        };
        // [v1, v2, v1 with f16 activations]
        let v = if f16 { 2 } else { v2 as usize };
        let f = match epilogue {
            Epilogue::Store => &self.k.gemm_store[v][width],
            Epilogue::Accumulate => &self.k.gemm_acc[v][width],
            Epilogue::Swiglu => &self.k.gemm_swiglu[v][width],
        };
        launch!(self.gpu, f, cfg, cluster = (1, 1, cluster_z); args)
    }

    /// The GEMV kernel for a `rows` x `cols` NF4 matrix (gate and up count together).
    fn gemv_kernel(&self, rows: usize, cols: usize) -> Variant {
        match self.gemv {
            GemvChoice::Fixed(v) => v,
            GemvChoice::Auto(v3_max_bytes) => auto_gemv(rows, cols, v3_max_bytes),
        }
    }

    /// GEMV v3: `y = W x` on tensor cores for the stacked matrices `mats` (store with bias,
    /// accumulate into y, or SwiGLU of gate and up); with `halves` (the store epilogue, its
    /// lean use) in K halves: the first half's sums with the bias at y, the second's at y +
    /// the rows.
    #[allow(clippy::too_many_arguments)]
    fn gemv3(
        &self,
        epilogue: Epilogue,
        mats: &[GemmMatrix],
        k: usize,
        x: u64,
        norm: NormArgs,
        y: u64,
        skip_if: u64,
        ss_out: u64,
        halves: bool,
    ) -> Result<usize> {
        if k > GEMV3_MAX_K || k % 64 != 0 {
            return Err(Error::Unsupported(format!(
                "K = {k}: GEMV v3 takes multiples of 64 up to {GEMV3_MAX_K}"
            )));
        }
        // The accumulate kernel takes one matrix only (kernels/gemv_mma.cu, gemv3_stacked).
        if epilogue == Epilogue::Accumulate && mats.len() != 1 {
            return Err(Error::Internal(
                "GEMV v3 accumulates one matrix at a time".into(),
            ));
        }
        // A row group is 16 outputs: 16 rows, SwiGLU's 16 gate and 16 up rows.
        let group_rows = if epilogue == Epilogue::Swiglu { 32 } else { 16 };
        let mut args = GemmArgs {
            m: [Nf4Ref::default(); 3],
            bias: [0; 3],
            rows: [0; 3],
            x,
            y,
            skip_if,
            n: 1,
            k: k as i32,
            ldy: 0,
            kw: GEMV3_WARPS as i32,
            norm,
            ss_out,
            early: 0,
            spread: 0,
            pf_groups: self.l2_ahead(group_rows, k) as i32,
        };
        for (i, m) in mats.iter().enumerate() {
            args.m[i] = m.m;
            args.bias[i] = m.bias;
            args.rows[i] = m.rows as i32;
        }
        // The lean kernels where the call is the decode step's use of its epilogue.
        let lean = match epilogue {
            Epilogue::Store | Epilogue::Swiglu => norm.w != 0 && ss_out == 0,
            Epilogue::Accumulate => norm.w == 0 && ss_out != 0,
        };
        let kernels = if lean && self.gemv3_lean {
            &self.k.gemv3_lean
        } else {
            &self.k.gemv3
        };
        let (f, outputs) = match epilogue {
            Epilogue::Store => (&kernels[0], mats.iter().map(|m| m.rows).sum()),
            Epilogue::Accumulate => (&kernels[1], mats[0].rows),
            Epilogue::Swiglu => (&kernels[2], mats[0].rows),
        };
        // Persistent: two CTAs per SM (the registers allow two), each looping over groups
        // of 16 outputs.
        let groups = outputs.div_ceil(16) as u32;
        let mut cfg = LaunchConfig {
            grid_dim: (groups.min(2 * self.sms).max(1), 1, 1),
            block_dim: ((GEMV3_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: (k * 2) as u32,
        };
        if let (true, Some(kh2)) = (halves, &self.k.gemv3_qkv_kh2) {
            if epilogue != Epilogue::Store || ss_out != 0 {
                return Err(Error::Internal(
                    "GEMV v3 in K halves stores without sums".into(),
                ));
            }
            // Two CTAs a row group, three an SM (the kernel's bounds).
            cfg.grid_dim.0 = 2 * groups.min(3 * self.sms / 2).max(1);
            args.ldy = outputs as i32;
            launch!(self.gpu, kh2, cfg; args)?;
            return Ok(cfg.grid_dim.0 as usize);
        }
        check_sums(ss_out, cfg.grid_dim.0)?;
        launch!(self.gpu, f, cfg; args)?;
        Ok(cfg.grid_dim.0 as usize)
    }

    /// The tensor-core prefill attention for `head_dim` (16, 32, 64 or 128), unless
    /// `DV2_ATTNP=simt` asks for the CUDA-core kernels.
    fn attn_prefill_mma(&self, head_dim: usize) -> Option<&CudaFunction> {
        if self.attnp_simt {
            return None;
        }
        let i = [16, 32, 64, 128].iter().position(|&d| d == head_dim)?;
        Some(if self.attnp_stage1 {
            &self.k.attn_prefill_mma1[i]
        } else {
            &self.k.attn_prefill_mma[i]
        })
    }

    /// Whether the prefill attention takes the model's shape (else prefill runs token by
    /// token through the decode step).
    pub fn attn_prefill_fits(&self, group: usize, head_dim: usize) -> bool {
        self.attn_prefill_mma(head_dim).is_some()
            || attn_prefill_tokens(group, head_dim, ATTNP_ROWS).is_some()
    }

    /// Causal attention of a chunk of `args.n` tokens (q and k already rotated, the chunk's
    /// K/V already in the cache). `args.qb` is ignored: the CUDA-core kernels take
    /// `attnp_rows` rows per CTA (raised to ATTNP_ROWS when one token's q heads need it).
    pub fn attn_prefill(&self, args: PrefillAttnArgs) -> Result<()> {
        if let Some(f) = self.attn_prefill_mma(args.head_dim as usize) {
            let rows = (args.n * args.n_q / args.n_kv) as u32;
            let cfg = LaunchConfig {
                grid_dim: (args.n_kv as u32, rows.div_ceil(ATTNM_ROWS as u32), 1),
                block_dim: (ATTNM_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            return launch!(self.gpu, f, cfg; args);
        }
        let (group, head_dim) = ((args.n_q / args.n_kv) as usize, args.head_dim as usize);
        let tokens = attn_prefill_tokens(group, head_dim, self.attnp_rows)
            .or_else(|| attn_prefill_tokens(group, head_dim, ATTNP_ROWS))
            .ok_or_else(|| {
                Error::Unsupported(format!(
                    "prefill attention: {group} q heads per KV head at head_dim {head_dim}"
                ))
            })?;
        let args = PrefillAttnArgs {
            qb: tokens as i32,
            ..args
        };
        let cfg = LaunchConfig {
            grid_dim: (
                args.n_kv as u32,
                (args.n as u32).div_ceil(args.qb as u32),
                1,
            ),
            block_dim: (ATTNP_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // The kernel with the fewest rows per warp that holds the CTA's rows.
        let rows = (args.qb * args.n_q / args.n_kv) as usize;
        let f = &self.k.attn_prefill[(rows > 8) as usize];
        launch!(self.gpu, f, cfg; args)
    }

    /// `y = W x`; with `accumulate`, `y += W x`. Skipped on the device while `*skip_if != 0`
    /// (`skip_if` = 0: never). With `ss_out` (a device address, 0: none; GEMV v2/v3 only, see
    /// [`Ops::producer_sums`]), each CTA leaves the sum of squares of the y it wrote there;
    /// returns how many (the CTAs of the launch). `next`: matrices (rows, cols), at most
    /// [`L2_NEXT_RANGES`] / 2, that GEMV v2 prefetches into L2 at the end of its walk where the
    /// kernels hold the code (`DV2_QKV_L2`); the other kernels ignore it.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv(
        &self,
        m: Nf4Ref,
        rows: usize,
        cols: usize,
        input: Input,
        y: u64,
        accumulate: bool,
        skip_if: u64,
        ss_out: u64,
        next: &[(Nf4Ref, usize, usize)],
    ) -> Result<usize> {
        let (rows_i, cols_i, acc, bias) = (rows as i32, cols as i32, accumulate as i32, 0u64);
        let kernel = self.gemv_kernel(rows, cols);
        if input.f16 && !self.stages_f16(kernel) {
            return Err(Error::Internal(
                "an f16 input given to a GEMV kernel that reads f32".into(),
            ));
        }
        let (x, norm) = self.input(input, cols, kernel)?;
        let epilogue = if accumulate {
            Epilogue::Accumulate
        } else {
            Epilogue::Store
        };
        let mats = [GemmMatrix { m, rows, bias: 0 }];
        if self.linear == Linear::Mma {
            self.no_sums(ss_out)?;
            self.gemm(epilogue, &mats, cols, x, 1, y, rows, skip_if, false)?;
            return Ok(0);
        }
        match kernel {
            Variant::V1 => {
                self.no_sums(ss_out)?;
                let (kparts, cfg) = self.gemv_v1_launch(rows);
                let kp = kparts as i32;
                launch!(self.gpu, &self.k.gemv_nf4, cfg; m, x, y, bias, rows_i, cols_i, kp, acc, skip_if)?;
                Ok(0)
            }
            Variant::V3 => self.gemv3(epilogue, &mats, cols, x, norm, y, skip_if, ss_out, false),
            Variant::V2 => {
                let (j, kparts, cfg) = self.gemv_v2_launch(rows, cols, input.f16)?;
                let kp = kparts as i32;
                check_sums(ss_out, cfg.grid_dim.0)?;
                let (xs, late) = self.gemv2_switches();
                // An f16 x goes to the kernels built for it (the f16-pair table, stages_f16).
                let (f, xs) = match (input.f16, self.gemv2_table()) {
                    (true, table) => (&self.k.gemv2_nf4_x16[usize::from(table == 3)], GEMV2_X_F16),
                    (false, table) => (&self.k.gemv2_nf4[table], xs),
                };
                let next = if self.k.qkv_l2 {
                    L2Next::of(next, cfg.grid_dim.0 as usize)
                } else {
                    L2Next::NONE
                };
                let (early_ctas, early_rows) = skewed_split(rows, cfg.grid_dim.0, self.down_skew);
                launch!(self.gpu, &f[j - 1], cfg; m, x, norm, y, bias, rows_i, cols_i, kp, acc, skip_if, ss_out, xs, late, next, early_ctas, early_rows)?;
                Ok(cfg.grid_dim.0 as usize)
            }
        }
    }

    /// lm_head and the greedy argmax in one GEMV v2 kernel (`DV2_LOGITS_ARGMAX`, which
    /// compiles it): the logits of `m` into `y` as [`Ops::gemv`] stores them, their argmax into
    /// the state's next_token, and with `head.ring` the step's commit as commit_step does it;
    /// all skipped while `*skip_if != 0`. Returns false, having launched nothing, where the
    /// kernel does not apply (not compiled, or lm_head not on the default GEMV v2 kernels); the
    /// caller then runs [`Ops::gemv`] and argmax_logits.
    #[allow(clippy::too_many_arguments)]
    pub fn logits_argmax(
        &self,
        m: Nf4Ref,
        rows: usize,
        cols: usize,
        input: Input,
        y: u64,
        skip_if: u64,
        head: LogitsHead,
    ) -> Result<bool> {
        let Some(kernels) = &self.k.gemv2_logits else {
            return Ok(false);
        };
        let kernel = self.gemv_kernel(rows, cols);
        if self.linear != Linear::Gemv
            || kernel != Variant::V2
            || input.f16
            || self.gemv2_table() != 3
        {
            return Ok(false);
        }
        let (j, kparts, mut cfg) = self.gemv_v2_launch(rows, cols, false)?;
        if cfg.grid_dim.0 as usize > MAX_ARGMAX_CTAS {
            return Ok(false);
        }
        if self.k.logits_prmt {
            cfg.shared_mem_bytes += GEMV2_PRMT_TABLE as u32; // the table, before x
        }
        // After the last check: without the producer's sums this launches the RMSNorm kernel.
        let (x, norm) = self.input(input, cols, kernel)?;
        let (rows_i, cols_i, kp) = (rows as i32, cols as i32, kparts as i32);
        let (xs, late) = self.gemv2_switches();
        let LogitsHead {
            state,
            scratch,
            eos,
            ring,
        } = head;
        let (early_ctas, early_rows) = skewed_split(rows, cfg.grid_dim.0, self.logits_skew);
        launch!(self.gpu, &kernels[j - 1], cfg; m, x, norm, y, rows_i, cols_i, kp, skip_if, xs, late, state, scratch, eos, ring, early_ctas, early_rows)?;
        Ok(true)
    }

    /// Whether a GEMV `kernel` takes an f16 input ([`Input::raw_f16`]): GEMV v2 with the
    /// f16-pair table and x staged in shared memory.
    fn stages_f16(&self, kernel: Variant) -> bool {
        self.linear == Linear::Gemv
            && kernel == Variant::V2
            && self.k.gemv2_x_smem
            && matches!(self.gemv2_table(), 0 | 3)
    }

    /// Whether the GEMV of a `rows` x `cols` matrix takes an f16 input.
    pub fn gemv_takes_f16(&self, rows: usize, cols: usize) -> bool {
        self.stages_f16(self.gemv_kernel(rows, cols))
    }

    /// Whether the SwiGLU of two `rows` x `cols` matrices can write f16 (GEMV v2).
    pub fn swiglu_writes_f16(&self, rows: usize, cols: usize) -> bool {
        self.linear == Linear::Gemv && self.gemv_kernel(2 * rows, cols) == Variant::V2
    }

    /// Whether the decode step writes the SwiGLU output (`intermediate` values from K =
    /// `hidden`) as f16 for the down GEMV (`DV2_FFN_F16`, default on): both are GEMV v2, and
    /// down stages an f16 x.
    pub fn ffn_act_f16(&self, intermediate: usize, hidden: usize) -> bool {
        self.ffn_f16
            && self.swiglu_writes_f16(intermediate, hidden)
            && self.gemv_takes_f16(hidden, intermediate)
    }

    /// Whether the decode step's GEMVs leave partial sums of squares for the next RMSNorm
    /// (`DV2_FUSE_RMS`, default on; the GEMV v2 and v3 kernels only).
    pub fn producer_sums(&self) -> bool {
        self.fuse_rms && self.linear == Linear::Gemv && self.gemv != GemvChoice::Fixed(Variant::V1)
    }

    fn no_sums(&self, ss_out: u64) -> Result<()> {
        if ss_out != 0 {
            return Err(Error::Internal(
                "partial sums of squares asked of a kernel without them".into(),
            ));
        }
        Ok(())
    }

    /// q, k and v rows of `args` in one grid, written contiguously to `out`.
    /// Returns whether GEMV v3 ran in K halves (`DV2_QKV_KHALVES`, default, with attention v3, which
    /// adds them): `out` then holds the second half's sums after the rows.
    pub fn qkv(&self, args: QkvArgs, cols: usize, input: Input, out: u64) -> Result<bool> {
        let rows = args.rows.iter().sum::<i32>() as usize;
        let cols_i = cols as i32;
        let kernel = self.gemv_kernel(rows, cols);
        let (x, norm) = self.input(input, cols, kernel)?;
        let mats = [0, 1, 2].map(|i| GemmMatrix {
            m: args.m[i],
            rows: args.rows[i] as usize,
            bias: args.bias[i],
        });
        if self.linear == Linear::Mma {
            return self
                .gemm(Epilogue::Store, &mats, cols, x, 1, out, rows, 0, false)
                .map(|_| false);
        }
        match kernel {
            Variant::V1 => {
                let (kparts, cfg) = self.gemv_v1_launch(rows);
                let kp = kparts as i32;
                launch!(self.gpu, &self.k.gemv_qkv, cfg; args, x, out, cols_i, kp).map(|_| false)
            }
            Variant::V3 => {
                let halves = self.k.gemv3_qkv_kh2.is_some()
                    && self.attn == Variant::V3
                    && self.gemv3_lean
                    && norm.w != 0
                    && cols % 128 == 0;
                self.gemv3(Epilogue::Store, &mats, cols, x, norm, out, 0, 0, halves)?;
                Ok(halves)
            }
            Variant::V2 => {
                let (j, kparts, cfg) = self.gemv_v2_launch(rows, cols, false)?;
                let kp = kparts as i32;
                let (xs, late) = self.gemv2_switches();
                launch!(self.gpu, &self.k.gemv2_qkv[self.gemv2_table()][j - 1], cfg; args, x, norm, out, cols_i, kp, xs, late)
                    .map(|_| false)
            }
        }
    }

    /// `out = silu(gate x) * (up x)`, f32, or f16 with `out_f16` (only as
    /// [`Ops::swiglu_writes_f16`] allows).
    #[allow(clippy::too_many_arguments)]
    pub fn swiglu(
        &self,
        gate: Nf4Ref,
        up: Nf4Ref,
        rows: usize,
        cols: usize,
        input: Input,
        out: u64,
        out_f16: bool,
    ) -> Result<()> {
        let (rows_i, cols_i) = (rows as i32, cols as i32);
        let kernel = self.gemv_kernel(2 * rows, cols);
        if out_f16 && !self.swiglu_writes_f16(rows, cols) {
            return Err(Error::Internal(
                "an f16 SwiGLU output asked of a kernel that writes f32".into(),
            ));
        }
        let (x, norm) = self.input(input, cols, kernel)?;
        let mats = [gate, up].map(|m| GemmMatrix { m, rows, bias: 0 });
        if self.linear == Linear::Mma {
            return self.gemm(Epilogue::Swiglu, &mats, cols, x, 1, out, rows, 0, false);
        }
        match kernel {
            Variant::V1 => {
                let (kparts, cfg) = self.gemv_v1_launch(rows);
                let kp = kparts as i32;
                launch!(self.gpu, &self.k.gemv_swiglu, cfg; gate, up, x, out, rows_i, cols_i, kp)
            }
            Variant::V3 => self
                .gemv3(Epilogue::Swiglu, &mats, cols, x, norm, out, 0, 0, false)
                .map(|_| ()),
            Variant::V2 => {
                let (j, kparts, cfg) = self.gemv_v2_launch(rows, cols, false)?;
                let kp = kparts as i32;
                let (xs, late) = self.gemv2_switches();
                let late = late | if out_f16 { GEMV2_OUT_F16 } else { 0 };
                let (early_ctas, early_rows) = skewed_split(rows, cfg.grid_dim.0, self.gemv2_skew);
                launch!(self.gpu, &self.k.gemv2_swiglu[self.gemv2_table()][j - 1], cfg; gate, up, x, norm, out, rows_i, cols_i, kp, xs, late, early_ctas, early_rows)
            }
        }
    }

    /// Attention of one layer (RoPE and the KV write fused), then the merge into `out`.
    /// `args.n_splits` and `args.heads_per_cta` are ignored: each variant sets its own.
    pub fn attention(&self, args: AttnArgs, out: u64) -> Result<()> {
        let max_seq = args.max_seq as usize;
        let merge = LaunchConfig {
            grid_dim: (args.n_q as u32, 1, 1),
            block_dim: ((args.head_dim as u32).next_multiple_of(32), 1, 1),
            shared_mem_bytes: 0,
        };
        let (pa, pm, st, hd, ms) = (
            args.part_acc,
            args.part_ml,
            args.state,
            args.head_dim,
            args.max_seq,
        );
        match self.attn {
            Variant::V1 => {
                let args = AttnArgs {
                    n_splits: attn_splits_v1(max_seq) as i32,
                    ..args
                };
                let cfg = LaunchConfig {
                    grid_dim: (args.n_q as u32, args.n_splits as u32, 1),
                    block_dim: (ATTN_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                let ns = args.n_splits;
                launch!(self.gpu, &self.k.attn_decode, cfg; args)?;
                launch!(self.gpu, &self.k.attn_merge, merge; pa, pm, st, out, hd, ns, ms)
            }
            Variant::V3 => {
                let splits = self.attn3_splits as u32;
                let parts = attn_split_parts(self.attn_split, (args.n_q / args.n_kv) as usize);
                // Dynamic shared memory: the running outputs of a CTA's q heads.
                let heads = (args.n_q / args.n_kv) as usize / parts;
                let args = AttnArgs {
                    n_splits: splits as i32,
                    heads_per_cta: heads as i32,
                    ..args
                };
                // Grid (parts, splits, KV heads): the kernel takes its KV head from z and its
                // heads per CTA from the arguments, no division in code each warp runs once.
                let cfg = LaunchConfig {
                    grid_dim: (parts as u32, splits, args.n_kv as u32),
                    block_dim: (ATTN_THREADS, 1, 1),
                    shared_mem_bytes: (heads * args.head_dim as usize * 4) as u32,
                };
                let f = &self.k.attn3_decode[match args.head_dim {
                    128 => 1,
                    64 => 2,
                    _ => 0,
                }];
                launch!(self.gpu, f, cfg, cluster = (1, splits, 1); args, out)
            }
            Variant::V2 => {
                let chunks = max_seq.div_ceil(ATTN2_CHUNK);
                let args = AttnArgs {
                    n_splits: chunks as i32,
                    ..args
                };
                let parts = attn_split_parts(self.attn_split, (args.n_q / args.n_kv) as usize);
                let cfg = LaunchConfig {
                    grid_dim: ((args.n_kv as usize * parts) as u32, chunks as u32, 1),
                    block_dim: (ATTN_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                let nc = chunks as i32;
                let f = match (self.attn_batch, self.attn_pre_wait) {
                    (true, true) if self.attn_hd128 && args.head_dim <= 128 => {
                        &self.k.attn2_decode_hd128
                    }
                    (true, true) => &self.k.attn2_decode,
                    (true, false) => &self.k.attn2_decode_late,
                    (false, _) => &self.k.attn2_decode_serial,
                };
                launch!(self.gpu, f, cfg; args)?;
                launch!(self.gpu, &self.k.attn2_merge, merge; pa, pm, st, out, hd, nc, ms)
            }
        }
    }
}

/// CTAs per KV head for attention v2: the largest divisor of the GQA `group` that is at
/// most `requested`, so every CTA takes the same number of q heads.
fn attn_split_parts(requested: usize, group: usize) -> usize {
    (1..=requested.min(group).max(1))
        .rev()
        .find(|p| group % p == 0)
        .unwrap_or(1)
}

/// The partial sums of a grid of `ctas` must fit [`MAX_PARTIAL_SUMS`].
fn check_sums(ss_out: u64, ctas: u32) -> Result<()> {
    if ss_out != 0 && ctas as usize > MAX_PARTIAL_SUMS {
        return Err(Error::Unsupported(format!(
            "{ctas} CTAs leave more partial sums than the {MAX_PARTIAL_SUMS} the arena holds"
        )));
    }
    Ok(())
}

/// [`GemvChoice::Auto`]'s kernel for a `rows` x `cols` NF4 matrix.
fn auto_gemv(rows: usize, cols: usize, v3_max_bytes: usize) -> Variant {
    if rows * cols / 2 < v3_max_bytes {
        Variant::V3
    } else {
        Variant::V2
    }
}

/// The GEMM width for `n` columns: the index into [`GEMM_NT`] of the narrowest width that
/// holds them (6 tiles only with `nt6`), and the CTAs along n.
fn gemm_width(n: usize, nt6: bool) -> (usize, usize) {
    let idx = GEMM_NT
        .iter()
        .position(|&nt| 8 * nt >= n && (nt6 || nt != 6))
        .unwrap_or(GEMM_NT.len() - 1);
    (idx, n.div_ceil(8 * GEMM_NT[idx]).max(1))
}

/// Dynamic shared memory of the v2 GEMM: two stages of B for `kw` parts of 8 `nt` columns,
/// reused for the K-part reduction ((GEMM_WARPS / kw) row tiles x 8 nt x 32 floats).
fn gemm_v2_smem(nt: usize, kw: usize) -> usize {
    let staging = 2 * kw * 8 * nt * GEMM_B2_STRIDE * 4;
    // The K-part tree's first round: GEMM_WARPS / 2 slots.
    let reduction = if kw > 1 {
        GEMM_WARPS / 2 * 8 * nt * 32 * 4
    } else {
        0
    };
    staging.max(reduction)
}

/// CTAs per cluster of the v1 GEMM (1 or 2): two, splitting K, when the grid of `ctas` CTAs
/// of one row tile each (`kw` = all warps on K) would leave half the SMs idle and each of the
/// 2 `kw` parts still gets two 64-element blocks.
fn gemm_cluster(ctas: usize, kw: usize, k_blocks: usize, sms: usize) -> u32 {
    if kw == GEMM_WARPS && 2 * ctas <= sms && k_blocks >= 2 * 2 * kw {
        2
    } else {
        1
    }
}

/// Parts of K per CTA (1, 2, 4, 8; at most `max_kw`): split K while the grid is under two
/// CTAs per SM and each part keeps at least two 64-element blocks.
fn gemm_k_parts(
    row_tiles: usize,
    ctas_n: usize,
    k_blocks: usize,
    sms: usize,
    max_kw: usize,
) -> usize {
    let mut kw = 1;
    while kw < max_kw
        && k_blocks / (2 * kw) >= 2
        && row_tiles.div_ceil(GEMM_WARPS / kw) * ctas_n < 2 * sms
    {
        kw *= 2;
    }
    kw
}

/// GEMV v2's (early CTAs, rows each) for `rows` over `ctas` CTAs with the first half taking
/// `skew` rows more than an equal share (kernels/decode.cu, gemv2_walk); (0, 0): equal shares,
/// as without a skew or where the rest would get none.
fn skewed_split(rows: usize, ctas: u32, skew: i32) -> (i32, i32) {
    let (rows, ctas) = (rows as i64, ctas as i64);
    let early = ctas / 2;
    let early_rows = (rows + ctas - 1) / ctas + skew as i64;
    let rest = rows - early * early_rows;
    if skew == 0 || early == 0 || early_rows < 0 || rest < 0 {
        return (0, 0);
    }
    (early as i32, early_rows as i32)
}

/// GEMV v2 shape for K = cols: the fewest warps per row (1, 2, 4, 8) whose lanes need at most
/// 3 chunks of 32 elements each (the register budget for x).
pub fn gemv2_shape(cols: usize) -> Result<(usize, u32)> {
    let chunks = cols / 32;
    for kparts in [1u32, 2, 4, 8] {
        let j = chunks.div_ceil(32 * kparts as usize).max(1);
        if j <= 3 {
            return Ok((j, kparts));
        }
    }
    Err(Error::Unsupported(format!(
        "K = {cols}: the GEMV kernels take K up to {GEMV2_MAX_K}"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemm_shapes() {
        assert_eq!(gemm_width(1, true), (0, 1));
        assert_eq!(gemm_width(8, true), (0, 1));
        assert_eq!(gemm_width(9, true), (1, 1));
        assert_eq!(gemm_width(33, true), (2, 1));
        assert_eq!(gemm_width(48, true), (2, 1));
        assert_eq!(gemm_width(48, false), (3, 1));
        assert_eq!(gemm_width(49, true), (3, 1));
        assert_eq!(gemm_width(64, true), (3, 1));
        assert_eq!(gemm_width(200, true), (3, 4));
        // Qwen2.5-3B q/k/v at N = 64: 80 row tiles -> split K until the grid fills 132 SMs.
        assert_eq!(gemm_k_parts(80, 1, 32, 132, 8), 8);
        assert_eq!(gemm_k_parts(80, 1, 32, 132, 4), 4);
        // gate/up at N = 128: 688 tiles in 172 CTAs -> two K parts for 2.6 waves.
        assert_eq!(gemm_k_parts(688, 2, 32, 132, 8), 2);
        assert_eq!(gemm_k_parts(2752, 1, 32, 132, 8), 1);
        // K of one block cannot be split.
        assert_eq!(gemm_k_parts(1, 1, 1, 132, 8), 1);
        // 48 tokens: o and down (64 row tiles, 64 CTAs) in clusters of two; q/k/v (80 CTAs)
        // and anything with K parts to spare not.
        assert_eq!(gemm_cluster(64, 8, 32, 132), 2);
        assert_eq!(gemm_cluster(64, 8, 172, 132), 2);
        assert_eq!(gemm_cluster(80, 8, 32, 132), 1);
        assert_eq!(gemm_cluster(64, 4, 32, 132), 1);
        assert_eq!(gemm_cluster(64, 8, 16, 132), 1);
        assert_eq!(
            gemm_v2_smem(8, GEMM_V2_MAX_KW),
            super::super::kernels::GEMM_V2_MAX_SMEM
        );
        // Two stages of 2 parts x 64 columns x 68 words outweigh the reduction.
        assert_eq!(gemm_v2_smem(8, 2), 2 * 2 * 64 * 68 * 4);
        assert_eq!(attn_prefill_tokens(8, 128, 32), Some(4));
        assert_eq!(attn_prefill_tokens(8, 128, 8), Some(1));
        assert_eq!(attn_prefill_tokens(16, 128, 8), None);
        assert_eq!(attn_prefill_tokens(2, 256, 32), Some(8));
        assert_eq!(attn_prefill_tokens(32, 256, 32), None);
    }

    #[test]
    fn partial_sums_must_fit_the_arena() {
        assert!(check_sums(0, u32::MAX).is_ok(), "no sums asked: any grid");
        assert!(check_sums(0x1000, MAX_PARTIAL_SUMS as u32).is_ok());
        let err = check_sums(0x1000, MAX_PARTIAL_SUMS as u32 + 1).unwrap_err();
        assert!(err.to_string().contains("partial sums"), "{err}");
    }

    #[test]
    fn auto_gemv_takes_tensor_cores_for_the_small_matrices() {
        let s = &crate::arch::QWEN25_3B;
        let qkv = (s.n_q_heads + 2 * s.n_kv_heads) * s.head_dim;
        assert_eq!(auto_gemv(qkv, s.hidden, GEMV3_AUTO_MAX_BYTES), Variant::V3);
        assert_eq!(
            auto_gemv(s.hidden, s.n_q_heads * s.head_dim, GEMV3_AUTO_MAX_BYTES),
            Variant::V3
        );
        assert_eq!(
            auto_gemv(2 * s.intermediate, s.hidden, GEMV3_AUTO_MAX_BYTES),
            Variant::V2
        );
        assert_eq!(
            auto_gemv(s.hidden, s.intermediate, GEMV3_AUTO_MAX_BYTES),
            Variant::V2
        );
        assert_eq!(
            auto_gemv(s.vocab, s.hidden, GEMV3_AUTO_MAX_BYTES),
            Variant::V2
        );
    }

    #[test]
    fn attention_splits_a_group_evenly() {
        assert_eq!(attn_split_parts(2, 8), 2);
        assert_eq!(attn_split_parts(4, 6), 3);
        assert_eq!(attn_split_parts(2, 1), 1);
        assert_eq!(attn_split_parts(16, 8), 8);
        assert_eq!(attn_split_parts(1, 8), 1);
    }

    #[test]
    fn l2_prefetch_shares_cover_each_range_in_16_byte_pieces() {
        let m = |packed, absmax| Nf4Ref {
            packed,
            absmax,
            mma_scale: 1.0,
        };
        // Qwen2.5-3B's q (2048 x 2048) and k (256 x 2048) over down's 264 CTAs.
        let next = L2Next::of(
            &[
                (m(1 << 20, 1 << 30), 2048, 2048),
                (m(3 << 20, 3 << 30), 256, 2048),
            ],
            264,
        );
        let ranges = [
            (1 << 20, 2048 * 1024),
            (1 << 30, 2048 * 128),
            (3 << 20, 256 * 1024),
            (3 << 30, 256 * 128),
        ];
        for (i, &(addr, bytes)) in ranges.iter().enumerate() {
            assert_eq!((next.addr[i], next.bytes[i] as usize), (addr, bytes));
            let share = next.share[i] as usize;
            assert_eq!(share % 16, 0, "range {i}");
            assert!(
                share * 264 >= bytes && (share - 16) * 264 < bytes,
                "range {i}: share {share}"
            );
        }
        assert_eq!(next.addr[4..], [0, 0]);
        assert_eq!(next.bytes[4..], [0, 0]);
        // A share past one prefetch's 32 KB is left out (a prefetch is a hint); an empty list
        // sends nothing.
        let big = L2Next::of(&[(m(1 << 20, 1 << 30), 8192, 8192)], 132);
        assert_eq!((big.addr[0], big.bytes[0], big.share[0]), (0, 0, 0));
        assert_eq!(big.addr[1], 1 << 30);
        assert!(L2Next::of(&[], 264).bytes.iter().all(|&b| b == 0));
    }

    #[test]
    fn skewed_splits_cover_the_rows() {
        // Gate/up at the 3B shape: 42 rows a CTA, 132 CTAs of 50, the other 132 share 4408.
        assert_eq!(skewed_split(11008, 264, 8), (132, 50));
        assert_eq!(skewed_split(11008, 264, 0), (0, 0));
        assert_eq!(skewed_split(11008, 264, -8), (132, 34));
        // Past the rows: equal shares.
        assert_eq!(skewed_split(100, 264, 8), (0, 0));
        for (rows, ctas, skew) in [
            (11008usize, 264u32, 8i32),
            (11008, 264, -10),
            (4864, 264, 3),
        ] {
            let (e, er) = skewed_split(rows, ctas, skew);
            let rest = ctas as i32 - e;
            let late = (rows as i32 - e * er + rest - 1) / rest;
            assert!(e * er + (ctas as i32 - e) * late >= rows as i32);
        }
    }

    #[test]
    fn gemv2_shapes_cover_k_with_little_waste() {
        assert_eq!(gemv2_shape(64).unwrap(), (1, 1));
        assert_eq!(gemv2_shape(2048).unwrap(), (2, 1));
        assert_eq!(gemv2_shape(3072).unwrap(), (3, 1));
        assert_eq!(gemv2_shape(11008).unwrap(), (3, 4));
        assert_eq!(gemv2_shape(18944).unwrap(), (3, 8));
        assert!(gemv2_shape(32768).is_err());
    }
}
