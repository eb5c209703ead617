//! Device microbenchmarks: the streaming-read floor, the GEMV kernels on given shapes, and
//! attention. Each is captured as a graph of launches over copies rotated well past the
//! 60 MB L2 (so the figures are HBM's), replayed many times, timed with CUDA events; the
//! median per launch is reported. Inputs are random, never zeros.

use cudarc::driver::{CudaFunction, CudaSlice, DeviceRepr, LaunchConfig};
use half::f16;

use super::budget::kv_stride;
use super::device::{driver_error, Gpu};
use super::kernels::state;
use super::kernels::{allow_dynamic_smem, load_module, BENCH};
use super::ops::{
    attn_partials, AttnArgs, Epilogue, GemmMatrix, GemvChoice, Input, Ops, QkvArgs, ARGMAX_SCRATCH,
};
use super::profile::timing_event;
use super::weights::{mma_scale, scale_bits, Nf4Ref};
use crate::arch::ArchSpec;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::nf4::stored_bytes;
use crate::rope::{RopeScaling, RopeTable};

/// kernels/bench.cu's grid_layers: the most pages of its shared-memory ring, the operators of
/// a layer, the largest K of an operator, its consumer threads (one more warp is the
/// producer), and its static shared memory (the lane-copied f16-pair table's 32 KB, the
/// mbarriers and the warps' sums) with room to spare.
const GL_MAX_PAGES: usize = 16;
const GL_OPS: usize = 5;
const GL_MAX_K: usize = 11008;
const GL_THREADS: u32 = 256;
const GL_STATIC_SMEM: usize = 33 * 1024;

/// kernels/bench.cu `GridLayerArgs`.
#[repr(C)]
#[derive(Clone, Copy)]
struct GridLayerArgs {
    w: u64,
    x_a: u64,
    x_b: u64,
    bar: u64,
    failed: u64,
    ops_rows: [i32; GL_OPS],
    ops_k: [i32; GL_OPS],
    layers: i32,
    handover: i32,
    walk: i32,
    page: i32,
    pages: i32,
    _pad: i32,
}

// SAFETY: plain old data matching the kernel's struct (five pointers, then 15 ints and the
// padding to its 8-byte alignment).
unsafe impl DeviceRepr for GridLayerArgs {}

/// How a persistent kernel's rounds hand a vector on (kernels/bench.cu, `HANDOVER_*`): plain
/// floats after a grid barrier by a generation or by a count, or flagged pairs (each value
/// stored with its round's tag in one 8-byte store, polled by its readers) with no barrier;
/// or none (grid_layers only: each operator reads the vector it read before, so its time is
/// the stream's and the walks' alone).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handover {
    ByGeneration = 0,
    ByCount = 1,
    Flagged = 2,
    None = 3,
}

impl Handover {
    /// Words a vector of `n` floats takes as this hand-over stores it.
    fn words(self, n: usize) -> usize {
        if self == Handover::Flagged {
            2 * n
        } else {
            n
        }
    }
}

/// grid_layers' ring of shared-memory pages: how many, of how many bytes.
#[derive(Clone, Copy, Debug)]
pub struct GlRing {
    pub pages: usize,
    pub page: usize,
}

/// Rotate over at least this many bytes of copies: several times the H200's 60 MB L2.
const ROTATE_BYTES: usize = 512 << 20;
const WARMUP: usize = 3;
const REPLAYS: usize = 25;

/// One measured kernel: bytes it must move, median time, and the streaming-read time for the
/// same byte count on this device.
#[derive(Clone, Debug)]
pub struct Timing {
    pub name: String,
    pub bytes: usize,
    pub median_us: f64,
    pub floor_us: f64,
}

impl Timing {
    pub fn gb_per_s(&self) -> f64 {
        self.bytes as f64 / self.median_us / 1e3
    }
    /// Floor time over measured time: 1.0 is the streaming-read speed.
    pub fn of_floor(&self) -> f64 {
        self.floor_us / self.median_us
    }
}

/// Deterministic random bytes (xorshift), so no input is ever all zeros.
fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect()
}

/// Deterministic uniform f32 in [lo, hi) (the benches' inputs; the GEMV test's too).
pub fn random_f32(len: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    random_bytes(len * 3, seed)
        .chunks_exact(3)
        .map(|b| {
            lo + (hi - lo) * ((b[0] as u32) << 16 | (b[1] as u32) << 8 | b[2] as u32) as f32
                / 16_777_216.0
        })
        .collect()
}

struct RandomMatrix {
    packed: CudaSlice<u8>,
    absmax: CudaSlice<u16>,
    mma_scale: f32,
}

impl RandomMatrix {
    fn new(gpu: &Gpu, rows: usize, cols: usize, seed: u64) -> Result<Self> {
        let absmax: Vec<f16> = random_f32(rows * cols / 64, seed + 1, 0.01, 0.1)
            .into_iter()
            .map(f16::from_f32)
            .collect();
        Ok(Self {
            packed: gpu.upload(&random_bytes(rows * cols / 2, seed))?,
            absmax: gpu.upload(scale_bits(&absmax))?,
            mma_scale: mma_scale(&absmax),
        })
    }
    fn as_ref(&self, gpu: &Gpu) -> Nf4Ref {
        Nf4Ref {
            packed: gpu.ptr(&self.packed),
            absmax: gpu.ptr(&self.absmax),
            mma_scale: self.mma_scale,
        }
    }
}

pub struct Bench {
    ops: Ops,
    stream_read: CudaFunction,
    chain_link: CudaFunction,
    grid_barriers: CudaFunction,
    grid_phases: CudaFunction,
    grid_layers: CudaFunction,
    sink: CudaSlice<u32>,
}

/// The most dynamic shared memory a chain link asks for: enough that a second CTA cannot be
/// resident on its SM (228 KB per SM on an H200), as the registers of an SM-filling kernel would
/// forbid (GEMV v2's 182-236-register kernels until a1b9aaa).
pub const CHAIN_LINK_MAX_SMEM: u32 = 200 * 1024;

impl Bench {
    /// Kernel variants come from the environment, as in the backend (see [`super::ops`]).
    pub fn new(device: usize) -> Result<Self> {
        let cfg = Config::from_env();
        let ops = Ops::new(Gpu::open(device, &cfg)?, cfg)?;
        let module = load_module(&ops.gpu, &BENCH, &ops.cfg)?;
        let f = |name: &str| -> Result<CudaFunction> {
            module.load_function(name).map_err(driver_error(name))
        };
        let (stream_read, chain_link) = (f("stream_read")?, f("chain_link")?);
        let (grid_barriers, grid_phases) = (f("grid_barriers")?, f("grid_phases")?);
        let grid_layers = f("grid_layers")?;
        allow_dynamic_smem(
            &ops.gpu,
            std::slice::from_ref(&chain_link),
            CHAIN_LINK_MAX_SMEM as usize,
        )?;
        let sink = ops.gpu.zeros(1)?;
        Ok(Self {
            ops,
            stream_read,
            chain_link,
            grid_barriers,
            grid_phases,
            grid_layers,
            sink,
        })
    }

    pub fn device_name(&self) -> String {
        self.ops.gpu.name()
    }

    /// The kernel variants in use, e.g. "gemv v2, attention v2".
    /// Forces one GEMV family on every matrix (the kernel table compares them).
    pub fn set_gemv(&mut self, gemv: GemvChoice) {
        self.ops.gemv = gemv;
    }

    pub fn variants(&self) -> String {
        format!("gemv {:?}, attention {:?}", self.ops.gemv, self.ops.attn).to_lowercase()
    }

    /// Copies needed so that `bytes_each * copies` spans ROTATE_BYTES (at least 2).
    fn copies(bytes_each: usize) -> usize {
        ROTATE_BYTES.div_ceil(bytes_each.max(1)).clamp(2, 256)
    }

    /// Median µs per launch: `launch(i)` for i in 0..copies captured as one graph, replayed.
    fn time_rotated(&self, copies: usize, launch: impl Fn(usize) -> Result<()>) -> Result<f64> {
        let stream = self.ops.gpu.stream.clone();
        let graph = self.ops.gpu.capture(|| (0..copies).try_for_each(&launch))?;
        let (start, end) = (timing_event(&self.ops.gpu)?, timing_event(&self.ops.gpu)?);
        let mut per_launch = Vec::with_capacity(REPLAYS);
        for i in 0..WARMUP + REPLAYS {
            start.record(&stream).map_err(driver_error("event"))?;
            graph.launch().map_err(driver_error("graph launch"))?;
            end.record(&stream).map_err(driver_error("event"))?;
            self.ops.gpu.sync()?;
            if i >= WARMUP {
                per_launch.push(
                    start.elapsed_ms(&end).map_err(driver_error("elapsed"))? as f64 * 1e3
                        / copies as f64,
                );
            }
        }
        per_launch.sort_by(f64::total_cmp);
        Ok(per_launch[per_launch.len() / 2])
    }

    /// The streaming-read floor: µs to read `bytes` with 16-byte loads (rotated copies).
    pub fn floor_us(&self, bytes: usize) -> Result<f64> {
        let bytes = bytes.next_multiple_of(16);
        let copies = Self::copies(bytes);
        let data = random_bytes(bytes, 7);
        let bufs = (0..copies)
            .map(|_| self.ops.gpu.upload(&data))
            .collect::<Result<Vec<_>>>()?;
        let n16 = (bytes / 16) as u64;
        let sink = self.ops.gpu.ptr(&self.sink);
        // 8 CTAs of 256 threads per SM, never more CTAs than 16-byte words.
        let sms = 132u64;
        let ctas = (sms * 8).min(n16.div_ceil(256)).max(1) as u32;
        let cfg = LaunchConfig {
            grid_dim: (ctas, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        self.time_rotated(copies, |i| {
            let p = self.ops.gpu.ptr(&bufs[i]);
            launch!(self.ops.gpu, &self.stream_read, cfg; p, n16, sink)
        })
    }

    /// µs per kernel boundary: a graph of `links` dependent launches that do nothing else
    /// (chain_link, one CTA of 256 threads per SM), replayed; `smem` bytes of dynamic shared
    /// memory per CTA (at most [`CHAIN_LINK_MAX_SMEM`]; near it, a link's CTA waits for the
    /// previous link's CTA to leave its SM, as a GEMV v2 CTA does). Programmatic dependent
    /// launch as the engine uses it (`DV2_PDL=0` off). What the decode step's ~6 launches per
    /// layer cost at the least, before any kernel's own latency.
    pub fn boundary_us(&self, links: usize, smem: u32) -> Result<f64> {
        if smem > CHAIN_LINK_MAX_SMEM {
            return Err(Error::InvalidArgument(format!(
                "chain link shared memory {smem} > {CHAIN_LINK_MAX_SMEM}"
            )));
        }
        let sms = self.ops.sms;
        let counters = self.ops.gpu.zeros::<u32>(sms as usize)?;
        let ptr = self.ops.gpu.ptr(&counters);
        let cfg = LaunchConfig {
            grid_dim: (sms, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: smem,
        };
        self.time_rotated(links, |_| launch!(self.ops.gpu, &self.chain_link, cfg; ptr))
    }

    /// µs per grid-wide barrier: one launch of `rounds` barriers (grid_barriers, one CTA of
    /// 256 threads per SM, launched cooperatively so that all are resident), replayed; by the
    /// one count that only grows (`by_count`), or by a generation. What a persistent kernel
    /// pays per dependency where [`Bench::boundary_us`] is what a launch boundary costs.
    pub fn grid_barrier_us(&self, rounds: usize, by_count: bool) -> Result<f64> {
        let rounds_i = i32::try_from(rounds)
            .map_err(|_| Error::InvalidArgument(format!("{rounds} grid barriers")))?;
        let by_count = by_count as i32;
        // Two u32 for the generation's barrier, or one u64 count.
        let bar = self.ops.gpu.zeros::<u32>(2)?;
        let ptr = self.ops.gpu.ptr(&bar);
        let cfg = LaunchConfig {
            grid_dim: (self.ops.sms, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let per_launch = self.time_rotated(1, |_| {
            launch!(self.ops.gpu, &self.grid_barriers, cfg, cooperative; ptr, rounds_i, by_count)
        })?;
        Ok(per_launch / rounds.max(1) as f64)
    }

    /// µs per hand-over inside a persistent kernel: `rounds` rounds of grid_phases in one
    /// launch, each every CTA reading the n floats the last round wrote, multiplying its rows
    /// of an n × n matrix held in shared memory, writing tanh of the sums and handing them
    /// on by `handover`. What issue 36's kernel would take for a small matrix whose weights
    /// were loaded before its input was ready (the 3B shape's o: n = 2,048), against a
    /// kernel's increment in today's graph. Checked first: 16 rounds against the CPU, so a
    /// hand-over that let a round start early is an error, not a time. Flagged hand-overs need
    /// 3 rounds or more: a launch's first reads wait for tags 1 and 2, which the last launch's
    /// final rounds must not have left in the buffers.
    pub fn grid_phase_us(&self, rounds: usize, n: usize, handover: Handover) -> Result<f64> {
        let sms = self.ops.sms as usize;
        let rows_per_cta = n.div_ceil(sms);
        let smem = (rows_per_cta * n + n) * 4;
        if n == 0 || !n.is_multiple_of(4) || smem > self.ops.gpu.caps.max_smem_per_cta {
            return Err(Error::InvalidArgument(format!(
                "grid phases of n = {n}: a multiple of 4 whose {rows_per_cta} rows a CTA and x \
                 fit in shared memory"
            )));
        }
        if handover == Handover::None || (handover == Handover::Flagged && rounds < 3) {
            return Err(Error::InvalidArgument(format!(
                "grid phases: {rounds} rounds handed over {handover:?} (a hand-over, and 3 rounds \
                 or more when flagged)"
            )));
        }
        let rounds_i = i32::try_from(rounds)
            .map_err(|_| Error::InvalidArgument(format!("{rounds} grid phases")))?;
        allow_dynamic_smem(&self.ops.gpu, std::slice::from_ref(&self.grid_phases), smem)?;
        let x: Vec<f32> = random_bytes(n, 11)
            .iter()
            .map(|&b| b as f32 / 127.5 - 1.0)
            .collect();
        let x_in = self.ops.gpu.upload(&x)?;
        let words = handover.words(n);
        let (x_a, x_b) = (
            self.ops.gpu.zeros::<u32>(words)?,
            self.ops.gpu.zeros::<u32>(words)?,
        );
        let bar = self.ops.gpu.zeros::<u32>(2)?;
        let (bar, x_in_p) = (self.ops.gpu.ptr(&bar), self.ops.gpu.ptr(&x_in));
        let (x_a_p, x_b_p) = (self.ops.gpu.ptr(&x_a), self.ops.gpu.ptr(&x_b));
        let (n_i, rows_i, handover_i) = (n as i32, rows_per_cta as i32, handover as i32);
        let cfg = LaunchConfig {
            grid_dim: (self.ops.sms, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let launch = |rounds: i32| {
            launch!(self.ops.gpu, &self.grid_phases, cfg, cooperative;
                bar, x_in_p, x_a_p, x_b_p, n_i, rows_i, rounds, handover_i)
        };
        const CHECKED_ROUNDS: usize = 16;
        launch(CHECKED_ROUNDS as i32)?;
        // Round r writes x_a when r is even: the last of 16 wrote x_b, flagged with tag 16.
        let stored = self.ops.gpu.download(&x_b, words)?;
        let got: Vec<f32> = if handover == Handover::Flagged {
            let tags_ok = stored.chunks(2).all(|p| p[1] == CHECKED_ROUNDS as u32);
            if !tags_ok {
                return Err(Error::Cuda(format!(
                    "grid_phases: a value of round {CHECKED_ROUNDS} without its tag"
                )));
            }
            stored.chunks(2).map(|p| f32::from_bits(p[0])).collect()
        } else {
            stored.iter().map(|&b| f32::from_bits(b)).collect()
        };
        let want = grid_phases_on_cpu(&x, CHECKED_ROUNDS);
        let err = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs())
            // f32::max would drop a NaN; a NaN sum is the worst error there is.
            .fold(
                0.0f32,
                |worst, e| if e.is_nan() || e > worst { e } else { worst },
            );
        if err.is_nan() || err > 1e-3 {
            return Err(Error::Cuda(format!(
                "grid_phases: max |gpu - cpu| {err} after {CHECKED_ROUNDS} rounds (cap 1e-3)"
            )));
        }
        let per_launch = self.time_rotated(1, |_| launch(rounds_i))?;
        Ok(per_launch / rounds.max(1) as f64)
    }

    /// µs per layer of grid_layers (kernels/bench.cu): a skeleton of issue 36's persistent
    /// step over `layers` layers of `spec`'s five operators (q/k/v, the attention as a
    /// hand-over of no weights, o, gate/up, down) in one launch, the weights streamed through
    /// `ring`'s shared-memory pages by bulk copies that a producer warp runs ahead across the
    /// operators, the NF4 walk's table lookups and FMAs on each chunk (without `walk`, the pages
    /// waited for and released unread: the ring's own pace), each operator's output handed on
    /// by `handover` (by a count, flagged or none). Weights random, `layers` of them in HBM
    /// (never L2's).
    pub fn grid_layers_us(
        &self,
        spec: &ArchSpec,
        layers: usize,
        handover: Handover,
        walk: bool,
        ring: GlRing,
    ) -> Result<f64> {
        let grid = self.ops.sms as usize;
        let q = spec.n_q_heads * spec.head_dim;
        let ops: [(usize, usize); GL_OPS] = [
            (spec.qkv_rows(), spec.hidden),
            (0, q),
            (spec.hidden, q),
            (2 * spec.intermediate, spec.hidden),
            (spec.hidden, spec.intermediate),
        ];
        if handover == Handover::ByGeneration {
            return Err(Error::InvalidArgument(
                "grid layers: a barrier by generation is grid_phases' alone".into(),
            ));
        }
        if !(1..=GL_MAX_PAGES).contains(&ring.pages)
            || ring.page == 0
            || !ring.page.is_multiple_of(16)
            || ring.pages * ring.page + GL_MAX_K / 2 * 4 + GL_STATIC_SMEM
                > self.ops.gpu.caps.max_smem_per_cta
        {
            return Err(Error::InvalidArgument(format!(
                "grid layers: a ring of {} pages of {} bytes (1..{GL_MAX_PAGES} pages, bytes a \
                 multiple of 16, in shared memory beside x and the table)",
                ring.pages, ring.page
            )));
        }
        if ops
            .iter()
            .any(|&(_, k)| k > GL_MAX_K || !k.is_multiple_of(32))
        {
            return Err(Error::InvalidArgument(format!(
                "grid layers: every K a multiple of 32 up to {GL_MAX_K}"
            )));
        }
        // kernels/bench.cu, gl_slice_bytes: a CTA's rows x K x 17/32 bytes, in 16s.
        let slice =
            |rows: usize, k: usize| (rows.div_ceil(grid) * k * 17 / 32).next_multiple_of(16);
        let per_layer: usize = ops.iter().map(|&(r, k)| slice(r, k) * grid).sum();
        let pattern = random_bytes(64 << 20, 13);
        let weights: Vec<u8> = pattern
            .iter()
            .copied()
            .cycle()
            .take(per_layer * layers)
            .collect();
        let w = self.ops.gpu.upload(&weights)?;
        let (x_a, x_b) = (
            self.ops.gpu.zeros::<u32>(handover.words(GL_MAX_K))?,
            self.ops.gpu.zeros::<u32>(handover.words(GL_MAX_K))?,
        );
        let (bar, failed) = (self.ops.gpu.zeros::<u32>(2)?, self.ops.gpu.zeros::<u32>(1)?);
        let args = GridLayerArgs {
            w: self.ops.gpu.ptr(&w),
            x_a: self.ops.gpu.ptr(&x_a),
            x_b: self.ops.gpu.ptr(&x_b),
            bar: self.ops.gpu.ptr(&bar),
            failed: self.ops.gpu.ptr(&failed),
            ops_rows: ops.map(|(r, _)| r as i32),
            ops_k: ops.map(|(_, k)| k as i32),
            layers: i32::try_from(layers)
                .map_err(|_| Error::InvalidArgument(format!("{layers} grid layers")))?,
            handover: handover as i32,
            walk: walk as i32,
            page: ring.page as i32,
            pages: ring.pages as i32,
            _pad: 0,
        };
        // The pages and x as f16 pairs (the table is static shared memory).
        let smem = ring.pages * ring.page + GL_MAX_K / 2 * 4;
        allow_dynamic_smem(&self.ops.gpu, std::slice::from_ref(&self.grid_layers), smem)?;
        let cfg = LaunchConfig {
            grid_dim: (self.ops.sms, 1, 1),
            block_dim: (GL_THREADS + 32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let per_launch = self.time_rotated(
            1,
            |_| launch!(self.ops.gpu, &self.grid_layers, cfg, cooperative; args),
        )?;
        match self.ops.gpu.download(&failed, 1)?[0] {
            0 => Ok(per_launch / layers.max(1) as f64),
            2 => Err(Error::Unsupported(
                "grid layers: bulk copies need sm_90".into(),
            )),
            _ => Err(Error::Cuda("grid layers: a page's wait gave up".into())),
        }
    }

    /// Times one GEMV-family kernel on random weights: `kind` is "qkv" (rows = q+k+v rows,
    /// split 1/8th each for k and v as in GQA 16/2), "swiglu" (gate and up of `rows`),
    /// "residual" (`y += W x`) or "plain" (`y = W x`).
    pub fn gemv(&self, name: &str, kind: &str, rows: &[usize], cols: usize) -> Result<Timing> {
        self.gemv_in(name, kind, rows, cols, false)
    }

    /// [`Self::gemv`] with `l2_hot`: every launch of the graph reads the same copy of the
    /// weights, so those that fit the L2 come from it (what the kernel would take if its
    /// weights were prefetched into L2 ahead of it); else rotated copies, from HBM.
    pub fn gemv_in(
        &self,
        name: &str,
        kind: &str,
        rows: &[usize],
        cols: usize,
        l2_hot: bool,
    ) -> Result<Timing> {
        let total_rows: usize = rows.iter().sum();
        let mats_per_copy = if kind == "swiglu" { 2 } else { rows.len() };
        let weight_bytes = match kind {
            "swiglu" => 2 * stored_bytes(rows[0], cols),
            _ => rows.iter().map(|r| stored_bytes(*r, cols)).sum(),
        };
        let out_rows = if kind == "swiglu" {
            rows[0]
        } else {
            total_rows
        };
        let io_bytes = cols * 4 + out_rows * 4 * if kind == "residual" { 2 } else { 1 };
        let bytes = weight_bytes + io_bytes + if kind == "qkv" { total_rows * 4 } else { 0 };
        let copies = Self::copies(weight_bytes);
        let distinct = if l2_hot { 1 } else { copies };
        let mut mats = Vec::with_capacity(distinct * mats_per_copy);
        for c in 0..distinct {
            for (j, r) in rows.iter().cycle().take(mats_per_copy).enumerate() {
                mats.push(RandomMatrix::new(
                    &self.ops.gpu,
                    *r,
                    cols,
                    (c * 8 + j) as u64 + 11,
                )?);
            }
        }
        let x = self.ops.gpu.upload(&random_f32(cols, 3, -1.0, 1.0))?;
        let y = self
            .ops
            .gpu
            .upload(&random_f32(total_rows.max(out_rows), 4, -1.0, 1.0))?;
        let bias = rows
            .iter()
            .map(|r| self.ops.gpu.upload(&random_f32(*r, 5, -0.5, 0.5)))
            .collect::<Result<Vec<_>>>()?;
        let (xp, yp) = (self.ops.gpu.ptr(&x), self.ops.gpu.ptr(&y));
        let gpu = &self.ops.gpu;
        let median_us = self.time_rotated(copies, |c| {
            let c = c % distinct;
            let m = &mats[c * mats_per_copy..(c + 1) * mats_per_copy];
            match kind {
                "qkv" => {
                    let args = QkvArgs {
                        m: [0, 1, 2].map(|i| m[i].as_ref(gpu)),
                        bias: [0, 1, 2].map(|i| gpu.ptr(&bias[i])),
                        rows: [0, 1, 2].map(|i| rows[i] as i32),
                    };
                    self.ops.qkv(args, cols, Input::raw(xp), yp).map(|_| ())
                }
                "swiglu" => self.ops.swiglu(
                    m[0].as_ref(gpu),
                    m[1].as_ref(gpu),
                    rows[0],
                    cols,
                    Input::raw(xp),
                    yp,
                    false,
                ),
                _ => self
                    .ops
                    .gemv(
                        m[0].as_ref(gpu),
                        rows[0],
                        cols,
                        Input::raw(xp),
                        yp,
                        kind == "residual",
                        0,
                        0,
                    )
                    .map(|_| ()),
            }
        })?;
        Ok(Timing {
            name: name.into(),
            bytes,
            median_us,
            floor_us: self.floor_us(bytes)?,
        })
    }

    /// Times the tensor-core GEMM (`y = W x`, plain store) for `rows` x `k` weights over `n`
    /// columns on random data, x in f16 as a prefill chunk has it; returns the timing and
    /// TFLOP/s (2 rows k n per launch).
    pub fn gemm(&self, name: &str, rows: usize, k: usize, n: usize) -> Result<(Timing, f64)> {
        let weight_bytes = stored_bytes(rows, k);
        let copies = Self::copies(weight_bytes);
        let mats = (0..copies)
            .map(|c| RandomMatrix::new(&self.ops.gpu, rows, k, c as u64 + 101))
            .collect::<Result<Vec<_>>>()?;
        let x16: Vec<u16> = random_f32(n * k, 3, -1.0, 1.0)
            .iter()
            .map(|v| half::f16::from_f32(*v).to_bits())
            .collect();
        let x16 = self.ops.gpu.upload(&x16)?;
        let y = self.ops.gpu.zeros::<f32>(n * rows)?;
        let gpu = &self.ops.gpu;
        let (xp, yp) = (gpu.ptr(&x16), gpu.ptr(&y));
        let median_us = self.time_rotated(copies, |c| {
            let m = [GemmMatrix {
                m: mats[c].as_ref(gpu),
                rows,
                bias: 0,
            }];
            self.ops
                .gemm(Epilogue::Store, &m, k, xp, n, yp, rows, 0, true)
        })?;
        let bytes = weight_bytes + n * k * 2 + n * rows * 4;
        let tflops = 2.0 * (rows * k * n) as f64 / median_us / 1e6;
        let timing = Timing {
            name: name.into(),
            bytes,
            median_us,
            floor_us: self.floor_us(bytes)?,
        };
        Ok((timing, tflops))
    }

    /// The greedy argmax kernel's pick over `logits` (state's next_token), as the decode step
    /// launches it (a CTA per SM, the last to finish picking among their winners).
    pub fn argmax(&self, logits: &[f32]) -> Result<u32> {
        let gpu = &self.ops.gpu;
        let values = gpu.upload(logits)?;
        let state = gpu.zeros::<i32>(state::LEN)?;
        let scratch = gpu.zeros::<i32>(ARGMAX_SCRATCH)?;
        let (ptr, n) = (gpu.ptr(&values), logits.len() as i32);
        let (st, sc) = (gpu.ptr(&state), gpu.ptr(&scratch));
        launch!(gpu, &self.ops.k.argmax_logits, self.ops.argmax_launch(); ptr, n, st, sc)?;
        Ok(gpu.download(&state, state::LEN)?[state::NEXT_TOKEN] as u32)
    }

    /// Times attention (flash-decode + merge) of one layer at `valid_len`, rotating over the
    /// layers of a KV cache of `spec` with `max_seq` slots (random bf16 contents).
    pub fn attention(&self, spec: &ArchSpec, max_seq: usize, valid_len: usize) -> Result<Timing> {
        let s = spec;
        let layer_elems = kv_stride(max_seq) * s.kv_dim();
        let layers = s.n_layers;
        let kv_host: Vec<u16> = random_f32(layers * layer_elems, 9, -1.0, 1.0)
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_bits())
            .collect();
        let (k_cache, v_cache) = (
            self.ops.gpu.upload(&kv_host)?,
            self.ops.gpu.upload(&kv_host)?,
        );
        let qkv = self
            .ops
            .gpu
            .upload(&random_f32(s.qkv_rows(), 10, -1.0, 1.0))?;
        let rope = RopeTable::new(max_seq, s.head_dim, s.rope_theta, &RopeScaling::None)?;
        let (cos, sin) = (
            self.ops.gpu.upload(&rope.cos)?,
            self.ops.gpu.upload(&rope.sin)?,
        );
        let mut state_host = [0i32; state::LEN];
        state_host[state::POSITION] = valid_len as i32 - 1;
        let state = self.ops.gpu.upload(&state_host)?;
        let partials = attn_partials(max_seq);
        let part_acc = self
            .ops
            .gpu
            .zeros::<f32>(s.n_q_heads * partials * s.head_dim)?;
        let part_ml = self.ops.gpu.zeros::<f32>(s.n_q_heads * partials * 2)?;
        let out = self.ops.gpu.zeros::<f32>(s.q_dim())?;
        // q/k/v in one part: a zero second part where the kernels add one (DV2_QKV_KHALVES).
        let qkv2 = self.ops.gpu.zeros::<f32>(s.qkv_rows())?;
        let counts = self.ops.gpu.zeros::<i32>(super::ops::attn_counts_len(s))?;
        let gpu = &self.ops.gpu;
        let base = AttnArgs {
            qkv: gpu.ptr(&qkv),
            k_cache: gpu.ptr(&k_cache),
            v_cache: gpu.ptr(&v_cache),
            rope_cos: gpu.ptr(&cos),
            rope_sin: gpu.ptr(&sin),
            state: gpu.ptr(&state),
            part_acc: gpu.ptr(&part_acc),
            part_ml: gpu.ptr(&part_ml),
            n_q: s.n_q_heads as i32,
            n_kv: s.n_kv_heads as i32,
            head_dim: s.head_dim as i32,
            max_seq: max_seq as i32,
            n_splits: 0,
            scale: 1.0 / (s.head_dim as f32).sqrt(),
            heads_per_cta: 0,
            qkv2: gpu.ptr(&qkv2),
        };
        let (layer_bytes, out_ptr, counts_ptr) =
            (2 * layer_elems as u64, gpu.ptr(&out), gpu.ptr(&counts));
        let median_us = self.time_rotated(layers, |l| {
            let args = AttnArgs {
                k_cache: base.k_cache + l as u64 * layer_bytes,
                v_cache: base.v_cache + l as u64 * layer_bytes,
                ..base
            };
            self.ops.attention(args, out_ptr, counts_ptr)
        })?;
        let bytes = 2 * valid_len * s.kv_dim() * 2 + s.qkv_rows() * 4 + s.q_dim() * 4;
        Ok(Timing {
            name: format!("attention, valid_len {valid_len}"),
            bytes,
            median_us,
            floor_us: self.floor_us(bytes)?,
        })
    }
}

/// grid_phases' weight of `row`, column `k` (kernels/bench.cu, phase_weight).
fn phase_weight(row: usize, k: usize, n: usize) -> f32 {
    let mut h = ((row * n + k) as u32).wrapping_mul(0x9E37_79B1);
    h ^= h >> 15;
    h = h.wrapping_mul(0x85EB_CA77);
    h ^= h >> 13;
    ((h & 1023) as i32 - 512) as f32 / 16384.0
}

/// What `rounds` rounds of grid_phases leave: x <- tanh(W x), W by [`phase_weight`].
fn grid_phases_on_cpu(x: &[f32], rounds: usize) -> Vec<f32> {
    let n = x.len();
    (0..rounds).fold(x.to_vec(), |x, _| {
        (0..n)
            .map(|row| {
                let sum: f32 = (0..n).map(|k| phase_weight(row, k, n) * x[k]).sum();
                sum.tanh()
            })
            .collect()
    })
}
