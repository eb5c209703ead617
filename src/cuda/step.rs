//! The CUDA backend: decode state, KV cache and activation arena on the device, and the
//! decode step's schedule (`forward_marked`). Everything is allocated in `new`; a step
//! allocates nothing, reads nothing back and never synchronises with the host. The step is
//! captured once into a CUDA graph (`DV2_GRAPH=0`: eager launches, for comparison), with the
//! long-context attention where the model takes it, else attention v2, at every depth. The
//! chunked prefill is in [`super::prefill`], the measuring tools in [`super::profile`].

use cudarc::driver::{CudaGraph, CudaSlice};

use super::budget::{self, kv_stride};
use super::device::{driver_error, Gpu};
use super::draft::DraftBuffers;
use super::kernels::state;
use super::ops::{
    check_shape, one_cta, AttnArgs, Input, LogitsHead, Norm, Ops, PartialSums, QkvArgs,
};
use super::prefill::{chunk_size, prefill_chunk};
use super::profile::StageMarks;
use super::sample::{DeviceSampler, Plan};
use super::staging::StageBuffers;
use super::weights::{self, DeviceMatrix, DeviceModel};
use crate::arch::ArchSpec;
use crate::backend::Backend;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::model::HostModel;
use crate::rope::RopeTable;
use crate::sampling::{LogitBias, Sampling};
use crate::state::{StateReader, StateWriter, ValueType};

/// bf16 bit pattern written into the KV guard slots (a NaN no kernel produces).
const KV_POISON: u16 = 0x7fa5;

/// The captured step. CUDA graph handles are not internally synchronised but may be used
/// from any thread when calls are serialised.
struct StepGraph(CudaGraph);

// SAFETY: the graph is only reached through `&mut CudaBackend` (one thread at a time), which
// serialises every call on it, as the CUDA graph thread-safety rules require.
unsafe impl Send for StepGraph {}

/// Activations (token-major, one row per token of a prefill chunk; the decode step uses
/// row 0) and logits, allocated once at load.
pub(super) struct Arena {
    pub(super) x: CudaSlice<f32>,
    pub(super) xn: CudaSlice<f32>,
    pub(super) qkv: CudaSlice<f32>,
    pub(super) attn: CudaSlice<f32>,
    pub(super) act: CudaSlice<f32>,
    pub(super) logits: CudaSlice<f32>,
    pub(super) part_acc: CudaSlice<f32>,
    pub(super) part_ml: CudaSlice<f32>,
    /// Partial sums of squares of x left by the kernel that last wrote it (DV2_FUSE_RMS).
    pub(super) sums: CudaSlice<f32>,
    pub(super) prompt: CudaSlice<i32>,
    /// The ids of the steps of one step_n call, appended by commit_step.
    pub(super) ring: CudaSlice<i32>,
    /// argmax_logits' arrival count (zero between launches) and its CTAs' (value, index).
    pub(super) argmax: CudaSlice<i32>,
    /// The long-context attention's arrival counts per KV head and rank (zero between
    /// launches).
    pub(super) attn_counts: CudaSlice<i32>,
    /// A zero second part of q/k/v for the attention where q/k/v ran in one
    /// (the `DV2_QKV_KHALVES` kernels add one).
    pub(super) qkv_zeros: CudaSlice<f32>,
}

/// Device addresses of the arena's activation buffers (row 0 is the decode step's).
pub(super) struct Activations {
    pub(super) x: u64,
    pub(super) xn: u64,
    pub(super) qkv: u64,
    pub(super) attn: u64,
    pub(super) act: u64,
}

pub struct CudaBackend {
    pub(super) ops: Ops,
    pub(super) spec: ArchSpec,
    pub(super) max_seq: usize,
    pub(super) eos: i32,
    pub(super) model: DeviceModel,
    pub(super) state: CudaSlice<i32>,
    pub(super) k_cache: CudaSlice<u16>,
    pub(super) v_cache: CudaSlice<u16>,
    pub(super) rope_cos: CudaSlice<f32>,
    pub(super) rope_sin: CudaSlice<f32>,
    pub(super) arena: Arena,
    /// One greedy step (forward + commit) captured at load; None runs it eagerly.
    graph: Option<StepGraph>,
    /// The sampled step (forward, draw, commit) by plan, captured when a request first
    /// samples under that plan.
    sampled_graphs: Vec<(Plan, StepGraph)>,
    pub(super) sampler: DeviceSampler,
    /// The state's position as the host last knew it (None: read it back before use).
    pub(super) position: Option<usize>,
    /// The state as the last prefill or step_n left it, read back once as they ended; None from
    /// the next call that launches work on it. `next_token`, `finished` and `position` answer
    /// from it: after a step each was a device round trip of its own (three a `dv2_step` with
    /// the step's own, where one serves).
    pub(super) settled: Option<[i32; state::LEN]>,
    /// Prompt tokens per prefill chunk; 0: one token at a time through the decode step.
    pub(super) chunk: usize,
    /// The position of the first forward whose logits held inf or NaN, not yet taken by the
    /// engine ([`Backend::take_non_finite`]).
    pub(super) non_finite: Option<usize>,
    /// Free device memory on the context before the load ([`Backend::device_used_bytes`]).
    free_at_open: usize,
    /// Host time of the eager probe step and the graph capture at load (0 without a graph).
    pub(super) warmup_ms: f64,
    /// Host time of the weights' upload at load, to its last copy's end.
    upload_ms: f64,
    /// The page-locked buffers of state saves and loads, from the first on ([`super::saved`]).
    pub(super) state_stage: Option<StageBuffers>,
    /// The speculative step's buffers, from its first use on ([`super::draft`]).
    pub(super) draft: Option<DraftBuffers>,
}

impl CudaBackend {
    /// Whether a model of shape `s` loads on `device` with `max_seq` KV slots, from the shape
    /// alone: a device, the kernels' limits, then the VRAM budget against the device's free
    /// memory (at the requested prefill chunk; [`Self::new`] checks again at the chunk it
    /// settles on). The engine asks before reading any weight, so a refused model fails in
    /// well under a second. With `fit` (the host left max_seq to the model), a capacity past the
    /// budget becomes the largest multiple of [`budget::FIT_STEP`] within it. Returns the device
    /// opened, for [`Self::on`] (a context dropped between the two would be created again), and
    /// the capacity.
    pub fn admit(
        s: &ArchSpec,
        max_seq: usize,
        fit: bool,
        device: usize,
        chunk: usize,
    ) -> Result<(Gpu, usize)> {
        let cfg = Config::from_env();
        let gpu = Gpu::open(device, &cfg)?;
        check_shape(s)?;
        let (free, total) = gpu.memory()?;
        let budget_at = |max_seq: usize| {
            let chunk = if cfg.prefill_by_steps {
                0
            } else {
                chunk_size(chunk, cfg.prefill_chunk.as_deref(), max_seq)?
            };
            budget::estimate(s, max_seq, chunk).check(free, total)
        };
        match budget_at(max_seq) {
            Err(Error::OutOfMemory(why)) if fit => {
                let fitted = budget::largest_fitting(max_seq, |m| budget_at(m).is_ok())
                    .ok_or(Error::OutOfMemory(why))?;
                Ok((gpu, fitted))
            }
            checked => checked.map(|()| (gpu, max_seq)),
        }
    }

    /// Opens `device`, then [`Self::on`] it.
    pub fn new(
        host: &HostModel,
        max_seq: usize,
        eos: Option<u32>,
        device: usize,
        graph: bool,
        chunk: usize,
    ) -> Result<Self> {
        let gpu = Gpu::open(device, &Config::from_env())?;
        Self::on(gpu, host, max_seq, eos, graph, chunk)
    }

    /// Uploads the model to `gpu` and allocates everything; with `graph`, runs one eager step
    /// as a probe and captures the step into a CUDA graph. `chunk`: see [`prefill_chunk`].
    pub fn on(
        gpu: Gpu,
        host: &HostModel,
        max_seq: usize,
        eos: Option<u32>,
        graph: bool,
        chunk: usize,
    ) -> Result<Self> {
        let s = host.spec;
        let cfg = Config::from_env();
        let (free, total) = gpu.memory()?;
        let mut ops = Ops::new(gpu, cfg)?;
        let chunk = prefill_chunk(&ops, &s, max_seq, chunk)?;
        budget::estimate(&s, max_seq, chunk).check(free, total)?;
        ops.fit(&s)?;
        let gpu = &ops.gpu;
        let started = std::time::Instant::now();
        let model = weights::upload(gpu, host, ops.cfg.staged_upload)?;
        gpu.sync()?;
        let upload_ms = started.elapsed().as_secs_f64() * 1e3;
        let rope = RopeTable::for_model(host, max_seq)?;
        let lens = budget::ArenaLens::new(&s, max_seq, chunk);
        let arena = Arena {
            x: gpu.zeros(lens.rows_hidden)?,
            xn: gpu.zeros(lens.rows_hidden)?,
            qkv: gpu.zeros(lens.qkv)?,
            attn: gpu.zeros(lens.rows_q)?,
            act: gpu.zeros(lens.act)?,
            logits: gpu.zeros(lens.logits)?,
            part_acc: gpu.zeros(lens.part_acc)?,
            part_ml: gpu.zeros(lens.part_ml)?,
            sums: gpu.zeros(lens.sums)?,
            prompt: gpu.zeros(lens.ids)?,
            ring: gpu.zeros(lens.ids)?,
            argmax: gpu.zeros(lens.argmax)?,
            attn_counts: gpu.zeros(lens.attn_counts)?,
            qkv_zeros: gpu.zeros(lens.qkv_zeros)?,
        };
        // Every slot starts poisoned: the guard slots stay so (checked by kv_guard_intact),
        // and a kernel that read an unwritten slot would turn the logits into NaN.
        let kv_len = s.n_layers * kv_stride(max_seq) * s.kv_dim();
        let mut backend = Self {
            k_cache: gpu.filled_u16(kv_len, KV_POISON)?,
            v_cache: gpu.filled_u16(kv_len, KV_POISON)?,
            rope_cos: gpu.upload(&rope.cos)?,
            rope_sin: gpu.upload(&rope.sin)?,
            state: gpu.zeros(lens.state)?,
            arena,
            spec: s,
            max_seq,
            eos: eos.map_or(-1, |e| e as i32),
            model,
            graph: None,
            sampled_graphs: Vec::new(),
            sampler: DeviceSampler::new(gpu, &lens.sampler)?,
            position: Some(0),
            settled: None,
            chunk,
            warmup_ms: 0.0,
            upload_ms,
            state_stage: None,
            draft: None,
            free_at_open: free,
            non_finite: None,
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
    /// the step into a graph. The probe steps' KV writes land in slot 0, which the next
    /// request overwrites before reading; the state is reset afterwards.
    fn capture(&mut self) -> Result<()> {
        self.record_step()?;
        self.ops.gpu.sync()?;
        self.graph = Some(self.capture_recorded()?);
        self.rewind(0)
    }

    /// Captures the step as [`Self::record_step`] enqueues it under the settings in force.
    fn capture_recorded(&self) -> Result<StepGraph> {
        let graph = self.ops.gpu.capture(|| self.record_step())?;
        graph.upload().map_err(driver_error("graph upload"))?;
        Ok(StepGraph(graph))
    }

    /// `apply` (a [`DeviceSampler`] setter) with `new`, then the sampled step's graphs for the
    /// plan that makes ([`Self::capture_sampled`]); a failed capture applies `previous` back.
    fn set_sampler<T>(
        &mut self,
        new: &T,
        previous: T,
        apply: fn(&mut DeviceSampler, &Gpu, &T, usize) -> Result<()>,
    ) -> Result<()> {
        apply(&mut self.sampler, &self.ops.gpu, new, self.spec.vocab)?;
        let captured = self.capture_sampled();
        if captured.is_err() {
            apply(&mut self.sampler, &self.ops.gpu, &previous, self.spec.vocab)?;
        }
        captured
    }

    /// Captures the sampled step's graphs for the plan in force unless they are there (or the
    /// step runs eagerly).
    fn capture_sampled(&mut self) -> Result<()> {
        let Some(plan) = self.sampler.plan else {
            return Ok(());
        };
        if self.graph.is_none() || self.sampled_graphs.iter().any(|g| g.0 == plan) {
            return Ok(());
        }
        let graph = self.capture_recorded()?;
        self.sampled_graphs.push((plan, graph));
        Ok(())
    }

    /// The state's position: the host's mirror, or read back where it has none.
    pub(super) fn host_position(&mut self) -> Result<usize> {
        if let Some(p) = self.position {
            return Ok(p);
        }
        let p = self.read_state()?[state::POSITION] as usize;
        self.position = Some(p);
        Ok(p)
    }

    /// Enqueues one step: forward with logits, the draw where the request samples, then the
    /// commit (greedy: in lm_head's kernel where it takes the argmax, `DV2_LOGITS_ARGMAX`,
    /// else commit_step).
    fn record_step(&self) -> Result<()> {
        match self.sampler.plan {
            None => {
                if self.forward_marked(true, true, &mut None)? {
                    return Ok(());
                }
            }
            Some(plan) => {
                self.forward_marked(true, false, &mut None)?;
                self.record_draw(plan, 1)?;
            }
        }
        self.commit(self.eos)
    }

    /// commit_step: next_token fed next, into the ring and the history (finished at `eos`,
    /// -1: never).
    pub(super) fn commit(&self, eos: i32) -> Result<()> {
        let (state, ring, hist) = (
            self.ptr(&self.state),
            self.ptr(&self.arena.ring),
            self.ptr(&self.sampler.history),
        );
        launch!(self.ops.gpu, &self.ops.k.commit_step, one_cta(1); state, eos, ring, hist)
    }

    /// The graph of the step under the settings in force (None: launch it eagerly).
    fn step_graph(&self) -> Option<&StepGraph> {
        match self.sampler.plan {
            None => self.graph.as_ref(),
            Some(plan) => self
                .sampled_graphs
                .iter()
                .find(|(p, _)| *p == plan)
                .map(|g| &g.1),
        }
    }

    pub(super) fn ptr<T>(&self, buf: &CudaSlice<T>) -> u64 {
        self.ops.gpu.ptr(buf)
    }

    /// Device addresses of the activation buffers.
    pub(super) fn activations(&self) -> Activations {
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
    pub(super) fn normed(
        &self,
        x: u64,
        w: &CudaSlice<u16>,
        xn: u64,
        sums: Option<PartialSums>,
    ) -> Input {
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
    pub(super) fn forward(&self, logits: bool) -> Result<()> {
        self.forward_marked(logits, false, &mut None).map(|_| ())
    }

    /// [`Self::forward`], recording an event after each group of kernels into `marks` when
    /// given (the per-stage split of the bench).
    /// With `commit` (and `logits`), the step's commit too where lm_head's kernel can take it:
    /// returns whether it did.
    pub(super) fn forward_marked(
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
        // x = embed[token]: [hidden].
        launch!(gpu, &ops.k.embed_row, one_cta(256); state, embed, x, hidden, vocab, ss_out)?;
        let mut x_sums = sums(1);
        mark("embed")?;
        for (l, layer) in self.model.layers.iter().enumerate() {
            // q/k/v = W_qkv rms(x) + bias: [hidden] -> [(n_q + 2 n_kv) head_dim].
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
            // attn = attention(rope(q), rope(k) and v into the cache at the position, the
            // cache up to it): [n_q head_dim].
            let args = self.attn_args(l, halves);
            if ops.attn_long {
                ops.attention_long(args, attn, self.ptr(&a.attn_counts))?;
            } else if ops.attn_long_flat {
                ops.attention_long_flat(args, attn, self.ptr(&a.attn_counts))?;
            } else {
                ops.attention(args, attn, self.ptr(&a.attn_counts))?;
            }
            mark("attention + merge")?;
            // x += W_o attn: [n_q head_dim] -> [hidden].
            x_sums = residual(&layer.o, s.q_dim(), Input::raw(attn))?;
            mark("o_proj (+residual)")?;
            // act = silu(W_gate rms(x)) * (W_up rms(x)): [hidden] -> [intermediate].
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
            // x += W_down act: [intermediate] -> [hidden].
            x_sums = residual(&layer.down, s.intermediate, act_in)?;
            mark("down (+residual)")?;
        }
        if logits {
            // logits = W_lm rms(x): [hidden] -> [vocab], their argmax, the commit.
            // Replays after the request finished must not overwrite the last logits.
            let finished = state + 4 * state::FINISHED as u64;
            let committed = self.logits_of(x, finished, x_sums, commit)?;
            mark("final_norm + lm_head + argmax")?;
            return Ok(committed);
        }
        Ok(false)
    }

    /// Layer `l`'s attention arguments; `halves`: q/k/v's GEMV left two K halves to add.
    fn attn_args(&self, l: usize, halves: bool) -> AttnArgs {
        let (s, a) = (&self.spec, &self.arena);
        let layer_bytes = (2 * kv_stride(self.max_seq) * s.kv_dim()) as u64;
        let qkv = self.ptr(&a.qkv);
        AttnArgs {
            qkv,
            k_cache: self.ptr(&self.k_cache) + l as u64 * layer_bytes,
            v_cache: self.ptr(&self.v_cache) + l as u64 * layer_bytes,
            rope_cos: self.ptr(&self.rope_cos),
            rope_sin: self.ptr(&self.rope_sin),
            state: self.ptr(&self.state),
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
        }
    }

    /// Final RMSNorm of the activation row at `x` (`sums`: its producer's partial sums of
    /// squares, see [`Self::normed`]), lm_head into the logits, argmax into next_token; the
    /// lm_head is skipped on the device while `*skip_if != 0` (0: never).
    pub(super) fn logits_of(
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
            hist: self.ptr(&self.sampler.history),
        };
        if ops.logits_argmax(lm_head, s.vocab, s.hidden, input, out, skip_if, head)? {
            return Ok(commit);
        }
        ops.gemv(lm_head, s.vocab, s.hidden, input, out, false, skip_if, 0)?;
        launch!(ops.gpu, &ops.k.argmax_logits, ops.argmax_launch(); out, vocab, state, scratch)?;
        Ok(false)
    }

    pub(super) fn read_state(&self) -> Result<[i32; state::LEN]> {
        let v = self.ops.gpu.download(&self.state, state::LEN)?;
        Ok(v.try_into().expect("state length"))
    }

    /// The state as the last prefill or step_n left it, or read back where work ran since.
    pub(super) fn settled_state(&self) -> Result<[i32; state::LEN]> {
        match self.settled {
            Some(st) => Ok(st),
            None => self.read_state(),
        }
    }

    /// The state after forwards: keeps the first non-finite position the kernels marked, and
    /// clears the mark on the device for the next ones.
    fn read_state_after_forwards(&mut self) -> Result<[i32; state::LEN]> {
        let st = self.read_state()?;
        if st[state::NONFINITE] != 0 {
            self.non_finite
                .get_or_insert(st[state::NONFINITE] as usize - 1);
            self.ops
                .gpu
                .stream
                .memcpy_htod(
                    &[0i32],
                    &mut self.state.slice_mut(state::NONFINITE..state::NONFINITE + 1),
                )
                .map_err(driver_error("state clear"))?;
        }
        Ok(st)
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

    fn rewind(&mut self, position: usize) -> Result<()> {
        // position = valid_len = `position`, the rest of the state 0; the KV cache keeps its
        // contents (below `position` the request's, above it dirty), and so does the history
        // the penalties read (its entries below `position` are the request's ids).
        // argmax_logits' and the long attention's arrival counts are zero after every
        // completed launch; zeroed here too, so that no interrupted step can leave the next
        // one miscounting.
        self.position = None;
        self.settled = None;
        let zeros = [0i32; state::LEN];
        let mut st = zeros;
        st[state::POSITION] = position as i32;
        st[state::VALID_LEN] = position as i32;
        self.ops
            .gpu
            .stream
            .memcpy_htod(&st, &mut self.state)
            .map_err(driver_error("state rewind"))?;
        self.ops
            .gpu
            .stream
            .memcpy_htod(&zeros[..1], &mut self.arena.argmax.slice_mut(..1))
            .map_err(driver_error("argmax count reset"))?;
        let counts = self.arena.attn_counts.len();
        self.ops
            .gpu
            .stream
            .memcpy_htod(&zeros[..1].repeat(counts), &mut self.arena.attn_counts)
            .map_err(driver_error("attention count reset"))?;
        self.sampler.reset(&self.ops.gpu)?;
        self.ops.gpu.sync()?;
        self.position = Some(position);
        Ok(())
    }

    fn prefill(&mut self, ids: &[u32]) -> Result<()> {
        let start = self.host_position()?;
        self.position = None; // until the prefill has completed
        self.settled = None;
        let ids: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        self.ops
            .gpu
            .stream
            .memcpy_htod(&ids, &mut self.arena.prompt.slice_mut(..ids.len()))
            .map_err(driver_error("prompt upload"))?;
        self.ops
            .gpu
            .stream
            .memcpy_htod(
                &ids,
                &mut self.sampler.history.slice_mut(start..start + ids.len()),
            )
            .map_err(driver_error("history upload"))?;
        let state = self.ptr(&self.state);
        launch!(self.ops.gpu, &self.ops.k.begin_prefill, one_cta(1); state)?;
        if self.chunk == 0 {
            self.prefill_by_steps(ids.len())?;
        } else {
            for i in (0..ids.len()).step_by(self.chunk) {
                let n = self.chunk.min(ids.len() - i);
                self.prefill_chunk(i, start + i, n, i + n == ids.len())?;
            }
        }
        if let Some(plan) = self.sampler.plan {
            self.record_draw(plan, 0)?;
        }
        let (eos, hist) = (self.eos, self.ptr(&self.sampler.history));
        launch!(self.ops.gpu, &self.ops.k.finish_prefill, one_cta(1); state, eos, hist)?;
        self.settled = Some(self.read_state_after_forwards()?);
        self.position = Some(start + ids.len());
        Ok(())
    }

    /// Enqueues `out.len()` steps (graph replays, or eager launches) with no host wait in
    /// between, then copies the step ring back once. Steps after the one that finished commit
    /// nothing on the device.
    fn step_n(&mut self, out: &mut [u32]) -> Result<usize> {
        self.position = None; // until the steps have completed
        self.settled = None;
        let state = self.ptr(&self.state);
        launch!(self.ops.gpu, &self.ops.k.ring_reset, one_cta(1); state)?;
        // Each step runs at the state's position, or does nothing (the request finished).
        for _ in 0..out.len() {
            match self.step_graph() {
                Some(g) => g.0.launch().map_err(driver_error("graph launch"))?,
                None => self.record_step()?,
            }
        }
        let st = self.read_state_after_forwards()?;
        self.position = Some(st[state::POSITION] as usize);
        self.settled = Some(st);
        let done = st[state::RING_COUNT] as usize;
        // Every commit also leaves its id as the state's token: one step's is there already.
        let ring = match done {
            1 => vec![st[state::TOKEN]],
            _ => self.ops.gpu.download(&self.arena.ring, done)?,
        };
        out.iter_mut()
            .zip(&ring)
            .for_each(|(o, id)| *o = *id as u32);
        Ok(done)
    }

    /// Sampling on the device: the settings into the sampler's buffer, and the sampled step's
    /// graphs for their plan captured the first time a request samples under it (where the
    /// step runs as a graph). A failed capture puts the previous settings back.
    fn set_sampling(&mut self, s: &Sampling) -> Result<()> {
        let previous = self.sampler.settings;
        self.set_sampler(s, previous, DeviceSampler::set)
    }

    /// The bias into the sampler's buffer, and the graphs of its plan as
    /// [`Self::set_sampling`] captures them.
    fn set_logit_bias(&mut self, bias: &LogitBias) -> Result<()> {
        let previous = self.sampler.logit_bias.clone();
        self.set_sampler(bias, previous, DeviceSampler::set_bias)
    }

    fn step_draft(&mut self, draft: &[u32], out: &mut [u32]) -> Result<usize> {
        self.run_draft(draft, out)
    }

    fn draft_room(&self) -> usize {
        self.draft_capacity()
    }

    fn next_token(&mut self) -> Result<u32> {
        Ok(self.settled_state()?[state::NEXT_TOKEN] as u32)
    }

    fn logits(&mut self, out: &mut [f32]) -> Result<()> {
        let v = self.ops.gpu.download(&self.arena.logits, self.spec.vocab)?;
        out.copy_from_slice(&v);
        Ok(())
    }

    fn position(&mut self) -> Result<usize> {
        let st = self.settled_state()?;
        debug_assert_eq!(st[state::POSITION], st[state::VALID_LEN]);
        self.position = Some(st[state::POSITION] as usize);
        Ok(st[state::POSITION] as usize)
    }

    fn finished(&mut self) -> Result<bool> {
        Ok(self.settled_state()?[state::FINISHED] != 0)
    }

    fn kv_value_type(&self) -> ValueType {
        ValueType::Bf16
    }

    fn save_state(&mut self, len: usize, file: &mut StateWriter<'_>) -> Result<()> {
        self.save_state_to(len, file)
    }

    fn load_state(&mut self, file: &mut StateReader<'_>) -> Result<()> {
        self.load_state_from(file)
    }

    fn kv_guard_intact(&mut self) -> Result<bool> {
        CudaBackend::kv_guard_intact(self)
    }

    fn take_non_finite(&mut self) -> Option<usize> {
        self.non_finite.take()
    }

    fn device_free_bytes(&mut self) -> Result<Option<usize>> {
        Ok(Some(self.ops.gpu.memory()?.0))
    }

    fn device_used_bytes(&mut self) -> Result<Option<usize>> {
        let free = self.ops.gpu.memory()?.0;
        Ok(Some(self.free_at_open.saturating_sub(free)))
    }

    fn warmup_ms(&self) -> Option<f64> {
        Some(self.warmup_ms)
    }

    fn upload_ms(&self) -> Option<f64> {
        Some(self.upload_ms)
    }
}
