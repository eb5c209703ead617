//! Kernel sources, their NVRTC compilation (cached on disk) and the loaded function table.
//!
//! Sources are embedded with `include_str!`; `DV2_KERNEL_DIR` points at a folder of `.cu` files
//! to use instead (iterate on kernels without rebuilding Rust). The cubin is cached by a hash
//! of source, options and NVRTC version, per architecture, in `DV2_CACHE_DIR` (default
//! `$XDG_CACHE_HOME/decodev2` or `~/.cache/decodev2`), so a second load skips NVRTC.

use std::ffi::CString;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaModule};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys, Ptx};

use super::device::{driver_error, Gpu};
use crate::error::{Error, Result};

// Constants the kernels share with the host. They reach the kernels as -D options
// (`shared_defines`), never written twice.

/// Threads per CTA of the GEMV family.
pub const GEMV_THREADS: u32 = 256;
/// Warps per GEMV CTA: the rows of a CTA times the warps splitting each row's K.
pub const GEMV_WARPS: u32 = GEMV_THREADS / 32;
/// Threads per attention CTA.
pub const ATTN_THREADS: u32 = 128;
/// Largest head_dim the attention kernels hold in shared memory.
pub const MAX_HEAD_DIM: usize = 256;
/// KV slots per attention v2 chunk (one CTA per KV head and chunk).
pub const ATTN2_CHUNK: usize = 32;
/// Attention v2 limits: q heads per KV head, their total width, and chunks per merge.
pub const ATTN2_MAX_GROUP: usize = 16;
pub const ATTN2_MAX_GROUP_X_HD: usize = 2048;
pub const ATTN2_MAX_CHUNKS: usize = 1024;

/// Warps per CTA of the NF4 tensor-core GEMM (row tiles x parts of K).
pub const GEMM_WARPS: usize = 8;
/// Rows of the weight matrix one GEMM warp computes (two m16 tiles; SwiGLU: 16 outputs).
pub const GEMM_WARP_ROWS: usize = 32;
/// Columns (tokens) per n8 tile; the GEMM comes in widths of 1, 4, 6 and 8 tiles per CTA.
pub const GEMM_NT: [usize; 4] = [1, 4, 6, 8];
/// u32 words per column of the v2 GEMM's staged B (64 f32 + 4 words of padding).
pub const GEMM_B2_STRIDE: usize = 68;
/// The most K parts a v2 GEMM CTA takes (its B staging grows with them).
pub const GEMM_V2_MAX_KW: usize = 4;
/// The v2 GEMM's largest dynamic shared memory: two stages of B for 4 K parts of 64 columns.
pub const GEMM_V2_MAX_SMEM: usize = 2 * GEMM_V2_MAX_KW * 64 * GEMM_B2_STRIDE * 4;
// Hopper's shared memory per CTA is 227 KiB.
const _: () = assert!(GEMM_V2_MAX_SMEM <= 227 * 1024);
/// Prefill attention: threads per CTA, the most (token, q head) rows per CTA (kernels come
/// with 8 and 32), KV slots per staged tile, and the floats of q rows a CTA stages (rows x
/// head_dim).
pub const ATTNP_THREADS: u32 = 128;
pub const ATTNP_ROWS: usize = 32;
pub const ATTNP_TILE: usize = 32;
pub const ATTNP_Q_FLOATS: usize = 4096;

/// Floats per 32-float chunk of x as GEMV v2 stages it in shared memory (4 of padding keep
/// the lanes' 16-byte reads conflict-free).
pub const GEMV2_X_STRIDE: usize = 36;
/// 32-bit words per 32-element chunk of an f16 x as GEMV v2 stages it (`DV2_FFN_F16`: 16
/// words of halves, 4 of padding for the same conflict-free reads).
pub const GEMV2_X16_STRIDE: usize = 20;
/// The largest K GEMV v2 takes (3 chunks of 32 per lane, 8 warps splitting a row).
pub const GEMV2_MAX_K: usize = 3 * 32 * 8 * 32;
/// GEMV v2's dynamic shared memory limit: x staged at the largest K (its static tables and
/// partial sums take ~39 KiB more).
pub const GEMV2_MAX_SMEM: usize = GEMV2_MAX_K / 32 * GEMV2_X_STRIDE * 4;
const _: () = assert!(GEMV2_MAX_SMEM + 40 * 1024 <= 227 * 1024);
/// lm_head's f16-pair table as `DV2_LOGITS_PRMT` lays it out (256 entries 256 bytes apart), in
/// dynamic shared memory before x.
pub const GEMV2_PRMT_TABLE: usize = 256 * 256;
const _: () = assert!(GEMV2_MAX_SMEM + GEMV2_PRMT_TABLE + 8 * 1024 <= 227 * 1024);
/// Warps per CTA of GEMV v3 (tensor cores): they split K of the CTA's row tiles.
pub const GEMV3_WARPS: usize = 8;
/// The largest K GEMV v3 stages (x as f16 pairs in dynamic shared memory: 2K bytes).
pub const GEMV3_MAX_K: usize = 32768;
/// GEMV v3's dynamic shared memory limit (its static table takes 32 KiB more).
pub const GEMV3_MAX_SMEM: usize = GEMV3_MAX_K * 2;
const _: () = assert!(GEMV3_MAX_SMEM + 32 * 1024 + 1024 <= 227 * 1024);
/// Tensor-core prefill attention: warps per CTA and (token, q head) rows per CTA (16 a warp).
/// Four warps share each staged tile; one warp per CTA (4x the CTAs) measured slower.
pub const ATTNM_WARPS: usize = 4;
pub const ATTNM_ROWS: usize = 16 * ATTNM_WARPS;
pub const ATTNM_THREADS: u32 = 32 * ATTNM_WARPS as u32;

/// Indices into the int32 decode-state buffer on the device.
pub mod state {
    /// The id the next step feeds.
    pub const TOKEN: usize = 0;
    /// The slot the next forward writes.
    pub const POSITION: usize = 1;
    /// KV prefix attention reads (position after a forward).
    pub const VALID_LEN: usize = 2;
    /// The last greedy id.
    pub const NEXT_TOKEN: usize = 3;
    /// Set when the last greedy id was EOS.
    pub const FINISHED: usize = 4;
    /// Ids appended to the step ring by the current step_n.
    pub const RING_COUNT: usize = 5;
    /// Length of the buffer.
    pub const LEN: usize = 8;
}

/// The -D options that carry the shared constants into every kernel file.
fn shared_defines() -> Vec<String> {
    let values = [
        ("GEMV_THREADS", GEMV_THREADS as usize),
        ("ATTN_THREADS", ATTN_THREADS as usize),
        ("MAX_HEAD_DIM", MAX_HEAD_DIM),
        ("ATTN2_CHUNK", ATTN2_CHUNK),
        ("ATTN2_MAX_GROUP", ATTN2_MAX_GROUP),
        ("ATTN2_MAX_GROUP_X_HD", ATTN2_MAX_GROUP_X_HD),
        ("ATTN2_MAX_CHUNKS", ATTN2_MAX_CHUNKS),
        ("GEMM_WARPS", GEMM_WARPS),
        ("B2_STRIDE", GEMM_B2_STRIDE),
        ("ATTNP_THREADS", ATTNP_THREADS as usize),
        ("ATTNP_TILE", ATTNP_TILE),
        ("ATTNP_Q_FLOATS", ATTNP_Q_FLOATS),
        ("ATTNM_WARPS", ATTNM_WARPS),
        ("GEMV3_WARPS", GEMV3_WARPS),
        ("X_STAGE_STRIDE", GEMV2_X_STRIDE),
        ("X16_STAGE_STRIDE", GEMV2_X16_STRIDE),
        ("PRMT_LUT_WORDS", GEMV2_PRMT_TABLE / 4),
        ("STATE_TOKEN", state::TOKEN),
        ("STATE_POSITION", state::POSITION),
        ("STATE_VALID_LEN", state::VALID_LEN),
        ("STATE_NEXT_TOKEN", state::NEXT_TOKEN),
        ("STATE_FINISHED", state::FINISHED),
        ("STATE_RING_COUNT", state::RING_COUNT),
    ];
    values
        .iter()
        .map(|(name, v)| format!("-D{name}={v}"))
        .collect()
}

/// A compilation unit: a name (for the cache and NVRTC's messages) and its files under
/// kernels/ with their embedded text, compiled as one source in this order (later files use
/// the helpers of earlier ones).
pub struct KernelUnit {
    pub name: &'static str,
    pub files: &'static [(&'static str, &'static str)],
}

/// The decode step's kernels and the chunked prefill's.
pub const DECODE: KernelUnit = KernelUnit {
    name: "decode",
    files: &[
        ("decode.cu", include_str!("../../kernels/decode.cu")),
        ("prefill.cu", include_str!("../../kernels/prefill.cu")),
        ("gemv_mma.cu", include_str!("../../kernels/gemv_mma.cu")),
    ],
};
/// Benchmark-only kernels (the streaming-read floor).
pub const BENCH: KernelUnit = KernelUnit {
    name: "bench",
    files: &[("bench.cu", include_str!("../../kernels/bench.cu"))],
};

/// The source of a unit: each file from `DV2_KERNEL_DIR/<name>` when set, else the embedded
/// copy, with a `#line` directive before each so compiler messages name the right file.
fn source(unit: &KernelUnit) -> Result<String> {
    let dir = std::env::var_os("DV2_KERNEL_DIR").map(PathBuf::from);
    let mut src = String::new();
    for (name, text) in unit.files {
        src.push_str(&format!("#line 1 \"{name}\"\n"));
        match &dir {
            Some(dir) => {
                let path = dir.join(name);
                let text = std::fs::read_to_string(&path)
                    .map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
                src.push_str(&text);
            }
            None => src.push_str(text),
        }
        src.push('\n');
    }
    Ok(src)
}

/// True when libnvrtc can be loaded (cudarc panics on a missing library).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen libnvrtc.
    catch_unwind(|| unsafe { nvrtc_sys::is_culib_present() }).unwrap_or(false)
}

fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| Error::Cuda(format!("nvrtcVersion: {e:?}")))?;
    Ok((major, minor))
}

fn fnv1a(parts: &[&[u8]]) -> u64 {
    parts
        .iter()
        .flat_map(|p| p.iter())
        .fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ *b as u64).wrapping_mul(0x100_0000_01b3)
        })
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("DV2_CACHE_DIR") {
        return Some(dir.into());
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("decodev2"))
}

/// Whether GEMV v2 stages its f32 x once per CTA in shared memory, loaded coalesced (default;
/// `DV2_GEMV2_XSMEM=0`: each lane loads its own chunks of x from global memory). Compiled into
/// the kernels (options), so fixed for a loaded module: [`Kernels::gemv2_x_smem`].
fn gemv2_x_smem() -> bool {
    super::switch_on("DV2_GEMV2_XSMEM")
}

/// Whether down's GEMV v2 prefetches the next layer's q/k/v weights into L2 (`DV2_QKV_L2=1`;
/// off by default since session 19, when q/k/v went to K halves: -0.0015 ms/token without it):
/// compiled into the kernels (options), so fixed for a loaded module: [`Kernels::qkv_l2`].
fn qkv_l2() -> bool {
    std::env::var("DV2_QKV_L2").as_deref() == Ok("1")
}

/// Whether lm_head's GEMV v2 takes the argmax too (`DV2_LOGITS_ARGMAX`, default; `=0` off):
/// its kernels are compiled (options) and loaded ([`Kernels::gemv2_logits`]) only then.
fn logits_argmax() -> bool {
    super::switch_on("DV2_LOGITS_ARGMAX")
}

/// Whether those kernels address their f16-pair table by PRMT (`DV2_LOGITS_PRMT`, default;
/// `=0`: a shift and a LOP3, the table in static shared memory): compiled in (options), so
/// fixed for a loaded module: [`Kernels::logits_prmt`].
fn logits_prmt() -> bool {
    super::switch_on("DV2_LOGITS_PRMT")
}

/// Whether q/k/v's GEMV v3 runs in K halves (`DV2_QKV_KHALVES`, default; `=0` off): its
/// kernel and the attention's adding of the halves are compiled (options) and loaded
/// ([`Kernels::gemv3_qkv_kh2`]) only then.
fn qkv_khalves() -> bool {
    super::switch_on("DV2_QKV_KHALVES")
}

/// The skewed row split's extra rows for GEMV v2's first half of CTAs, by kernel: SwiGLU's
/// (`DV2_GEMV2_SKEW`, default 2), the plain kernels' (`DV2_DOWN_SKEW`) and lm_head's
/// (`DV2_LOGITS_SKEW`), default 0. Read by Ops for the launches, and here for whether the plain
/// and lm_head kernels hold the split (options), so the two cannot disagree.
pub fn gemv2_skew() -> i32 {
    skew_rows("DV2_GEMV2_SKEW", 2)
}
pub fn down_skew() -> i32 {
    skew_rows("DV2_DOWN_SKEW", 0)
}
pub fn logits_skew() -> i32 {
    skew_rows("DV2_LOGITS_SKEW", 0)
}
fn skew_rows(var: &str, default: i32) -> i32 {
    super::env_number(var).unwrap_or(default)
}

/// Whether the kernels record each CTA's wait and end times, and the GEMV and attention CTAs'
/// starts (`DV2_CTA_TIMELINE=1`, off by default): compiled in (options), read by
/// `CudaBackend::cta_timeline`.
pub fn cta_timeline() -> bool {
    std::env::var("DV2_CTA_TIMELINE").as_deref() == Ok("1")
}

/// NVRTC options; `DV2_LINEINFO=1` adds source line information (for a profiler's source
/// view; the cache keeps the two builds apart, options being part of its key), as it keeps
/// the kernel variants `DV2_TABLE_WIDE=0`, `DV2_TABLE_DIRECT=0`, `DV2_NORM_BATCH=n`,
/// `DV2_GEMV3_X_BATCH=n`, `DV2_GEMV2_X_BATCH=n`, `DV2_GEMV3_ACC_ONE=0`, `DV2_GEMV3_L2_CODE=1`, `DV2_L2_AHEAD_KB=n`,
/// `DV2_MERGE_EARLY=0`, `DV2_MERGE_WARP=0`, `DV2_GEMV_WFIRST=0`, `DV2_GEMV2_PREWAIT=0`,
/// `DV2_GEMV3_PREWAIT=0`, `DV2_GEMV3_EPI_EARLY=0`, `DV2_GEMV2_XSMEM=0`, `DV2_GEMV2_X_ONE=0`,
/// `DV2_GEMV2_CHAIN=n`, `DV2_ATTN3_SLOT_LANES=0`, `DV2_ATTN3_ILP=0`, `DV2_QKV_L2=1`,
/// `DV2_LOGITS_ARGMAX=0`, `DV2_LOGITS_PRMT=0`, `DV2_DOWN_SKEW=n`, `DV2_LOGITS_SKEW=n`,
/// `DV2_QKV_KHALVES=0` and `DV2_GEMV2_NOALLOC=0` apart. The compiler optimizes the module's
/// kernels on every core (`--split-compile=0`; `DV2_NVRTC_SPLIT=0`: one thread): a machine's
/// first load compiles the kernels, 32 s in one thread on 2 cores, 19 s split. The split
/// changes the code of some kernels (scheduling, shared-memory placement), not what they
/// compute.
fn options(arch: &str) -> Vec<String> {
    let mut opts = vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()];
    if std::env::var("DV2_LINEINFO").as_deref() == Ok("1") {
        opts.push("--generate-line-info".into());
    }
    if super::switch_on("DV2_NVRTC_SPLIT") {
        opts.push("--split-compile=0".into());
    }
    // The byte tables' 16-byte stores (kernels/decode.cu, load_byte_table; DV2_TABLE_WIDE=0:
    // a store per copy, as before session 11).
    let wide = i32::from(super::switch_on("DV2_TABLE_WIDE"));
    opts.push(format!("-DTABLE_WIDE_STORES={wide}"));
    // Those stores' values straight from the codebook's immediates, no shared codebook and no
    // barrier before them (load_byte_table, TABLE_DIRECT; DV2_TABLE_DIRECT=0: through shared
    // memory, as before session 20).
    let direct = i32::from(super::switch_on("DV2_TABLE_DIRECT"));
    opts.push(format!("-DTABLE_DIRECT={direct}"));
    // Partial sums of squares each lane loads at once for a fused RMSNorm (kernels/decode.cu,
    // norm_factor; DV2_NORM_BATCH=n, 1..=16; 8 before session 11).
    let bounded = |var: &str, max: usize, default: usize| {
        super::env_number(var)
            .filter(|n: &usize| (1..=max).contains(n))
            .unwrap_or(default)
    };
    opts.push(format!(
        "-DNORM_BATCH={}",
        bounded("DV2_NORM_BATCH", 16, 12)
    ));
    // GEMV v3's x quads per thread per round of loads (kernels/gemv_mma.cu, GEMV3_X_BATCH;
    // DV2_GEMV3_X_BATCH=n, 1..=8; 8 before session 13).
    opts.push(format!(
        "-DGEMV3_X_BATCH={}",
        bounded("DV2_GEMV3_X_BATCH", 8, 4)
    ));
    // The same for GEMV v2's f32 x (kernels/decode.cu, stage_x; DV2_GEMV2_X_BATCH=n, 1..=8;
    // 8 before).
    opts.push(format!(
        "-DGEMV2_X_BATCH={}",
        bounded("DV2_GEMV2_X_BATCH", 8, 4)
    ));
    // Words per f16 FMA chain in GEMV v2's f16-pair dot products (kernels/decode.cu,
    // GEMV2_CHAIN; DV2_GEMV2_CHAIN = 1, 2 (default) or 4; 1 before session 15).
    let chain = super::env_number("DV2_GEMV2_CHAIN")
        .filter(|n: &usize| matches!(n, 1 | 2 | 4))
        .unwrap_or(2);
    opts.push(format!("-DGEMV2_CHAIN={chain}"));
    // GEMV v2's weight loads without an L1 line (kernels/decode.cu, GEMV2_W_NOALLOC;
    // DV2_GEMV2_NOALLOC=0: __ldg, as before session 16).
    let no_alloc = super::switch_on("DV2_GEMV2_NOALLOC");
    opts.push(format!("-DGEMV2_W_NOALLOC={}", i32::from(no_alloc)));
    // Attention v3's scores with several lanes a slot at a split's few slots (kernels/decode.cu,
    // ATTN3_SLOT_LANES; DV2_ATTN3_SLOT_LANES=0: a lane a slot).
    opts.push(format!(
        "-DATTN3_SLOT_LANES={}",
        i32::from(super::switch_on("DV2_ATTN3_SLOT_LANES"))
    ));
    // Down's L2 prefetch of the next layer's q/k/v weights (kernels/decode.cu, GEMV2_L2_NEXT;
    // DV2_QKV_L2=1 on; -0.0065 ms/token in session 16, +0.0015 since q/k/v's K halves).
    opts.push(format!("-DGEMV2_L2_NEXT={}", i32::from(qkv_l2())));
    // lm_head's GEMV v2 with the argmax (kernels/decode.cu, GEMV2_LOGITS; DV2_LOGITS_ARGMAX=0:
    // argmax_logits after lm_head).
    opts.push(format!("-DGEMV2_LOGITS={}", i32::from(logits_argmax())));
    // Their table addressed by PRMT, GEMV2_PRMT_TABLE bytes before x (GEMV2_LOGITS_PRMT;
    // DV2_LOGITS_PRMT=0: as the other v2 kernels').
    opts.push(format!("-DGEMV2_LOGITS_PRMT={}", i32::from(logits_prmt())));
    // The plain and lm_head GEMV v2 kernels hold the skewed row split (kernels/decode.cu,
    // gemv2_walk, GEMV2_SKEW_PLAIN) only where DV2_DOWN_SKEW or DV2_LOGITS_SKEW asks for one.
    let skew_plain = down_skew() != 0 || logits_skew() != 0;
    opts.push(format!("-DGEMV2_SKEW_PLAIN={}", i32::from(skew_plain)));
    // q/k/v's GEMV v3 in K halves (kernels/gemv_mma.cu, GEMV3_KHALVES; DV2_QKV_KHALVES=0 off).
    opts.push(format!("-DGEMV3_KHALVES={}", i32::from(qkv_khalves())));
    // Each CTA's wait and end times (kernels/decode.cu, CTA_TIMELINE; DV2_CTA_TIMELINE=1, a
    // measuring tool read by CudaBackend::cta_timeline).
    opts.push(format!("-DCTA_TIMELINE={}", i32::from(cta_timeline())));
    // Attention v3's score and weighted-sum loops unrolled, its softmax reductions over the
    // lanes that hold slots (kernels/decode.cu, ATTN3_ILP; DV2_ATTN3_ILP=0 off).
    let ilp = super::switch_on("DV2_ATTN3_ILP");
    opts.push(format!("-DATTN3_ILP={}", i32::from(ilp)));
    // The x path GEMV v2's kernels hold (kernels/decode.cu, GEMV2_X_MODE): the f32-x kernels
    // the one DV2_GEMV2_XSMEM picks, the f16-x kernels theirs; DV2_GEMV2_X_ONE=0: every path,
    // chosen at run time by the kernels' x_smem argument.
    let (x_mode, x16_mode) = if !super::switch_on("DV2_GEMV2_X_ONE") {
        (3, 3)
    } else {
        (i32::from(gemv2_x_smem()), 2)
    };
    opts.push(format!("-DGEMV2_X_MODE={x_mode}"));
    opts.push(format!("-DGEMV2_X16_MODE={x16_mode}"));
    // GEMV v3's L2 prefetch window (kernels/gemv_mma.cu, GEMV3_L2_AHEAD): compiled in only
    // where DV2_L2_AHEAD_KB asks for one (Ops::l2_ahead reads the same variable), or with
    // DV2_GEMV3_L2_CODE=1 (the code present, never run: what its size alone costs).
    let l2_ahead = super::env_number::<usize>("DV2_L2_AHEAD_KB").is_some_and(|kb| kb > 0)
        || std::env::var("DV2_GEMV3_L2_CODE").as_deref() == Ok("1");
    opts.push(format!("-DGEMV3_L2_AHEAD={}", i32::from(l2_ahead)));
    // GEMV v3's accumulate kernel on one matrix (kernels/gemv_mma.cu, gemv3_stacked;
    // DV2_GEMV3_ACC_ONE=0: the three-matrix row mapping of the store kernel).
    let acc_one = i32::from(super::switch_on("DV2_GEMV3_ACC_ONE"));
    opts.push(format!("-DGEMV3_ACC_ONE={acc_one}"));
    // When GEMV v2 and v3 issue their first weights (GEMV2_W_FIRST, GEMV3_W_FIRST: 2 before
    // the wait on the previous kernel, the default; 1 after it, before x, with
    // DV2_GEMV2_PREWAIT=0 / DV2_GEMV3_PREWAIT=0; 0 after x with DV2_GEMV_WFIRST=0), and whether
    // GEMV v3 loads its epilogue operands as a group starts (GEMV3_EPI_EARLY;
    // DV2_GEMV3_EPI_EARLY=0 off): compiled in rather than chosen at run time.
    let w_first = |prewait: &str| match (
        super::switch_on("DV2_GEMV_WFIRST"),
        super::switch_on(prewait),
    ) {
        (false, _) => 0,
        (true, false) => 1,
        (true, true) => 2,
    };
    opts.push(format!("-DGEMV2_W_FIRST={}", w_first("DV2_GEMV2_PREWAIT")));
    opts.push(format!("-DGEMV3_W_FIRST={}", w_first("DV2_GEMV3_PREWAIT")));
    opts.push(format!(
        "-DGEMV3_EPI_EARLY={}",
        i32::from(super::switch_on("DV2_GEMV3_EPI_EARLY"))
    ));
    // Attention v2's merge (kernels/decode.cu, attn2_merge): its early loads
    // (DV2_MERGE_EARLY=0 off) and per-warp chunk weights (DV2_MERGE_WARP=0 off), compiled in
    // or out rather than chosen at run time.
    for (define, switch) in [
        ("MERGE_EARLY", "DV2_MERGE_EARLY"),
        ("MERGE_PER_WARP", "DV2_MERGE_WARP"),
    ] {
        opts.push(format!(
            "-D{define}={}",
            i32::from(super::switch_on(switch))
        ));
    }
    opts.extend(shared_defines());
    opts
}

/// Runs NVRTC on `src` and returns the cubin, or the compiler log as the error.
fn nvrtc_compile(name: &str, src: &str, opts: &[String]) -> Result<Vec<u8>> {
    let c_src =
        CString::new(src).map_err(|_| Error::Internal("kernel source holds a NUL".into()))?;
    let c_name = CString::new(name).unwrap_or_default();
    let prog = nvrtc::create_program(&c_src, Some(&c_name))
        .map_err(|e| Error::Cuda(format!("nvrtcCreateProgram: {e:?}")))?;
    // SAFETY: `prog` is live until destroy_program below; buffers are sized by NVRTC's answers.
    let result = unsafe {
        match nvrtc::compile_program(prog, opts) {
            Err(e) => {
                let log = nvrtc::get_program_log(prog).unwrap_or_default();
                let log: Vec<u8> = log
                    .iter()
                    .map(|c| *c as u8)
                    .take_while(|c| *c != 0)
                    .collect();
                Err(Error::Cuda(format!(
                    "NVRTC failed on {name} ({e:?}):\n{}",
                    String::from_utf8_lossy(&log)
                )))
            }
            Ok(()) => {
                let mut size = 0usize;
                nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| Error::Cuda(format!("nvrtcGetCUBINSize: {e:?}")))
                    .and_then(|()| {
                        let mut cubin = vec![0u8; size];
                        nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast())
                            .result()
                            .map_err(|e| Error::Cuda(format!("nvrtcGetCUBIN: {e:?}")))?;
                        Ok(cubin)
                    })
            }
        }
    };
    // SAFETY: created above, destroyed once.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    result
}

/// The cubin of the decode unit for `arch` (e.g. "sm_90"); see [`compile`].
pub fn compile_decode(arch: &str) -> Result<Vec<u8>> {
    compile(&DECODE, arch)
}

/// The cubin of a kernel file for `arch`, from the disk cache when the same source, options
/// and NVRTC version were compiled before. Needs libnvrtc, not a GPU.
pub fn compile(unit: &KernelUnit, arch: &str) -> Result<Vec<u8>> {
    let compile = || -> Result<Vec<u8>> {
        let src = source(unit)?;
        let opts = options(arch);
        let (major, minor) = nvrtc_version()?;
        let key = fnv1a(&[
            src.as_bytes(),
            opts.join(" ").as_bytes(),
            format!("{major}.{minor}").as_bytes(),
        ]);
        let cached = cache_dir().map(|d| d.join(format!("{}-{arch}-{key:016x}.cubin", unit.name)));
        if let Some(bytes) = cached.as_ref().and_then(|p| std::fs::read(p).ok()) {
            return Ok(bytes);
        }
        let cubin = nvrtc_compile(unit.name, &src, &opts)?;
        if let Some(path) = cached {
            // A cache that cannot be written only costs the next load a compile.
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            let _ = std::fs::create_dir_all(path.parent().unwrap_or(&path))
                .and_then(|()| std::fs::write(&tmp, &cubin))
                .and_then(|()| std::fs::rename(&tmp, &path));
        }
        Ok(cubin)
    };
    if !nvrtc_present() {
        return Err(Error::BackendUnavailable(
            "NVRTC not found (libnvrtc.so.13)".into(),
        ));
    }
    catch_unwind(AssertUnwindSafe(compile)).unwrap_or_else(|_| {
        Err(Error::BackendUnavailable(
            "libnvrtc lacks a required entry point".into(),
        ))
    })
}

/// Every kernel of decode.cu, loaded into the device's context.
pub struct Kernels {
    /// The decode unit's module (its globals: `DV2_CTA_TIMELINE`'s records).
    pub module: Arc<CudaModule>,
    pub gemv_nf4: CudaFunction,
    pub gemv_qkv: CudaFunction,
    pub gemv_swiglu: CudaFunction,
    pub rms_norm: CudaFunction,
    pub embed_row: CudaFunction,
    pub attn_decode: CudaFunction,
    pub attn_merge: CudaFunction,
    pub argmax_logits: CudaFunction,
    pub load_token: CudaFunction,
    pub advance: CudaFunction,
    pub finish_prefill: CudaFunction,
    pub commit_step: CudaFunction,
    pub ring_reset: CudaFunction,
    /// GEMV v2 by codebook table ([byte -> f16 pair, byte -> f32 pair, nibble, byte -> f16
    /// pair with half the rows in flight in 128 registers (the default)]) and chunks per lane J.
    pub gemv2_nf4: [[CudaFunction; 3]; 4],
    /// The plain-matrix kernels of the byte -> f16 pair table for an f16 x ([all rows in
    /// flight, half in 128 registers][J - 1]).
    pub gemv2_nf4_x16: [[CudaFunction; 3]; 2],
    /// The GEMV v2 kernels stage their f32 x in shared memory (`DV2_GEMV2_XSMEM`, compiled in;
    /// else each lane loads x from global memory).
    pub gemv2_x_smem: bool,
    /// GEMV v2's plain kernels prefetch their `L2Next` ranges (`DV2_QKV_L2`, compiled in).
    pub qkv_l2: bool,
    /// lm_head with the argmax folded in, by J (`DV2_LOGITS_ARGMAX`; compiled only then).
    pub gemv2_logits: Option<[CudaFunction; 3]>,
    /// Those kernels take their table in dynamic shared memory before x, [`GEMV2_PRMT_TABLE`]
    /// bytes (`DV2_LOGITS_PRMT`, compiled in).
    pub logits_prmt: bool,
    pub gemv2_qkv: [[CudaFunction; 3]; 4],
    pub gemv2_swiglu: [[CudaFunction; 3]; 4],
    pub attn2_decode: CudaFunction,
    /// The same with its prologue's loads and stores in turn (`DV2_ATTN_BATCH=0`).
    pub attn2_decode_serial: CudaFunction,
    /// The same with the chunk's K and V loaded after the wait on the q/k/v GEMV
    /// (`DV2_ATTN_PREWAIT=0`).
    pub attn2_decode_late: CudaFunction,
    /// The same as `attn2_decode` for head_dim <= 128, in less code (`DV2_ATTN_HD128`).
    pub attn2_decode_hd128: CudaFunction,
    pub attn2_merge: CudaFunction,
    /// Attention v3 (v2's CTAs in clusters that merge through distributed shared memory) by
    /// head_dim: [any, 128, 64], the last two with the head_dim built in, in less code.
    pub attn3_decode: [CudaFunction; 3],
    /// GEMV v3 (tensor cores) by epilogue: store (+bias), accumulate, SwiGLU.
    pub gemv3: [CudaFunction; 3],
    /// The same for the decode step's uses alone (store and SwiGLU: a normed x, no sums out;
    /// accumulate: a raw x, sums out), in less code (`DV2_GEMV3_LEAN`).
    pub gemv3_lean: [CudaFunction; 3],
    /// q/k/v's lean store kernel in K halves (`DV2_QKV_KHALVES`, default; compiled only then).
    pub gemv3_qkv_kh2: Option<CudaFunction>,
    /// The NF4 tensor-core GEMM by epilogue: [v1, v2, v1 with f16 activations][width index
    /// into [`GEMM_NT`]].
    pub gemm_store: [[CudaFunction; 4]; 3],
    pub gemm_acc: [[CudaFunction; 4]; 3],
    pub gemm_swiglu: [[CudaFunction; 4]; 3],
    pub embed_rows: CudaFunction,
    pub rope_kv_rows: CudaFunction,
    pub advance_by: CudaFunction,
    pub begin_prefill: CudaFunction,
    /// Prefill attention with 2 and 8 rows per warp (8 and 32 per CTA).
    pub attn_prefill: [CudaFunction; 2],
    /// Tensor-core prefill attention for head_dim 16, 32, 64, 128: KV tiles staged one
    /// tile ahead (default) and as first written (`DV2_ATTNP_STAGE=v1`).
    pub attn_prefill_mma: [CudaFunction; 4],
    pub attn_prefill_mma1: [CudaFunction; 4],
}

/// `DV2_SMEM_CARVEOUT=p` (0..=100): every kernel of the decode unit asks for the same
/// shared-memory carveout, p percent of the most an SM has (unset, the default: the driver
/// picks per kernel). Why it was tried: under ncu the GEMVs ran in a 132 KiB configuration and
/// attention v3 in 196 KiB, and an SM changes its configuration only when empty. Measured
/// (docs/lab.md, session 15): 57 (132 KiB everywhere) +0.008 ms/token, 100 (228 KiB, L1 down
/// to 28 KiB) +0.069: the GEMVs need their L1 more than the kernels need one configuration.
/// A hint: a kernel that needs more shared memory gets it.
fn smem_carveout() -> Option<i32> {
    super::env_number("DV2_SMEM_CARVEOUT").filter(|p: &i32| (0..=100).contains(p))
}

/// Lets each of `funcs` take up to `bytes` of dynamic shared memory (past the 48 KiB default).
pub(super) fn allow_dynamic_smem(funcs: &[CudaFunction], bytes: usize) -> Result<()> {
    for func in funcs {
        func.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .map_err(driver_error("dynamic shared memory attribute"))?;
    }
    Ok(())
}

/// Compiles (or takes from the cache) a kernel file and loads it into the device's context.
pub fn load_module(gpu: &Gpu, unit: &KernelUnit) -> Result<Arc<CudaModule>> {
    let cubin = compile(unit, &gpu.arch()?)?;
    gpu.ctx
        .load_module(Ptx::from_binary(cubin))
        .map_err(driver_error("cuModuleLoadData"))
}

impl Kernels {
    pub fn load(gpu: &Gpu) -> Result<Self> {
        let module = load_module(gpu, &DECODE)?;
        let carveout = smem_carveout();
        let f = |name: &str| -> Result<CudaFunction> {
            let func = module.load_function(name).map_err(driver_error(name))?;
            if let Some(percent) = carveout {
                func.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                    percent,
                )
                .map_err(driver_error("shared memory carveout"))?;
            }
            Ok(func)
        };
        // GEMV v2: [f16-pair table, f32-pair table (suffix _p32), nibble table (_nib), f16-pair
        // table with half the rows in flight in 128 registers (_narrow, the default)][J - 1].
        // GEMV v2 stages x in dynamic shared memory, up to GEMV2_MAX_SMEM bytes.
        let gemv2_by_j = |name: &str, suffix: &str| -> Result<[CudaFunction; 3]> {
            let [a, b, c] = [1, 2, 3].map(|j| f(&format!("{name}_j{j}{suffix}")));
            let fs = [a?, b?, c?];
            allow_dynamic_smem(&fs, GEMV2_MAX_SMEM)?;
            Ok(fs)
        };
        let gemv2 = |name: &str| -> Result<[[CudaFunction; 3]; 4]> {
            let [a, b, c, d] =
                ["", "_p32", "_nib", "_narrow"].map(|suffix| gemv2_by_j(name, suffix));
            Ok([a?, b?, c?, d?])
        };
        // GEMM v2 stages B in dynamic shared memory, up to GEMM_V2_MAX_SMEM bytes.
        let gemm = |name: &str| -> Result<[[CudaFunction; 4]; 3]> {
            let width = |v: &str| -> Result<[CudaFunction; 4]> {
                let [a, b, c, d] = GEMM_NT.map(|nt| f(&format!("{name}_nt{nt}_{v}")));
                let fs = [a?, b?, c?, d?];
                if v == "v2" {
                    allow_dynamic_smem(&fs, GEMM_V2_MAX_SMEM)?;
                }
                Ok(fs)
            };
            Ok([width("v1")?, width("v2")?, width("v1h")?])
        };
        // GEMV v3 stages x in dynamic shared memory, up to GEMV3_MAX_SMEM bytes.
        let gemv3 = [f("gemv3_store")?, f("gemv3_acc")?, f("gemv3_swiglu")?];
        allow_dynamic_smem(&gemv3, GEMV3_MAX_SMEM)?;
        let gemv3_lean = [
            f("gemv3_store_lean")?,
            f("gemv3_acc_lean")?,
            f("gemv3_swiglu_lean")?,
        ];
        allow_dynamic_smem(&gemv3_lean, GEMV3_MAX_SMEM)?;
        let gemv3_qkv_kh2 = if qkv_khalves() {
            let f = f("gemv3_store_lean_kh2")?;
            allow_dynamic_smem(std::slice::from_ref(&f), GEMV3_MAX_SMEM)?;
            Some(f)
        } else {
            None
        };
        // Attention v3 keeps its q heads' running outputs in dynamic shared memory.
        let attn3_decode = [
            f("attn3_decode")?,
            f("attn3_decode_hd128")?,
            f("attn3_decode_hd64")?,
        ];
        allow_dynamic_smem(&attn3_decode, ATTN2_MAX_GROUP_X_HD * 4)?;
        Ok(Self {
            module: module.clone(),
            gemv3,
            gemv3_lean,
            gemv3_qkv_kh2,
            gemv_nf4: f("gemv_nf4")?,
            gemv_qkv: f("gemv_qkv")?,
            gemv_swiglu: f("gemv_swiglu")?,
            rms_norm: f("rms_norm")?,
            embed_row: f("embed_row")?,
            attn_decode: f("attn_decode")?,
            attn_merge: f("attn_merge")?,
            argmax_logits: f("argmax_logits")?,
            load_token: f("load_token")?,
            advance: f("advance")?,
            finish_prefill: f("finish_prefill")?,
            commit_step: f("commit_step")?,
            ring_reset: f("ring_reset")?,
            gemv2_nf4: gemv2("gemv2_nf4")?,
            gemv2_x_smem: gemv2_x_smem(),
            qkv_l2: qkv_l2(),
            gemv2_logits: if logits_argmax() {
                let fs = gemv2_by_j("gemv2_logits", "_narrow")?;
                allow_dynamic_smem(&fs, GEMV2_MAX_SMEM + GEMV2_PRMT_TABLE)?;
                Some(fs)
            } else {
                None
            },
            logits_prmt: logits_prmt(),
            gemv2_nf4_x16: [
                gemv2_by_j("gemv2_nf4", "_x16")?,
                gemv2_by_j("gemv2_nf4", "_narrow_x16")?,
            ],
            gemv2_qkv: gemv2("gemv2_qkv")?,
            gemv2_swiglu: gemv2("gemv2_swiglu")?,
            attn2_decode: f("attn2_decode")?,
            attn2_decode_serial: f("attn2_decode_serial")?,
            attn2_decode_late: f("attn2_decode_late")?,
            attn2_decode_hd128: f("attn2_decode_hd128")?,
            attn2_merge: f("attn2_merge")?,
            attn3_decode,
            gemm_store: gemm("gemm_store")?,
            gemm_acc: gemm("gemm_acc")?,
            gemm_swiglu: gemm("gemm_swiglu")?,
            embed_rows: f("embed_rows")?,
            rope_kv_rows: f("rope_kv_rows")?,
            advance_by: f("advance_by")?,
            begin_prefill: f("begin_prefill")?,
            attn_prefill: [f("attn_prefill_r2")?, f("attn_prefill_r8")?],
            attn_prefill_mma: [
                f("attn_prefill_mma_hd16")?,
                f("attn_prefill_mma_hd32")?,
                f("attn_prefill_mma_hd64")?,
                f("attn_prefill_mma_hd128")?,
            ],
            attn_prefill_mma1: [
                f("attn_prefill_mma1_hd16")?,
                f("attn_prefill_mma1_hd32")?,
                f("attn_prefill_mma1_hd64")?,
                f("attn_prefill_mma1_hd128")?,
            ],
        })
    }
}
