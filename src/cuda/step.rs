//! The CUDA backend: decode state, KV cache and activation arena on the device, and the
//! sequence of one step. Everything is allocated in `new`; a step allocates nothing, reads
//! nothing back and never synchronises with the host. The step is captured once into a CUDA
//! graph (`DV2_GRAPH=0`: eager launches, for comparison).
//!
//! A prompt goes through in chunks of up to `chunk` tokens: per layer an RMSNorm, the q/k/v
//! GEMM, RoPE and the KV write, causal attention over the cached prefix and the chunk, the o
//! GEMM with the residual, an RMSNorm, the gate/up GEMM with SwiGLU and the down GEMM with
//! the residual (kernels/prefill.cu); logits only for the prompt's last token.
//! `DV2_PREFILL=n1` feeds the prompt one token at a time through the decode step instead.

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaEvent, CudaGraph, CudaSlice, LaunchConfig};

use super::budget::{self, kv_stride};
use super::device::{driver_error, Gpu};
use super::kernels::state;
use super::ops::{
    attn_partials, one_cta, AttnArgs, Epilogue, GemmMatrix, Input, LogitsHead, Norm, Ops,
    PartialSums, PrefillAttnArgs, QkvArgs, ARGMAX_SCRATCH, MAX_PARTIAL_SUMS,
};
use super::weights::{self, DeviceMatrix, DeviceModel};
use crate::arch::ArchSpec;
use crate::config::Config;
use crate::engine::Backend;
use crate::error::{Error, Result};
use crate::model::HostModel;
use crate::rope::RopeTable;

/// bf16 bit pattern written into the KV guard slots (a NaN no kernel produces).
const KV_POISON: u16 = 0x7fa5;

/// Events recorded between kernel groups of one step.
pub struct StageMarks {
    start: CudaEvent,
    marks: Vec<(&'static str, CudaEvent)>,
}

impl StageMarks {
    fn new(gpu: &Gpu) -> Result<Self> {
        let start = timing_event(gpu)?;
        start
            .record(&gpu.stream)
            .map_err(driver_error("event record"))?;
        Ok(Self {
            start,
            marks: Vec::new(),
        })
    }

    fn record(&mut self, gpu: &Gpu, label: &'static str) -> Result<()> {
        let e = timing_event(gpu)?;
        e.record(&gpu.stream)
            .map_err(driver_error("event record"))?;
        self.marks.push((label, e));
        Ok(())
    }

    fn totals(&self) -> Result<Vec<(&'static str, f64)>> {
        let mut out: Vec<(&'static str, f64)> = Vec::new();
        let mut prev = &self.start;
        for (label, e) in &self.marks {
            let ms = prev.elapsed_ms(e).map_err(driver_error("event elapsed"))? as f64;
            match out.iter_mut().find(|(l, _)| l == label) {
                Some((_, t)) => *t += ms,
                None => out.push((label, ms)),
            }
            prev = e;
        }
        Ok(out)
    }
}

/// An event that records time (cudarc's default disables timing).
pub fn timing_event(gpu: &Gpu) -> Result<CudaEvent> {
    gpu.ctx
        .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(driver_error("event create"))
}

/// The captured step. CUDA graph handles are not internally synchronised but may be used
/// from any thread when calls are serialised.
struct StepGraph(CudaGraph);

// SAFETY: the graph is only reached through `&mut CudaBackend` (one thread at a time), which
// serialises every call on it, as the CUDA graph thread-safety rules require.
unsafe impl Send for StepGraph {}

/// Prompt tokens per prefill chunk when the options leave it open (`DV2_PREFILL_CHUNK`
/// overrides it).
pub const DEFAULT_PREFILL_CHUNK: usize = 1024;
/// The largest chunk the arena may be sized for.
pub const MAX_PREFILL_CHUNK: usize = 1024;

/// Activations (token-major, one row per token of a prefill chunk; the decode step uses
/// row 0) and logits, allocated once at load.
struct Arena {
    x: CudaSlice<f32>,
    xn: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    act: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    part_acc: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    /// Partial sums of squares of x left by the kernel that last wrote it (DV2_FUSE_RMS).
    sums: CudaSlice<f32>,
    prompt: CudaSlice<i32>,
    /// The ids of the steps of one step_n call, appended by commit_step.
    ring: CudaSlice<i32>,
    /// argmax_logits' arrival count (zero between launches) and its CTAs' (value, index).
    argmax: CudaSlice<i32>,
    /// A zero second part of q/k/v for the attention where q/k/v ran in one
    /// (the `DV2_QKV_KHALVES` kernels add one).
    qkv_zeros: CudaSlice<f32>,
}

/// Device addresses of the arena's activation buffers (row 0 is the decode step's).
struct Activations {
    x: u64,
    xn: u64,
    qkv: u64,
    attn: u64,
    act: u64,
}

pub struct CudaBackend {
    ops: Ops,
    spec: ArchSpec,
    max_seq: usize,
    eos: i32,
    model: DeviceModel,
    state: CudaSlice<i32>,
    k_cache: CudaSlice<u16>,
    v_cache: CudaSlice<u16>,
    rope_cos: CudaSlice<f32>,
    rope_sin: CudaSlice<f32>,
    arena: Arena,
    /// One greedy step (forward + commit) captured at load; None runs it eagerly.
    graph: Option<StepGraph>,
    /// Prompt tokens per prefill chunk; 0: one token at a time through the decode step.
    chunk: usize,
    /// Host time of the eager probe step and the graph capture at load (0 without a graph).
    warmup_ms: f64,
}

/// The prefill chunk: 0 (the token-at-a-time path) under `DV2_PREFILL=n1` or when no prefill
/// attention kernel takes the model's shape, else [`chunk_size`] of `requested` and
/// `DV2_PREFILL_CHUNK`.
pub fn prefill_chunk(ops: &Ops, s: &ArchSpec, max_seq: usize, requested: usize) -> Result<usize> {
    if ops.cfg.prefill_by_steps || !ops.attn_prefill_fits(s.n_q_heads / s.n_kv_heads, s.head_dim) {
        return Ok(0);
    }
    chunk_size(requested, ops.cfg.prefill_chunk.as_deref(), max_seq)
}

/// Tokens per chunk: `requested`, or when 0 the environment's value, or the default; 1 to
/// MAX_PREFILL_CHUNK, capped by max_seq.
fn chunk_size(requested: usize, env: Option<&str>, max_seq: usize) -> Result<usize> {
    let chunk = match (requested, env) {
        (0, Some(v)) => v
            .parse::<usize>()
            .map_err(|_| Error::InvalidArgument(format!("DV2_PREFILL_CHUNK={v}")))?,
        (0, None) => DEFAULT_PREFILL_CHUNK,
        (n, _) => n,
    };
    if !(1..=MAX_PREFILL_CHUNK).contains(&chunk) {
        return Err(Error::InvalidArgument(format!(
            "prefill chunk {chunk} (1 to {MAX_PREFILL_CHUNK})"
        )));
    }
    Ok(chunk.min(max_seq))
}

impl CudaBackend {
    /// Uploads the model and allocates everything; with `graph`, runs one eager step as a
    /// probe and captures the step into a CUDA graph. `chunk`: see [`prefill_chunk`].
    pub fn new(
        host: &HostModel,
        max_seq: usize,
        eos: Option<u32>,
        device: usize,
        graph: bool,
        chunk: usize,
    ) -> Result<Self> {
        let s = host.spec;
        let cfg = Config::from_env();
        let gpu = Gpu::open(device, cfg.pdl)?;
        let (free, total) = gpu.memory()?;
        let mut ops = Ops::new(gpu, cfg)?;
        let chunk = prefill_chunk(&ops, &s, max_seq, chunk)?;
        let rows = chunk.max(1);
        budget::estimate(host, max_seq, chunk).check(free, total)?;
        ops.fit(&s, max_seq)?;
        let gpu = &ops.gpu;
        let model = weights::upload(gpu, host)?;
        let rope = RopeTable::new(max_seq, s.head_dim, s.rope_theta)?;
        let partials = attn_partials(max_seq);
        // Every slot starts poisoned: the guard slots stay so (checked by kv_guard_intact),
        // and a kernel that read an unwritten slot would turn the logits into NaN.
        let poison = vec![KV_POISON; s.n_layers * kv_stride(max_seq) * s.kv_dim()];
        let arena = Arena {
            x: gpu.zeros(rows * s.hidden)?,
            xn: gpu.zeros(rows * s.hidden)?,
            // Two rows at least: q/k/v's K halves (DV2_QKV_KHALVES) in the decode step.
            qkv: gpu.zeros(rows.max(2) * s.qkv_rows())?,
            attn: gpu.zeros(rows * s.hidden)?,
            act: gpu.zeros(rows * s.intermediate)?,
            logits: gpu.zeros(s.vocab)?,
            part_acc: gpu.zeros(s.n_q_heads * partials * s.head_dim)?,
            part_ml: gpu.zeros(s.n_q_heads * partials * 2)?,
            sums: gpu.zeros(MAX_PARTIAL_SUMS)?,
            prompt: gpu.zeros(max_seq)?,
            ring: gpu.zeros(max_seq)?,
            argmax: gpu.zeros(ARGMAX_SCRATCH)?,
            qkv_zeros: gpu.zeros(s.qkv_rows())?,
        };
        let mut backend = Self {
            k_cache: gpu.upload(&poison)?,
            v_cache: gpu.upload(&poison)?,
            rope_cos: gpu.upload(&rope.cos)?,
            rope_sin: gpu.upload(&rope.sin)?,
            state: gpu.zeros(state::LEN)?,
            arena,
            spec: s,
            max_seq,
            eos: eos.map_or(-1, |e| e as i32),
            model,
            graph: None,
            chunk,
            warmup_ms: 0.0,
            ops,
        };
        backend.ops.gpu.sync()?;
        if graph {
            let started = std::time::Instant::now();
            backend.capture()?;
            backend.warmup_ms = started.elapsed().as_secs_f64() * 1e3;
        }
        Ok(backend)
    }

    /// Runs one eager step (so any launch problem surfaces outside a capture), then captures
    /// the step into a graph. The probe's KV write lands in slot 0, which the next request
    /// overwrites before reading; the state is reset afterwards.
    fn capture(&mut self) -> Result<()> {
        self.record_step()?;
        self.ops.gpu.sync()?;
        let stream = self.ops.gpu.stream.clone();
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(driver_error("begin capture"))?;
        let recorded = self.record_step();
        let graph = stream
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(driver_error("end capture"));
        recorded?;
        let graph = graph?.ok_or_else(|| Error::Cuda("stream capture produced no graph".into()))?;
        graph.upload().map_err(driver_error("graph upload"))?;
        self.graph = Some(StepGraph(graph));
        self.reset()
    }

    /// Enqueues one greedy step: forward with logits, then the commit (in lm_head's kernel
    /// where it takes the argmax, `DV2_LOGITS_ARGMAX`, else commit_step).
    fn record_step(&self) -> Result<()> {
        if self.forward_marked(true, true, &mut None)? {
            return Ok(());
        }
        let (state, eos, ring) = (self.ptr(&self.state), self.eos, self.ptr(&self.arena.ring));
        launch!(self.ops.gpu, &self.ops.k.commit_step, one_cta(1); state, eos, ring)
    }

    fn ptr<T>(&self, buf: &CudaSlice<T>) -> u64 {
        self.ops.gpu.ptr(buf)
    }

    /// Device addresses of the activation buffers.
    fn activations(&self) -> Activations {
        let a = &self.arena;
        Activations {
            x: self.ptr(&a.x),
            xn: self.ptr(&a.xn),
            qkv: self.ptr(&a.qkv),
            attn: self.ptr(&a.attn),
            act: self.ptr(&a.act),
        }
    }

    /// The input `x` RMS-normed with weights `w`: folded into the GEMV's x load when x's
    /// producer left `sums`, else by the RMSNorm kernel into `xn`.
    fn normed(&self, x: u64, w: &CudaSlice<u16>, xn: u64, sums: Option<PartialSums>) -> Input {
        Input {
            x,
            norm: Some(Norm {
                w: self.ptr(w),
                eps: self.spec.rms_eps,
                scratch: xn,
                sums,
            }),
            f16: false,
        }
    }

    /// One forward pass for the token in the state buffer at its position: KV slot written;
    /// with `logits`, the logits and next_token too.
    fn forward(&self, logits: bool) -> Result<()> {
        self.forward_marked(logits, false, &mut None).map(|_| ())
    }

    /// [`Self::forward`], recording an event after each group of kernels into `marks` when
    /// given (the per-stage split of the bench).
    /// With `commit` (and `logits`), the step's commit too where lm_head's kernel can take it:
    /// returns whether it did.
    fn forward_marked(
        &self,
        logits: bool,
        commit: bool,
        marks: &mut Option<&mut StageMarks>,
    ) -> Result<bool> {
        let gpu = &self.ops.gpu;
        let mut mark = |label: &'static str| -> Result<()> {
            match marks {
                Some(m) => m.record(gpu, label),
                None => Ok(()),
            }
        };
        let (s, a, ops) = (&self.spec, &self.arena, &self.ops);
        let Activations {
            x,
            xn,
            qkv,
            attn,
            act,
        } = self.activations();
        let state = self.ptr(&self.state);
        let (hidden, vocab) = (s.hidden as i32, s.vocab as i32);
        let embed = self.model.embed.as_ref(gpu);
        // Each writer of x leaves its partial sums of squares for the next RMSNorm, which the
        // consuming GEMV then folds into its x load (DV2_FUSE_RMS; no RMSNorm kernels).
        let ss_out = if ops.producer_sums() {
            self.ptr(&a.sums)
        } else {
            0
        };
        let sums = |parts: usize| (ss_out != 0).then_some(PartialSums { ptr: ss_out, parts });
        // x += W input (the residual add), with the partial sums for the next norm.
        let residual = |w: &DeviceMatrix, k: usize, input: Input| {
            let parts = ops.gemv(w.as_ref(gpu), s.hidden, k, input, x, true, 0, ss_out)?;
            Ok::<_, Error>(sums(parts))
        };
        launch!(gpu, &ops.k.embed_row, one_cta(256); state, embed, x, hidden, vocab, ss_out)?;
        let mut x_sums = sums(1);
        mark("embed")?;
        let layer_bytes = (2 * kv_stride(self.max_seq) * s.kv_dim()) as u64;
        for (l, layer) in self.model.layers.iter().enumerate() {
            let args = QkvArgs {
                m: [0, 1, 2].map(|i| layer.qkv[i].as_ref(gpu)),
                bias: [0, 1, 2].map(|i| layer.qkv_bias[i].as_ref().map_or(0, |b| self.ptr(b))),
                rows: [0, 1, 2].map(|i| layer.qkv[i].rows as i32),
            };
            let halves = ops.qkv(
                args,
                s.hidden,
                self.normed(x, &layer.attn_norm, xn, x_sums),
                qkv,
            )?;
            mark("attn_norm + qkv")?;
            let attn_args = AttnArgs {
                qkv,
                k_cache: self.ptr(&self.k_cache) + l as u64 * layer_bytes,
                v_cache: self.ptr(&self.v_cache) + l as u64 * layer_bytes,
                rope_cos: self.ptr(&self.rope_cos),
                rope_sin: self.ptr(&self.rope_sin),
                state,
                part_acc: self.ptr(&a.part_acc),
                part_ml: self.ptr(&a.part_ml),
                n_q: s.n_q_heads as i32,
                n_kv: s.n_kv_heads as i32,
                head_dim: s.head_dim as i32,
                max_seq: self.max_seq as i32,
                n_splits: 0,
                scale: 1.0 / (s.head_dim as f32).sqrt(),
                heads_per_cta: 0,
                qkv2: if halves {
                    qkv + 4 * s.qkv_rows() as u64
                } else {
                    self.ptr(&a.qkv_zeros)
                },
            };
            ops.attention(attn_args, attn)?;
            mark("attention + merge")?;
            x_sums = residual(&layer.o, s.hidden, Input::raw(attn))?;
            mark("o_proj (+residual)")?;
            let input = self.normed(x, &layer.ffn_norm, xn, x_sums);
            let act_f16 = ops.ffn_act_f16(s.intermediate, s.hidden);
            ops.swiglu(
                layer.gate.as_ref(gpu),
                layer.up.as_ref(gpu),
                s.intermediate,
                s.hidden,
                input,
                act,
                act_f16,
            )?;
            mark("ffn_norm + gate/up SwiGLU")?;
            let act_in = Input {
                f16: act_f16,
                ..Input::raw(act)
            };
            x_sums = residual(&layer.down, s.intermediate, act_in)?;
            mark("down (+residual)")?;
        }
        if logits {
            // Replays after the request finished must not overwrite the last logits.
            let finished = state + 4 * state::FINISHED as u64;
            let committed = self.logits_of(x, finished, x_sums, commit)?;
            mark("final_norm + lm_head + argmax")?;
            return Ok(committed);
        }
        Ok(false)
    }

    /// Final RMSNorm of the activation row at `x` (`sums`: its producer's partial sums of
    /// squares, see [`Self::normed`]), lm_head into the logits, argmax into next_token; the
    /// lm_head is skipped on the device while `*skip_if != 0` (0: never).
    fn logits_of(
        &self,
        x: u64,
        skip_if: u64,
        sums: Option<PartialSums>,
        commit: bool,
    ) -> Result<bool> {
        let (s, ops) = (&self.spec, &self.ops);
        let (out, xn, state) = (
            self.ptr(&self.arena.logits),
            self.ptr(&self.arena.xn),
            self.ptr(&self.state),
        );
        let input = self.normed(x, &self.model.final_norm, xn, sums);
        let lm_head = self.model.lm_head().as_ref(&ops.gpu);
        let (vocab, scratch) = (s.vocab as i32, self.ptr(&self.arena.argmax));
        let ring = if commit {
            self.ptr(&self.arena.ring)
        } else {
            0
        };
        let head = LogitsHead {
            state,
            scratch,
            eos: self.eos,
            ring,
        };
        if ops.logits_argmax(lm_head, s.vocab, s.hidden, input, out, skip_if, head)? {
            return Ok(commit);
        }
        ops.gemv(lm_head, s.vocab, s.hidden, input, out, false, skip_if, 0)?;
        launch!(ops.gpu, &ops.k.argmax_logits, ops.argmax_launch(); out, vocab, state, scratch)?;
        Ok(false)
    }

    /// `DV2_CTA_TIMELINE=1` at load (kernels/decode.cu, CTA_TIMELINE): runs `steps` decode steps
    /// as [`Backend::step_n`] does, the recording on for the last, and returns its records:
    /// [grid id, kind << 56 | SM << 48 | CTAs << 24 | CTA, t0, t1] in globaltimer ns, kind 0 a
    /// CTA's PDL wait (t0 before it, t1 after), kind 1 a GEMV or attention CTA's end (t0), kind 2
    /// its start (t0).
    pub fn cta_timeline(&mut self, steps: usize) -> Result<Vec<[u64; 4]>> {
        if !self.ops.cfg.cta_timeline {
            return Err(Error::Unsupported(
                "the CTA timeline needs DV2_CTA_TIMELINE=1 when the backend loads".into(),
            ));
        }
        let mut out = vec![0u32; steps.saturating_sub(1)];
        self.step_n(&mut out)?;
        let stream = self.ops.gpu.stream.clone();
        let module = self.ops.k.module.clone();
        let global = |name: &str| {
            module
                .get_global(name, &stream)
                .map_err(driver_error("timeline global"))
        };
        stream
            .memcpy_htod(&[0u8; 4], &mut global("dv2_timeline_n")?)
            .map_err(driver_error("timeline reset"))?;
        self.step_n(&mut [0u32])?;
        let mut n = [0u8; 4];
        stream
            .memcpy_dtoh(&global("dv2_timeline_n")?, &mut n)
            .map_err(driver_error("timeline count"))?;
        let records = global("dv2_timeline")?;
        let mut bytes = vec![0u8; records.len()];
        stream
            .memcpy_dtoh(&records, &mut bytes)
            .map_err(driver_error("timeline records"))?;
        self.ops.gpu.sync()?;
        let n = (u32::from_le_bytes(n) as usize).min(bytes.len() / 32);
        Ok(bytes[..32 * n]
            .chunks_exact(32)
            .map(|r| {
                std::array::from_fn(|i| u64::from_le_bytes(r[8 * i..8 * i + 8].try_into().unwrap()))
            })
            .collect())
    }

    /// Runs one eager greedy step with an event after each kernel group; returns the time of
    /// each stage summed over layers, in ms, in first-seen order. Advances the state like
    /// step().
    pub fn profile_step(&mut self) -> Result<Vec<(&'static str, f64)>> {
        let mut marks = StageMarks::new(&self.ops.gpu)?;
        self.forward_marked(true, false, &mut Some(&mut marks))?;
        let (state, eos, ring) = (self.ptr(&self.state), self.eos, self.ptr(&self.arena.ring));
        launch!(self.ops.gpu, &self.ops.k.commit_step, one_cta(1); state, eos, ring)?;
        marks.record(&self.ops.gpu, "commit")?;
        self.ops.gpu.sync()?;
        marks.totals()
    }

    /// The uploaded prompt of `len` ids, one decode forward per token (`DV2_PREFILL=n1`).
    fn prefill_by_steps(&self, len: usize) -> Result<()> {
        let (state, prompt) = (self.ptr(&self.state), self.ptr(&self.arena.prompt));
        for i in 0..len {
            let i32_i = i as i32;
            launch!(self.ops.gpu, &self.ops.k.load_token, one_cta(1); state, prompt, i32_i)?;
            self.forward(i + 1 == len)?;
            launch!(self.ops.gpu, &self.ops.k.advance, one_cta(1); state)?;
        }
        Ok(())
    }

    /// Prompt ids `start .. start + n` (uploaded) as one chunk at the state's position: every
    /// layer's KV slots written; with `last`, the logits and next_token of its last token.
    fn prefill_chunk(&self, start: usize, n: usize, last: bool) -> Result<()> {
        let gpu = &self.ops.gpu;
        let (s, a, ops) = (&self.spec, &self.arena, &self.ops);
        let Activations {
            x,
            xn,
            qkv,
            attn,
            act,
        } = self.activations();
        let state = self.ptr(&self.state);
        let ids = self.ptr(&a.prompt) + 4 * start as u64;
        let (hidden, vocab, n_i) = (s.hidden as i32, s.vocab as i32, n as i32);
        let embed = self.model.embed.as_ref(gpu);
        // The GEMMs' inputs (normed rows, attention output, SwiGLU output) are written as f16
        // by their producers, which the GEMM reads as is (docs/lab.md, c2ba752).
        let rows = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            ..one_cta(256)
        };
        launch!(gpu, &ops.k.embed_rows, rows; ids, embed, x, hidden, vocab)?;
        let layer_bytes = (2 * kv_stride(self.max_seq) * s.kv_dim()) as u64;
        let matrix = |m: &super::weights::DeviceMatrix, bias: u64| GemmMatrix {
            m: m.as_ref(gpu),
            rows: m.rows,
            bias,
        };
        for (l, layer) in self.model.layers.iter().enumerate() {
            let (k_cache, v_cache) = (
                self.ptr(&self.k_cache) + l as u64 * layer_bytes,
                self.ptr(&self.v_cache) + l as u64 * layer_bytes,
            );
            // In the last layer of the prompt's last chunk only the last token's output is
            // used (every token's K and V are in the cache once RoPE ran): attention, o and
            // the FFN run on that one row (`DV2_PREFILL_TAIL=0`: on all of them).
            let first = if last && ops.cfg.prefill_tail && l + 1 == s.n_layers {
                n - 1
            } else {
                0
            };
            let m = n - first;
            let x_m = x + (first * s.hidden * 4) as u64;
            ops.rms_rows(
                x,
                self.ptr(&layer.attn_norm),
                xn,
                s.hidden,
                s.rms_eps,
                n,
                true,
            )?;
            let qkv_mats = [0, 1, 2].map(|i| {
                let bias = layer.qkv_bias[i].as_ref().map_or(0, |b| self.ptr(b));
                matrix(&layer.qkv[i], bias)
            });
            let ld = s.qkv_rows();
            ops.gemm(
                Epilogue::Store,
                &qkv_mats,
                s.hidden,
                xn,
                n,
                qkv,
                ld,
                0,
                true,
            )?;
            let (cos, sin, ld_i) = (
                self.ptr(&self.rope_cos),
                self.ptr(&self.rope_sin),
                ld as i32,
            );
            let (n_q, n_kv, hd) = (s.n_q_heads as i32, s.n_kv_heads as i32, s.head_dim as i32);
            launch!(gpu, &ops.k.rope_kv_rows, rows; qkv, k_cache, v_cache, cos, sin, state, ld_i, n_q, n_kv, hd)?;
            ops.attn_prefill(PrefillAttnArgs {
                qkv: qkv + (first * ld * 4) as u64,
                k_cache,
                v_cache,
                state,
                out: attn,
                n: m as i32,
                ld: ld_i,
                n_q,
                n_kv,
                head_dim: hd,
                qb: 0,
                scale: 1.0 / (s.head_dim as f32).sqrt(),
                out_f16: 1,
                first: first as i32,
            })?;
            let o = [matrix(&layer.o, 0)];
            ops.gemm(
                Epilogue::Accumulate,
                &o,
                s.hidden,
                attn,
                m,
                x_m,
                s.hidden,
                0,
                true,
            )?;
            ops.rms_rows(
                x_m,
                self.ptr(&layer.ffn_norm),
                xn,
                s.hidden,
                s.rms_eps,
                m,
                true,
            )?;
            let gate_up = [matrix(&layer.gate, 0), matrix(&layer.up, 0)];
            let inter = s.intermediate;
            ops.gemm(
                Epilogue::Swiglu,
                &gate_up,
                s.hidden,
                xn,
                m,
                act,
                inter,
                0,
                true,
            )?;
            let down = [matrix(&layer.down, 0)];
            ops.gemm(
                Epilogue::Accumulate,
                &down,
                inter,
                act,
                m,
                x_m,
                s.hidden,
                0,
                true,
            )?;
        }
        if last {
            self.logits_of(x + ((n - 1) * s.hidden * 4) as u64, 0, None, false)?;
        }
        launch!(gpu, &ops.k.advance_by, one_cta(1); state, n_i)
    }

    fn read_state(&self) -> Result<[i32; state::LEN]> {
        let v = self.ops.gpu.download(&self.state, state::LEN)?;
        Ok(v.try_into().expect("state length"))
    }

    /// True while every KV guard slot (one past max_seq-1 in each layer) holds its poison:
    /// nothing was ever written past the last valid slot.
    pub fn kv_guard_intact(&self) -> Result<bool> {
        let s = &self.spec;
        let per_layer = kv_stride(self.max_seq) * s.kv_dim();
        for cache in [&self.k_cache, &self.v_cache] {
            let all = self.ops.gpu.download(cache, s.n_layers * per_layer)?;
            for l in 0..s.n_layers {
                let guard = &all[l * per_layer + self.max_seq * s.kv_dim()..(l + 1) * per_layer];
                if guard.iter().any(|v| *v != KV_POISON) {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn reset(&mut self) -> Result<()> {
        // position = valid_len = 0, finished = 0; the KV cache keeps its (dirty) contents.
        // argmax_logits' arrival count is zero after every completed launch; zeroed here too,
        // so that no interrupted step can leave the next one miscounting.
        let zeros = [0i32; state::LEN];
        self.ops
            .gpu
            .stream
            .memcpy_htod(&zeros, &mut self.state)
            .map_err(driver_error("state reset"))?;
        self.ops
            .gpu
            .stream
            .memcpy_htod(&zeros[..1], &mut self.arena.argmax.slice_mut(..1))
            .map_err(driver_error("argmax count reset"))?;
        self.ops.gpu.sync()
    }

    fn prefill(&mut self, ids: &[u32]) -> Result<()> {
        let ids: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        self.ops
            .gpu
            .stream
            .memcpy_htod(&ids, &mut self.arena.prompt.slice_mut(..ids.len()))
            .map_err(driver_error("prompt upload"))?;
        let state = self.ptr(&self.state);
        launch!(self.ops.gpu, &self.ops.k.begin_prefill, one_cta(1); state)?;
        if self.chunk == 0 {
            self.prefill_by_steps(ids.len())?;
        } else {
            for start in (0..ids.len()).step_by(self.chunk) {
                let n = self.chunk.min(ids.len() - start);
                self.prefill_chunk(start, n, start + n == ids.len())?;
            }
        }
        let eos = self.eos;
        launch!(self.ops.gpu, &self.ops.k.finish_prefill, one_cta(1); state, eos)?;
        self.ops.gpu.sync()
    }

    /// Enqueues `out.len()` steps (graph replays, or eager launches) with no host wait in
    /// between, then copies the step ring back once. Steps after the one that finished commit
    /// nothing on the device.
    fn step_n(&mut self, out: &mut [u32]) -> Result<usize> {
        let state = self.ptr(&self.state);
        launch!(self.ops.gpu, &self.ops.k.ring_reset, one_cta(1); state)?;
        for _ in 0..out.len() {
            match &self.graph {
                Some(g) => g.0.launch().map_err(driver_error("graph launch"))?,
                None => self.record_step()?,
            }
        }
        let st = self.read_state()?;
        let done = st[state::RING_COUNT] as usize;
        let ring = self.ops.gpu.download(&self.arena.ring, done)?;
        out.iter_mut()
            .zip(&ring)
            .for_each(|(o, id)| *o = *id as u32);
        Ok(done)
    }

    fn next_token(&mut self) -> Result<u32> {
        Ok(self.read_state()?[state::NEXT_TOKEN] as u32)
    }

    fn logits(&mut self, out: &mut [f32]) -> Result<()> {
        let v = self.ops.gpu.download(&self.arena.logits, self.spec.vocab)?;
        out.copy_from_slice(&v);
        Ok(())
    }

    fn position(&mut self) -> Result<usize> {
        let st = self.read_state()?;
        debug_assert_eq!(st[state::POSITION], st[state::VALID_LEN]);
        Ok(st[state::POSITION] as usize)
    }

    fn finished(&mut self) -> Result<bool> {
        Ok(self.read_state()?[state::FINISHED] != 0)
    }

    fn kv_guard_intact(&mut self) -> Result<bool> {
        CudaBackend::kv_guard_intact(self)
    }

    fn device_free_bytes(&mut self) -> Result<Option<usize>> {
        Ok(Some(self.ops.gpu.memory()?.0))
    }

    fn warmup_ms(&self) -> Option<f64> {
        Some(self.warmup_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_size_takes_the_option_then_the_environment_then_the_default() {
        assert_eq!(chunk_size(32, Some("64"), 2048).unwrap(), 32);
        assert_eq!(chunk_size(0, Some("64"), 2048).unwrap(), 64);
        assert_eq!(chunk_size(0, None, 4096).unwrap(), DEFAULT_PREFILL_CHUNK);
        assert_eq!(chunk_size(0, None, 16).unwrap(), 16, "capped by max_seq");
        for bad in [
            chunk_size(MAX_PREFILL_CHUNK + 1, None, 1 << 20),
            chunk_size(0, Some("0"), 64),
            chunk_size(0, Some("many"), 64),
        ] {
            assert!(matches!(bad, Err(Error::InvalidArgument(_))), "{bad:?}");
        }
    }
}
