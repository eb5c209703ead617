//! Kernel sources, their NVRTC compilation (cached on disk) and the loaded function table.
//!
//! Sources are embedded with `include_str!`; `DV2_KERNEL_DIR` points at a folder of `.cu` files
//! to use instead (iterate on kernels without rebuilding Rust). The cubin is cached by a hash
//! of source, options and NVRTC version, per architecture, in `DV2_CACHE_DIR` (default
//! `$XDG_CACHE_HOME/decodev2` or `~/.cache/decodev2`), so a second load skips NVRTC. Both are
//! read by [`Config`].

use std::ffi::CString;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaModule};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys, Ptx};

use super::device::{driver_error, Gpu};
use super::kernel_cache;
use crate::config::Config;
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
/// Prefill attention: threads per CTA, the most (token, q head) rows per CTA (kernels come
/// with 8 and 32), KV slots per staged tile, and the floats of q rows a CTA stages (rows x
/// head_dim).
pub const ATTNP_THREADS: u32 = 128;
pub const ATTNP_ROWS: usize = 32;
pub const ATTNP_TILE: usize = 32;
pub const ATTNP_Q_FLOATS: usize = 4096;
/// Threads a pair of dims in the split prefill attention's merge, each a share of the splits.
pub const ATTNP_MERGE_WAYS: usize = 4;

/// Floats per 32-float chunk of x as GEMV v2 stages it in shared memory (4 of padding keep
/// the lanes' 16-byte reads conflict-free).
pub const GEMV2_X_STRIDE: usize = 36;
/// 32-bit words per 32-element chunk of an f16 x as GEMV v2 stages it (`DV2_FFN_F16`: 16
/// words of halves, 4 of padding for the same conflict-free reads).
pub const GEMV2_X16_STRIDE: usize = 20;
/// The largest K GEMV v2 takes (3 chunks of 32 per lane, 8 warps splitting a row).
pub const GEMV2_MAX_K: usize = 3 * 32 * 8 * 32;
/// The largest K GEMV v2 takes from f16 x (down's input): 4 chunks a lane.
pub const GEMV2_X16_MAX_K: usize = 4 * 32 * 8 * 32;
/// The K-walking kernels' (`gemv2_kwalk_x16`, `gemv2_kwalk_f32`) rows a CTA and warps a
/// row: 8 warps as 4 row lanes of 5 rows, each row's K in 2 halves.
pub const GEMV2_KWALK_ROWS: usize = 20;
pub const GEMV2_KWALK_KPARTS: i32 = 2;
/// The K-walking q/k/v kernel's (`gemv2_kwalk_qkv`) rows a CTA: 8 warps of 4 rows, each
/// over the whole K.
pub const GEMV2_KWALK_QKV_ROWS: usize = 32;
/// The 16-warp K walk's (`gemv2_kwalk_x16_w16`) warps and rows a CTA: 8 row lanes of 5 rows,
/// each row's K in [`GEMV2_KWALK_KPARTS`].
pub const GEMV2_KWALK_W16_WARPS: u32 = 16;
pub const GEMV2_KWALK_W16_ROWS: usize = 40;
/// The shared-memory window offset of the 16-warp K walk's table (and lm_head's), x16 below
/// it; a multiple of 64 KiB, so that a PRMT builds a lookup's whole address (kernels/gemv.cu).
pub const KWALK_TABLE_AT: usize = 0x20000;
/// The dynamic shared memory GEMV v2 stages x in for K = cols: each 32-element chunk at
/// [`GEMV2_X_STRIDE`] floats, or [`GEMV2_X16_STRIDE`] words from f16 x.
pub const fn gemv2_x_smem(cols: usize, x_f16: bool) -> usize {
    let stride = if x_f16 {
        GEMV2_X16_STRIDE
    } else {
        GEMV2_X_STRIDE
    };
    cols / 32 * stride * 4
}
/// GEMV v2's dynamic shared memory limit: x staged at the largest K (its static tables and
/// partial sums take ~39 KiB more).
pub const GEMV2_MAX_SMEM: usize = gemv2_x_smem(GEMV2_MAX_K, false);
const _: () = assert!(GEMV2_MAX_SMEM + 40 * 1024 <= 227 * 1024);
/// lm_head's f16-pair table as its PRMT lookups take it (256 entries 256 bytes apart), in
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
/// The most columns (prefill rows) one launch of GEMV v3's column kernels takes, and the
/// dynamic shared memory they may stage them in (f16, `[columns][K]`: eight columns up to K =
/// 11,264; their static table and sums take ~42 KiB more).
pub const GEMV3_COLS: usize = 8;
pub const GEMV3_COLS_MAX_SMEM: usize = 176 * 1024;
const _: () = assert!(GEMV3_COLS_MAX_SMEM + 42 * 1024 + 1024 <= 227 * 1024);
/// Tensor-core prefill attention: warps per CTA and (token, q head) rows per CTA (16 a warp).
/// Four warps share each staged tile; one warp per CTA (4x the CTAs) measured slower.
pub const ATTNM_WARPS: usize = 4;
pub const ATTNM_ROWS: usize = 16 * ATTNM_WARPS;
pub const ATTNM_THREADS: u32 = 32 * ATTNM_WARPS as u32;
/// Long-context decode attention: CTAs per cluster (each merges 1/ATTNL_RANKS of the head
/// dims) and the most q heads per KV head (the mma's N).
pub const ATTNL_RANKS: usize = 8;
pub const ATTNL_MAX_GROUP: usize = 8;
/// The long-context attention's most clusters per KV head (its partials in the arena; the
/// cross-cluster merge loads them all at once).
pub const ATTNL_MAX_CLUSTERS: usize = 16;
/// The tail merge of attention v2's and the flat long attention's splits
/// (`DV2_X_TAIL_MERGE=1`, kernels/attention.cu `tail_merge_splits`): splits a first-level merge
/// takes, the most partials one merge takes (a group's, or the groups' of at most
/// [`ATTN2_MAX_CHUNKS`] splits), and the counters of a KV head (the groups', then the last
/// level's).
pub const ATTNF_MERGE_GROUP: usize = 8;
pub const ATTNF_MAX_GROUPS: usize = ATTN2_MAX_CHUNKS.div_ceil(ATTNF_MERGE_GROUP);
pub const ATTNF_MAX_MERGE: usize = if ATTNF_MAX_GROUPS > ATTNF_MERGE_GROUP {
    ATTNF_MAX_GROUPS
} else {
    ATTNF_MERGE_GROUP
};
pub const ATTNF_COUNTS: usize = 1 + ATTNF_MAX_GROUPS;

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
    /// 0, or 1 + the position of the first forward since the host last cleared it whose
    /// logits held inf or NaN (set by the argmax kernels).
    pub const NONFINITE: usize = 6;
    /// Length of the buffer.
    pub const LEN: usize = 8;
}

/// GEMV v3's CTAs per SM (its `__launch_bounds__`; the launches size their grids by it), and
/// those of q/k/v's K-halves kernel (at 64 registers, four: +0.033 ms/token, docs/lab.md
/// session 19).
pub const GEMV3_CTAS_PER_SM: u32 = 2;
pub const GEMV3_KH2_CTAS_PER_SM: u32 = 3;

/// The -D options that carry the shared constants into every kernel file: shapes, state
/// indices, CTAs per SM, the NF4 codebook, and the sizes of the argument structs the host
/// passes by value, which the kernels `static_assert` against their own definitions.
fn shared_defines() -> Vec<String> {
    use super::ops::{
        AttnArgs, GemmArgs, NormArgs, PrefillAttnArgs, QkvArgs, RopeArgs, MAX_ARGMAX_CTAS,
    };
    use super::sample::{
        SampleParams, SAMPLE_BINS, SAMPLE_CANDIDATES, SAMPLE_THREADS, SAMPLE_WORK_WORDS,
    };
    use super::weights::Nf4Ref;
    use std::mem::size_of;
    let codebook: Vec<String> = crate::nf4::CODEBOOK
        .iter()
        .map(|v| format!("{v:?}f"))
        .collect();
    let sizes = [
        ("SIZEOF_NF4REF", size_of::<Nf4Ref>()),
        ("SIZEOF_QKVARGS", size_of::<QkvArgs>()),
        ("SIZEOF_NORMARGS", size_of::<NormArgs>()),
        ("SIZEOF_ATTNARGS", size_of::<AttnArgs>()),
        ("SIZEOF_GEMMARGS", size_of::<GemmArgs>()),
        ("SIZEOF_ROPEARGS", size_of::<RopeArgs>()),
        ("SIZEOF_PREFILLATTNARGS", size_of::<PrefillAttnArgs>()),
        ("SIZEOF_SAMPLEPARAMS", size_of::<SampleParams>()),
        ("GEMV2_CTAS_PER_SM", super::ops::GEMV2_CTAS_PER_SM as usize),
        ("GEMV3_CTAS_PER_SM", GEMV3_CTAS_PER_SM as usize),
        ("GEMV3_KH2_CTAS_PER_SM", GEMV3_KH2_CTAS_PER_SM as usize),
    ];
    let values = [
        ("GEMV_THREADS", GEMV_THREADS as usize),
        ("ATTN_THREADS", ATTN_THREADS as usize),
        ("MAX_HEAD_DIM", MAX_HEAD_DIM),
        ("ATTN2_CHUNK", ATTN2_CHUNK),
        ("ATTN2_MAX_GROUP", ATTN2_MAX_GROUP),
        ("ATTN2_MAX_GROUP_X_HD", ATTN2_MAX_GROUP_X_HD),
        ("ATTN2_MAX_CHUNKS", ATTN2_MAX_CHUNKS),
        ("GEMM_WARPS", GEMM_WARPS),
        ("ATTNP_THREADS", ATTNP_THREADS as usize),
        ("ATTNP_TILE", ATTNP_TILE),
        ("ATTNP_Q_FLOATS", ATTNP_Q_FLOATS),
        ("ATTNP_MERGE_WAYS", ATTNP_MERGE_WAYS),
        ("ATTNM_WARPS", ATTNM_WARPS),
        ("ATTNL_RANKS", ATTNL_RANKS),
        ("ATTNL_MAX_GROUP", ATTNL_MAX_GROUP),
        ("ATTNL_MAX_CLUSTERS", ATTNL_MAX_CLUSTERS),
        ("ATTNF_MERGE_GROUP", ATTNF_MERGE_GROUP),
        ("ATTNF_MAX_MERGE", ATTNF_MAX_MERGE),
        ("ATTNF_COUNTS", ATTNF_COUNTS),
        ("GEMV3_WARPS", GEMV3_WARPS),
        ("GEMV3_COLS", GEMV3_COLS),
        ("SWIGLU_W20_K", super::ops::SWIGLU_W20_K),
        ("SWIGLU_W20_KPARTS", super::ops::SWIGLU_W20_KPARTS as usize),
        ("LOGITS_W20_LATE_SUMS", super::ops::LOGITS_W20_LATE_SUMS),
        ("SWIGLU_W20_WARPS", super::ops::SWIGLU_W20_WARPS as usize),
        ("DOWN_W27_K", super::ops::DOWN_W27_K),
        ("DOWN_W27_WARPS", super::ops::DOWN_W27_WARPS as usize),
        ("X_STAGE_STRIDE", GEMV2_X_STRIDE),
        ("X16_STAGE_STRIDE", GEMV2_X16_STRIDE),
        ("PRMT_LUT_WORDS", GEMV2_PRMT_TABLE / 4),
        ("KWALK_TABLE_AT", KWALK_TABLE_AT),
        ("SAMPLE_THREADS", SAMPLE_THREADS as usize),
        ("SAMPLE_BINS", SAMPLE_BINS),
        ("SAMPLE_MAX_CTAS", MAX_ARGMAX_CTAS),
        ("SAMPLE_WORK_WORDS", SAMPLE_WORK_WORDS),
        ("SAMPLE_CANDIDATES", SAMPLE_CANDIDATES),
        ("STATE_TOKEN", state::TOKEN),
        ("STATE_POSITION", state::POSITION),
        ("STATE_VALID_LEN", state::VALID_LEN),
        ("STATE_NEXT_TOKEN", state::NEXT_TOKEN),
        ("STATE_FINISHED", state::FINISHED),
        ("STATE_RING_COUNT", state::RING_COUNT),
        ("STATE_NONFINITE", state::NONFINITE),
        ("STATE_LEN", state::LEN),
    ];
    values
        .iter()
        .chain(sizes.iter())
        .map(|(name, v)| format!("-D{name}={v}"))
        .chain([format!("-DNF4_CODEBOOK={{{}}}", codebook.join(","))])
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
        ("common.cuh", include_str!("../../kernels/common.cuh")),
        ("gemv.cu", include_str!("../../kernels/gemv.cu")),
        ("attention.cu", include_str!("../../kernels/attention.cu")),
        ("small.cu", include_str!("../../kernels/small.cu")),
        ("gemm.cu", include_str!("../../kernels/gemm.cu")),
        ("gemv_mma.cu", include_str!("../../kernels/gemv_mma.cu")),
        (
            "attention_prefill.cu",
            include_str!("../../kernels/attention_prefill.cu"),
        ),
        (
            "attention_long.cu",
            include_str!("../../kernels/attention_long.cu"),
        ),
        ("sample.cu", include_str!("../../kernels/sample.cu")),
    ],
};
/// Benchmark-only kernels (the streaming-read floor).
pub const BENCH: KernelUnit = KernelUnit {
    name: "bench",
    files: &[
        ("common.cuh", include_str!("../../kernels/common.cuh")),
        ("bench.cu", include_str!("../../kernels/bench.cu")),
    ],
};

/// The source of a unit: each file from `dir/<name>` when given (`DV2_KERNEL_DIR`), else
/// the embedded copy, with a `#line` directive before each so compiler messages name the right
/// file.
fn source(unit: &KernelUnit, dir: Option<&PathBuf>) -> Result<String> {
    let mut src = String::new();
    for (name, text) in unit.files {
        src.push_str(&format!("#line 1 \"{name}\"\n"));
        match dir {
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

/// The oldest NVRTC that compiles the kernels: 12.4 (GEMV v2's `__maxnreg__`; NVRTC 12.0
/// rejects it; 12.4 and 12.8 compile every kernel for sm_80 to sm_90, 12.8 also sm_100 and
/// sm_120: docs/lab.md, session 29).
pub const MIN_NVRTC: (i32, i32) = (12, 4);

/// Why an NVRTC of `version` that compiles for the compute capabilities `archs` (80, 86, ...)
/// cannot build the kernels for `arch` ("sm_90"); None when it can.
pub fn nvrtc_refusal(version: (i32, i32), archs: &[i32], arch: &str) -> Option<String> {
    let (major, minor) = version;
    if version < MIN_NVRTC {
        return Some(format!(
            "NVRTC {major}.{minor} found; decodev2's kernels need NVRTC {}.{} or later \
             (libnvrtc from CUDA 12.4+, e.g. the PyPI wheel nvidia-cuda-nvrtc-cu12>=12.4)",
            MIN_NVRTC.0, MIN_NVRTC.1
        ));
    }
    let cc = arch.trim_start_matches("sm_").trim_end_matches('a');
    if cc.parse::<i32>().is_ok_and(|cc| !archs.contains(&cc)) {
        return Some(format!(
            "NVRTC {major}.{minor} cannot compile for {arch} (it takes sm_{}); a newer NVRTC \
             does (CUDA 12.8 or later for sm_100 and sm_120)",
            archs
                .iter()
                .map(|a| a.to_string())
                .collect::<Vec<_>>()
                .join(", sm_")
        ));
    }
    None
}

/// The compute capabilities this NVRTC compiles for.
fn nvrtc_archs() -> Result<Vec<i32>> {
    let mut n = 0;
    // SAFETY: one valid out-pointer.
    unsafe { nvrtc_sys::nvrtcGetNumSupportedArchs(&mut n) }
        .result()
        .map_err(|e| Error::Cuda(format!("nvrtcGetNumSupportedArchs: {e:?}")))?;
    let mut archs = vec![0; n.max(0) as usize];
    // SAFETY: `archs` holds the count NVRTC just reported.
    unsafe { nvrtc_sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }
        .result()
        .map_err(|e| Error::Cuda(format!("nvrtcGetSupportedArchs: {e:?}")))?;
    Ok(archs)
}

/// The NVRTC found, as (major, minor), when it can build the kernels for `arch`; else
/// `BackendUnavailable` saying why ([`nvrtc_refusal`], or no usable libnvrtc).
pub fn nvrtc_for(arch: &str) -> Result<(i32, i32)> {
    with_nvrtc(|| check_nvrtc(arch))
}

fn check_nvrtc(arch: &str) -> Result<(i32, i32)> {
    let version = nvrtc_version()?;
    match nvrtc_refusal(version, &nvrtc_archs()?, arch) {
        Some(why) => Err(Error::BackendUnavailable(why)),
        None => Ok(version),
    }
}

/// `f`'s calls into libnvrtc, `BackendUnavailable` where it is absent or lacks an entry point
/// (cudarc panics on either).
fn with_nvrtc<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    if !nvrtc_present() {
        return Err(Error::BackendUnavailable(
            "NVRTC not found (libnvrtc.so.13, or .so.12 from CUDA 12.4 or later)".into(),
        ));
    }
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        Err(Error::BackendUnavailable(
            "libnvrtc lacks a required entry point".into(),
        ))
    })
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

/// NVRTC options: the architecture, the switches' defines ([`Config::nvrtc_defines`]), the
/// shared constants, and with `DV2_LINEINFO=1` source line information (for a profiler's
/// source view; the cache keeps the two builds apart, options being part of its key). The
/// compiler optimizes the module's kernels on every core (`--split-compile=0`): a machine's
/// first load compiled them in 32 s in one thread on 2 cores, 19 s split (docs/lab.md, session
/// 9). The split changes the code of some kernels (scheduling, shared-memory placement), not
/// what they compute.
fn options(arch: &str, cfg: &Config) -> Vec<String> {
    let mut opts = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "--split-compile=0".into(),
    ];
    if cfg.lineinfo {
        opts.push("--generate-line-info".into());
    }
    opts.extend(cfg.nvrtc_defines());
    opts.extend(shared_defines());
    opts
}

/// Runs NVRTC on `src` and returns the cubin and the compiler's log, or the log as the error.
fn nvrtc_compile(name: &str, src: &str, opts: &[String]) -> Result<(Vec<u8>, String)> {
    let c_src =
        CString::new(src).map_err(|_| Error::Internal("kernel source holds a NUL".into()))?;
    let c_name = CString::new(name).unwrap_or_default();
    let prog = nvrtc::create_program(&c_src, Some(&c_name))
        .map_err(|e| Error::Cuda(format!("nvrtcCreateProgram: {e:?}")))?;
    // SAFETY: `prog` is live until destroy_program below; buffers are sized by NVRTC's answers.
    let result = unsafe {
        let compiled = nvrtc::compile_program(prog, opts);
        let log = nvrtc::get_program_log(prog).unwrap_or_default();
        let log: Vec<u8> = log
            .iter()
            .map(|c| *c as u8)
            .take_while(|c| *c != 0)
            .collect();
        let log = String::from_utf8_lossy(&log).into_owned();
        match compiled {
            Err(e) => Err(Error::Cuda(format!(
                "NVRTC failed on {name} ({e:?}):\n{log}"
            ))),
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
                        Ok((cubin, log))
                    })
            }
        }
    };
    // SAFETY: created above, destroyed once.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    result
}

/// The cubin of the decode unit for `arch` (e.g. "sm_90") under `cfg`; see [`compile`].
pub fn compile_decode(arch: &str, cfg: &Config) -> Result<Vec<u8>> {
    compile(&DECODE, arch, cfg)
}

/// The cubin of a kernel file for `arch`, from the disk cache when the same source, options
/// and NVRTC version were compiled before. Needs libnvrtc, not a GPU.
pub fn compile(unit: &KernelUnit, arch: &str, cfg: &Config) -> Result<Vec<u8>> {
    let compile = || -> Result<Vec<u8>> {
        let src = source(unit, cfg.kernel_dir.as_ref())?;
        let opts = options(arch, cfg);
        let (major, minor) = check_nvrtc(arch)?;
        let key = fnv1a(&[
            src.as_bytes(),
            opts.join(" ").as_bytes(),
            format!("{major}.{minor}").as_bytes(),
        ]);
        let cached = cfg
            .cache_dir
            .as_ref()
            .map(|d| d.join(format!("{}-{arch}-{key:016x}.cubin", unit.name)));
        kernel_cache::cached_or_compile(
            cached.as_deref(),
            kernel_cache::OTHERS_COMPILE_WAIT,
            || Ok(nvrtc_compile(unit.name, &src, &opts)?.0),
        )
    };
    with_nvrtc(compile)
}

/// ptxas's report on a kernel file for `arch` under `cfg` (registers, stack, spill stores and
/// loads of every kernel: `--ptxas-options=-v`), compiled afresh, never from the cache. Needs
/// libnvrtc, not a GPU. Why: a kernel past its register bound spills without an error (the
/// 32B shape's SwiGLU kernel did, docs/lab.md session 30); tests/cuda_kernels.rs reads this.
pub fn ptxas_report(unit: &KernelUnit, arch: &str, cfg: &Config) -> Result<String> {
    with_nvrtc(|| {
        let src = source(unit, cfg.kernel_dir.as_ref())?;
        let mut opts = options(arch, cfg);
        let version = check_nvrtc(arch)?;
        opts.push("--ptxas-options=-v".into());
        // NVRTC 12.9+ keeps compiled code in the driver's compute cache where a driver is
        // installed, and a cached compile runs no ptxas, so reports nothing (docs/lab.md,
        // session 62). NVRTC before 12.9 has no such cache and refuses the option.
        if version >= (12, 9) {
            opts.push("--no-cache".into());
        }
        nvrtc_compile(unit.name, &src, &opts).map(|(_, log)| log)
    })
}

/// The tensor-core GEMM kernels of one epilogue: f16 activations by width (index into
/// [`GEMM_NT`]; prefill), and f32 activations at one n8 tile (`DV2_LINEAR=mma`'s decode step).
pub struct GemmKernels {
    pub f16: [CudaFunction; 4],
    pub f32_one: CudaFunction,
}

/// Every kernel of the decode unit, loaded into the device's context.
pub struct Kernels {
    /// The decode unit's module (its globals: `DV2_CTA_TIMELINE`'s records).
    pub module: Arc<CudaModule>,
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
    /// GEMV v2 by chunks per lane J (index J - 1): a plain matrix, the same from an f16 x,
    /// q/k/v, SwiGLU.
    pub gemv2_nf4: [CudaFunction; 3],
    pub gemv2_nf4_x16: [CudaFunction; 3],
    /// J = 4 from f16 x, for K past [`GEMV2_MAX_K`] where [`Kernels::gemv2_kwalk_x16`] would
    /// take more CTAs than fit.
    pub gemv2_nf4_x16_j4: CudaFunction,
    /// The K walk (where `Ops::walks_k`), from f16 x and from f32 x: one CTA per
    /// [`GEMV2_KWALK_ROWS`] rows, [`GEMV2_KWALK_KPARTS`] warps a row.
    pub gemv2_kwalk_x16: CudaFunction,
    pub gemv2_kwalk_f32: CudaFunction,
    /// q/k/v walking K: one CTA per [`GEMV2_KWALK_QKV_ROWS`] rows. It and the K walk from
    /// f32 x hold the PRMT-addressed table ([`GEMV2_PRMT_TABLE`] bytes) before x.
    pub gemv2_kwalk_qkv: CudaFunction,
    /// The K walk from f16 x over 16 warps, one CTA an SM, the PRMT-addressed table at window
    /// offset [`KWALK_TABLE_AT`] (where `Ops::walks_k_w16`); and the dynamic shared memory the
    /// device lets it take.
    pub gemv2_kwalk_x16_w16: CudaFunction,
    pub gemv2_kwalk_w16_room: usize,
    pub gemv2_qkv: [CudaFunction; 3],
    pub gemv2_swiglu: [CudaFunction; 3],
    /// SwiGLU at J = 1 over 5 warps a row, 20 warps a CTA, the PRMT-addressed table before x
    /// (K = 5,120 alone, where `Ops::swiglu_w20`); and the dynamic shared memory the device
    /// lets it take.
    pub gemv2_swiglu_w20: CudaFunction,
    pub gemv2_swiglu_w20_room: usize,
    /// Down at K = 27,648 walking rows over 27 warps a CTA (where `Ops::down_w27`), and the
    /// dynamic shared memory the device lets it take.
    pub gemv2_down_w27: CudaFunction,
    pub gemv2_down_w27_room: usize,
    /// The dynamic shared memory (x staged) every GEMV v2 kernel may take on this device, by
    /// x's type ([f32, f16]), and lm_head's (its table and x): what the device allows beside
    /// their static shared memory where that is less than they ask (99 KiB a CTA on sm_86,
    /// sm_89 and sm_120), so that a K past it goes to GEMV v3 instead of failing to launch.
    pub gemv2_room: [usize; 2],
    pub gemv2_logits_room: usize,
    /// lm_head with the argmax folded in, by J (`DV2_LOGITS_ARGMAX`; compiled only then).
    pub gemv2_logits: Option<[CudaFunction; 3]>,
    /// The same at K = 5,120 over SwiGLU's 20-warp walk (with `gemv2_logits`), and the dynamic
    /// shared memory the device lets it take.
    pub gemv2_logits_w20: Option<CudaFunction>,
    pub gemv2_logits_w20_room: usize,
    /// Attention v2 (splits of the context, their partials for attn2_merge) by head_dim: [any,
    /// 128, 64], the last two with the head_dim built in, in less code.
    pub attn2_decode: [CudaFunction; 3],
    pub attn2_merge: CudaFunction,
    /// GEMV v3 (tensor cores) by epilogue: store (+bias), accumulate, SwiGLU.
    pub gemv3: [CudaFunction; 3],
    /// The same for the decode step's uses alone (store and SwiGLU: a normed x, no sums out;
    /// accumulate: a raw x, sums out), in less code.
    pub gemv3_lean: [CudaFunction; 3],
    /// q/k/v's lean store kernel in K halves (`DV2_QKV_KHALVES`, default; compiled only then).
    pub gemv3_qkv_kh2: Option<CudaFunction>,
    /// GEMV v3 over up to GEMV3_COLS columns by epilogue (a short prefill chunk; the fourth:
    /// q/k/v stored with RoPE, `DV2_QKV_ROPE`), and the dynamic shared memory (its columns
    /// of x) the device lets each take.
    pub gemv3_cols: [CudaFunction; 4],
    pub gemv3_cols_room: usize,
    /// The same reading x from L2, not staged (where each group has a CTA; `DV2_COLS_X_L2`).
    pub gemv3_cols_l2: [CudaFunction; 4],
    /// The NF4 tensor-core GEMM by epilogue.
    pub gemm_store: GemmKernels,
    pub gemm_acc: GemmKernels,
    pub gemm_swiglu: GemmKernels,
    pub embed_rows: CudaFunction,
    pub rope_kv_rows: CudaFunction,
    pub advance_by: CudaFunction,
    pub begin_prefill: CudaFunction,
    /// Prefill attention on CUDA cores with 2 and 8 rows per warp (8 and 32 per CTA), for the
    /// head_dims the tensor-core kernels lack.
    pub attn_prefill: [CudaFunction; 2],
    /// Tensor-core prefill attention for head_dim 16, 32, 64, 128.
    pub attn_prefill_mma: [CudaFunction; 4],
    /// The splits of a split prefill attention merged (DV2_PREFILL_SPLIT).
    pub attn_prefill_merge: CudaFunction,
    /// Long-context decode attention for head_dim 64 and 128.
    pub attn_long_decode: [CudaFunction; 2],
    /// The long-context attention without clusters: [64, 128].
    pub attn_long_flat_decode: [CudaFunction; 2],
    /// The sampler (kernels/sample.cu).
    pub sample_draw: CudaFunction,
}

/// Lets each of `funcs` take up to `bytes` of dynamic shared memory (past the 48 KiB default),
/// or as much as the device allows beside the function's static shared memory where that is
/// less (before Hopper: 99 KiB per CTA on sm_86/sm_89, 163 KiB on sm_80). A launch that needs
/// more then fails with the driver's error, not the load.
pub(super) fn allow_dynamic_smem(gpu: &Gpu, funcs: &[CudaFunction], bytes: usize) -> Result<()> {
    for func in funcs {
        let fixed = func
            .get_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
            .map_err(driver_error("static shared memory"))?
            .max(0) as usize;
        let allowed = bytes.min(gpu.caps.max_smem_per_cta.saturating_sub(fixed));
        func.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            allowed as i32,
        )
        .map_err(driver_error("dynamic shared memory attribute"))?;
    }
    Ok(())
}

/// Compiles (or takes from the cache) a kernel file and loads it into the device's context.
pub fn load_module(gpu: &Gpu, unit: &KernelUnit, cfg: &Config) -> Result<Arc<CudaModule>> {
    let cubin = compile(unit, &gpu.arch()?, cfg)?;
    gpu.ctx
        .load_module(Ptx::from_binary(cubin))
        .map_err(driver_error("cuModuleLoadData"))
}

impl Kernels {
    pub fn load(gpu: &Gpu, cfg: &Config) -> Result<Self> {
        let module = load_module(gpu, &DECODE, cfg)?;
        let f = |name: &str| -> Result<CudaFunction> {
            module.load_function(name).map_err(driver_error(name))
        };
        // One kernel that may take up to `smem` bytes of dynamic shared memory.
        let f_smem = |name: &str, smem: usize| -> Result<CudaFunction> {
            let func = f(name)?;
            allow_dynamic_smem(gpu, std::slice::from_ref(&func), smem)?;
            Ok(func)
        };
        // GEMV v2 by J; it stages x in dynamic shared memory, up to GEMV2_MAX_SMEM bytes
        // (lm_head's kernels: its table before x).
        let gemv2 = |name: &str, suffix: &str, smem: usize| -> Result<[CudaFunction; 3]> {
            let [a, b, c] = [1, 2, 3].map(|j| f(&format!("{name}_j{j}{suffix}")));
            let fs = [a?, b?, c?];
            allow_dynamic_smem(gpu, &fs, smem)?;
            Ok(fs)
        };
        let gemm = |name: &str| -> Result<GemmKernels> {
            let [a, b, c, d] = GEMM_NT.map(|nt| f(&format!("{name}_nt{nt}")));
            Ok(GemmKernels {
                f16: [a?, b?, c?, d?],
                f32_one: f(&format!("{name}_nt1_f32"))?,
            })
        };
        // GEMV v3 stages x in dynamic shared memory, up to GEMV3_MAX_SMEM bytes.
        let gemv3 = [f("gemv3_store")?, f("gemv3_acc")?, f("gemv3_swiglu")?];
        allow_dynamic_smem(gpu, &gemv3, GEMV3_MAX_SMEM)?;
        let gemv3_lean = [
            f("gemv3_store_lean")?,
            f("gemv3_acc_lean")?,
            f("gemv3_swiglu_lean")?,
        ];
        allow_dynamic_smem(gpu, &gemv3_lean, GEMV3_MAX_SMEM)?;
        let gemv3_cols = [
            f("gemv3_cols_store")?,
            f("gemv3_cols_acc")?,
            f("gemv3_cols_swiglu")?,
            f("gemv3_cols_rope")?,
        ];
        allow_dynamic_smem(gpu, &gemv3_cols, GEMV3_COLS_MAX_SMEM)?;
        let gemv3_cols_l2 = [
            f("gemv3_cols_store_l2")?,
            f("gemv3_cols_acc_l2")?,
            f("gemv3_cols_swiglu_l2")?,
            f("gemv3_cols_rope_l2")?,
        ];
        let gemv3_qkv_kh2 = if cfg.qkv_khalves {
            Some(f_smem("gemv3_store_lean_kh2", GEMV3_MAX_SMEM)?)
        } else {
            None
        };
        // Attention v2 keeps its q heads' running outputs in dynamic shared memory.
        let attn2_decode = [
            f("attn2_decode")?,
            f("attn2_decode_hd128")?,
            f("attn2_decode_hd64")?,
        ];
        allow_dynamic_smem(gpu, &attn2_decode, ATTN2_MAX_GROUP_X_HD * 4)?;
        // The f16-x kernels that take K past GEMV2_MAX_K (down at the 32B shape).
        let x16_max_smem = gemv2_x_smem(GEMV2_X16_MAX_K, true);
        let mut k = Self {
            module: module.clone(),
            gemv3,
            gemv3_lean,
            gemv3_qkv_kh2,
            gemv3_cols,
            gemv3_cols_room: 0,
            gemv3_cols_l2,
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
            gemv2_nf4: gemv2("gemv2_nf4", "_narrow", GEMV2_MAX_SMEM)?,
            gemv2_nf4_x16: gemv2("gemv2_nf4", "_narrow_x16", GEMV2_MAX_SMEM)?,
            gemv2_nf4_x16_j4: f_smem("gemv2_nf4_j4_narrow_x16", x16_max_smem)?,
            gemv2_kwalk_x16: f_smem("gemv2_kwalk_x16", x16_max_smem)?,
            gemv2_kwalk_f32: f_smem("gemv2_kwalk_f32", GEMV2_PRMT_TABLE + x16_max_smem)?,
            gemv2_kwalk_qkv: f_smem("gemv2_kwalk_qkv", GEMV2_PRMT_TABLE + x16_max_smem)?,
            gemv2_kwalk_x16_w16: f_smem("gemv2_kwalk_x16_w16", KWALK_TABLE_AT + GEMV2_PRMT_TABLE)?,
            gemv2_kwalk_w16_room: 0,
            gemv2_qkv: gemv2("gemv2_qkv", "_narrow", GEMV2_MAX_SMEM)?,
            gemv2_swiglu: gemv2("gemv2_swiglu", "_narrow", GEMV2_MAX_SMEM)?,
            gemv2_swiglu_w20: f_smem("gemv2_swiglu_j1_w20", GEMV2_MAX_SMEM + GEMV2_PRMT_TABLE)?,
            gemv2_swiglu_w20_room: 0,
            gemv2_down_w27: f_smem("gemv2_down_j1_w27", GEMV2_PRMT_TABLE)?,
            gemv2_down_w27_room: 0,
            gemv2_logits: if cfg.logits_argmax {
                Some(gemv2(
                    "gemv2_logits",
                    "_narrow",
                    GEMV2_MAX_SMEM + GEMV2_PRMT_TABLE,
                )?)
            } else {
                None
            },
            gemv2_logits_w20: if cfg.logits_argmax {
                Some(f_smem(
                    "gemv2_logits_j1_w20",
                    GEMV2_MAX_SMEM + GEMV2_PRMT_TABLE,
                )?)
            } else {
                None
            },
            gemv2_logits_w20_room: 0,
            attn2_decode,
            attn2_merge: f("attn2_merge")?,
            gemm_store: gemm("gemm_store")?,
            gemm_acc: gemm("gemm_acc")?,
            gemm_swiglu: gemm("gemm_swiglu")?,
            embed_rows: f("embed_rows")?,
            rope_kv_rows: f("rope_kv_rows")?,
            advance_by: f("advance_by")?,
            begin_prefill: f("begin_prefill")?,
            attn_prefill: [f("attn_prefill_r2")?, f("attn_prefill_r8")?],
            attn_prefill_merge: f("attn_prefill_merge")?,
            attn_prefill_mma: [
                f("attn_prefill_mma_hd16")?,
                f("attn_prefill_mma_hd32")?,
                f("attn_prefill_mma_hd64")?,
                f("attn_prefill_mma_hd128")?,
            ],
            attn_long_decode: [f("attn_long_decode_hd64")?, f("attn_long_decode_hd128")?],
            attn_long_flat_decode: [
                f("attn_long_flat_decode_hd64")?,
                f("attn_long_flat_decode_hd128")?,
            ],
            sample_draw: f("sample_draw")?,
            gemv2_room: [0; 2],
            gemv2_logits_room: 0,
        };
        let f32_x: Vec<&CudaFunction> = [&k.gemv2_nf4, &k.gemv2_qkv, &k.gemv2_swiglu]
            .into_iter()
            .flatten()
            .collect();
        let f16_x: Vec<&CudaFunction> = k
            .gemv2_nf4_x16
            .iter()
            .chain([&k.gemv2_nf4_x16_j4, &k.gemv2_kwalk_x16])
            .collect();
        k.gemv2_room = [dynamic_smem_room(&f32_x)?, dynamic_smem_room(&f16_x)?];
        k.gemv3_cols_room = dynamic_smem_room(&k.gemv3_cols.iter().collect::<Vec<_>>())?;
        k.gemv2_swiglu_w20_room = dynamic_smem_room(&[&k.gemv2_swiglu_w20])?;
        k.gemv2_down_w27_room = dynamic_smem_room(&[&k.gemv2_down_w27])?;
        k.gemv2_kwalk_w16_room = dynamic_smem_room(&[&k.gemv2_kwalk_x16_w16])?;
        k.gemv2_logits_room = match &k.gemv2_logits {
            Some(fs) => dynamic_smem_room(&fs.iter().collect::<Vec<_>>())?,
            None => 0,
        };
        k.gemv2_logits_w20_room = match &k.gemv2_logits_w20 {
            Some(f) => dynamic_smem_room(&[f])?,
            None => 0,
        };
        Ok(k)
    }
}

/// The least dynamic shared memory any of `funcs` may take, as [`allow_dynamic_smem`] set it.
fn dynamic_smem_room(funcs: &[&CudaFunction]) -> Result<usize> {
    let mut room = usize::MAX;
    for func in funcs {
        let allowed = func
            .get_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
            .map_err(driver_error("dynamic shared memory attribute"))?;
        room = room.min(allowed.max(0) as usize);
    }
    Ok(room)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_nvrtc_too_old_or_without_the_arch_is_refused_by_name() {
        let cuda_12_4 = [50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90];
        let too_old = nvrtc_refusal((12, 0), &cuda_12_4, "sm_90").unwrap();
        assert!(too_old.contains("NVRTC 12.0 found") && too_old.contains("12.4 or later"));
        assert_eq!(nvrtc_refusal((12, 4), &cuda_12_4, "sm_90"), None);
        assert_eq!(nvrtc_refusal((12, 4), &cuda_12_4, "sm_86"), None);
        let no_arch = nvrtc_refusal((12, 4), &cuda_12_4, "sm_120").unwrap();
        assert!(no_arch.contains("cannot compile for sm_120") && no_arch.contains("sm_90"));
        assert_eq!(
            nvrtc_refusal((13, 0), &[75, 80, 90, 100, 120], "sm_120"),
            None
        );
        assert_eq!(
            nvrtc_refusal((13, 0), &[75, 80, 90, 100, 120], "sm_90a"),
            None
        );
    }
}
