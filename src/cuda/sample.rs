//! The sampler on the device (kernels/sample.cu): its buffers, the settings it reads, and the
//! kernel a draw launches for the settings in force. The settings reach the kernel through
//! device memory, so one captured graph draws under any settings of its [`Plan`]; the host
//! captures a graph per plan when a request first asks for it (no eager probe: capturing
//! touches no state, so a request may change its sampling between steps).
//! [`crate::sampling`] is the reference; the draw is the same function of the logits, the seed
//! and the slot the id will take, so that the ids do not depend on how steps are batched.

use cudarc::driver::CudaSlice;

use super::device::{driver_error, Gpu};
use super::kernels::state;
use super::ops::{one_cta, MAX_ARGMAX_CTAS};
use super::step::CudaBackend;
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::sampling::{LogitBias, Sampling, MAX_LOGIT_BIAS};

/// Threads per CTA of the sampler's kernel.
pub const SAMPLE_THREADS: u32 = 512;
/// Bins of the radix select's widest pass (12 bits of the key).
pub const SAMPLE_BINS: usize = 4096;
/// Histogram buffers: one per pass of top-k's select and of top-p's (3 each).
const SAMPLE_BIN_BUFFERS: usize = 6;
/// The most candidates for top-k (the ids in and above the bin of the k-th largest logit) that
/// one CTA ranks and finishes top-k, top-p, min-p and the draw over (a thread per candidate,
/// each comparing its key with every other's).
pub const SAMPLE_CANDIDATES: usize = 512;
/// 32-bit words of the kernel's scratch (SampleWork: two 64-bit and three 32-bit words per
/// CTA, 4 words, the candidates).
pub const SAMPLE_WORK_WORDS: usize = 4 + 7 * MAX_ARGMAX_CTAS + SAMPLE_CANDIDATES;

/// The settings as the kernel reads them (kernels/sample.cu `SampleParams`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleParams {
    temperature: f32,
    top_k: i32,
    top_p: f32,
    log_min_p: f32,
    repeat_penalty: f32,
    presence_penalty: f32,
    frequency_penalty: f32,
    penalty_last_n: i32,
    seed_lo: u32,
    seed_hi: u32,
}

impl SampleParams {
    pub fn of(s: &Sampling) -> Self {
        Self {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            log_min_p: s.log_min_p(),
            repeat_penalty: s.repeat_penalty,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            penalty_last_n: s.penalty_last_n,
            seed_lo: s.seed as u32,
            seed_hi: (s.seed >> 32) as u32,
        }
    }

    /// The struct's words, as uploaded.
    fn words(&self) -> [u32; 10] {
        [
            self.temperature.to_bits(),
            self.top_k as u32,
            self.top_p.to_bits(),
            self.log_min_p.to_bits(),
            self.repeat_penalty.to_bits(),
            self.presence_penalty.to_bits(),
            self.frequency_penalty.to_bits(),
            self.penalty_last_n as u32,
            self.seed_lo,
            self.seed_hi,
        ]
    }
}

/// The phases a draw runs under some settings; a graph is captured per plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// A logit bias applies.
    pub biased: bool,
    /// Some penalty applies.
    pub penalties: bool,
    /// A random draw (temperature > 0); else the argmax of the penalized logits.
    pub random: bool,
    /// The radix select for top-k (0 < k < vocab) and for top-p (< 1).
    pub top_k: bool,
    pub top_p: bool,
}

impl Plan {
    /// None where the settings (and no bias) are the greedy argmax of today's step (no
    /// sampler).
    pub fn of(s: &Sampling, biased: bool, vocab: usize) -> Option<Self> {
        if s.is_greedy() && !biased {
            return None;
        }
        let random = s.temperature > 0.0;
        Some(Self {
            biased,
            penalties: !s.penalties_off(),
            random,
            top_k: random && s.top_k > 0 && (s.top_k as usize) < vocab,
            top_p: random && s.top_p < 1.0,
        })
    }
}

/// The sampler's device buffers, allocated at load.
pub struct DeviceSampler {
    params: CudaSlice<u32>,
    work: CudaSlice<u32>,
    /// The radix select's histograms (zero between launches).
    bins: CudaSlice<u64>,
    /// Occurrences per id in the penalties' window (zero between launches).
    counts: CudaSlice<i32>,
    /// (id or -1, logit bits) per window entry: the logits the penalties changed.
    saved: CudaSlice<i32>,
    /// The id fed at each position of the request (commits and prefill write it).
    pub history: CudaSlice<i32>,
    /// The logit bias as the kernel reads it: its count, then per id (id, bias bits, the logit
    /// it replaced in the last draw).
    bias: CudaSlice<i32>,
    /// The settings and the bias in force, and their plan (None: greedy).
    pub settings: Sampling,
    pub logit_bias: LogitBias,
    pub plan: Option<Plan>,
}

/// The sampler's buffer lengths in elements, for the allocation and the budget
/// ([`super::budget::ArenaLens`]).
pub struct SamplerLens {
    pub work: usize,
    pub bins: usize,
    pub counts: usize,
    pub saved: usize,
    pub history: usize,
    pub bias: usize,
}

impl SamplerLens {
    pub fn new(vocab: usize, max_seq: usize) -> Self {
        Self {
            work: SAMPLE_WORK_WORDS,
            bins: SAMPLE_BIN_BUFFERS * SAMPLE_BINS,
            counts: vocab,
            saved: 2 * (max_seq + 1),
            history: max_seq + 1,
            bias: 1 + 3 * MAX_LOGIT_BIAS,
        }
    }

    pub fn bytes(&self) -> usize {
        4 * (16 + self.work + 2 * self.bins + self.counts + self.saved + self.history + self.bias)
    }
}

impl DeviceSampler {
    pub fn new(gpu: &Gpu, lens: &SamplerLens) -> Result<Self> {
        Ok(Self {
            params: gpu.upload(&SampleParams::of(&Sampling::default()).words())?,
            work: gpu.zeros(lens.work)?,
            bins: gpu.zeros(lens.bins)?,
            counts: gpu.zeros(lens.counts)?,
            saved: gpu.zeros(lens.saved)?,
            history: gpu.zeros(lens.history)?,
            bias: gpu.zeros(lens.bias)?,
            settings: Sampling::default(),
            logit_bias: LogitBias::default(),
            plan: None,
        })
    }

    /// Writes the settings the kernel reads (stream-ordered after the work already queued).
    pub fn set(&mut self, gpu: &Gpu, s: &Sampling, vocab: usize) -> Result<()> {
        gpu.stream
            .memcpy_htod(&SampleParams::of(s).words(), &mut self.params)
            .map_err(driver_error("sampling settings"))?;
        self.settings = *s;
        self.plan = Plan::of(s, !self.logit_bias.is_empty(), vocab);
        Ok(())
    }

    /// Writes the logit bias the kernel reads (stream-ordered as [`Self::set`]).
    pub fn set_bias(&mut self, gpu: &Gpu, bias: &LogitBias, vocab: usize) -> Result<()> {
        let mut words = vec![bias.entries().len() as i32];
        for &(id, b) in bias.entries() {
            words.extend([id as i32, b.to_bits() as i32, 0]);
        }
        gpu.stream
            .memcpy_htod(&words, &mut self.bias.slice_mut(..words.len()))
            .map_err(driver_error("logit bias"))?;
        self.logit_bias = bias.clone();
        self.plan = Plan::of(&self.settings, !bias.is_empty(), vocab);
        Ok(())
    }

    /// Zeroes the counts an interrupted launch could have left (the kernel leaves them zero).
    pub fn reset(&mut self, gpu: &Gpu) -> Result<()> {
        let zeros = [0u32; SAMPLE_WORK_WORDS];
        gpu.stream
            .memcpy_htod(&zeros, &mut self.work)
            .map_err(driver_error("sampler reset"))?;
        gpu.stream
            .memcpy_htod(&[0u64; SAMPLE_BIN_BUFFERS * SAMPLE_BINS], &mut self.bins)
            .map_err(driver_error("sampler reset"))
    }
}

impl CudaBackend {
    /// Enqueues the draw of `plan` from the logits into the state's next_token, for the slot
    /// state[POSITION] + `slot_offset` (the decode step draws before its commit, 1; the
    /// prefill after its last advance, 0): one cooperative kernel, a CTA per SM.
    pub(super) fn record_draw(&self, plan: Plan, slot_offset: i32) -> Result<()> {
        let smp = &self.sampler;
        let (logits, vocab, state) = (
            self.ptr(&self.arena.logits),
            self.spec.vocab as i32,
            self.ptr(&self.state),
        );
        let (params, work, bins, scratch) = (
            self.ptr(&smp.params),
            self.ptr(&smp.work),
            self.ptr(&smp.bins),
            self.ptr(&self.arena.argmax),
        );
        let (hist, counts, saved, bias) = (
            self.ptr(&smp.history),
            self.ptr(&smp.counts),
            self.ptr(&smp.saved),
            self.ptr(&smp.bias),
        );
        let [biased, penalties, top_k, top_p, shortcuts] = [
            plan.biased,
            plan.penalties,
            plan.top_k,
            plan.top_p,
            self.ops.cfg.sample_shortcuts,
        ]
        .map(i32::from);
        let grid = cudarc::driver::LaunchConfig {
            grid_dim: (self.ops.sms.min(MAX_ARGMAX_CTAS as u32), 1, 1),
            ..one_cta(SAMPLE_THREADS)
        };
        launch!(self.ops.gpu, &self.ops.k.sample_draw, grid, cooperative; logits, vocab, state, slot_offset, params, work, bins, scratch, hist, counts, saved, bias, biased, penalties, top_k, top_p, shortcuts)
    }

    /// Measuring tool (the kernel-level distribution test): `n` draws from `logits` under the
    /// settings in force after the request's ids `history` (at least one), for the slots
    /// history.len(), history.len() + 1, ... (replays of a captured draw and commit, each id
    /// appended to the history); the request's state is lost (reset afterwards). The last slot
    /// is at most max_seq.
    pub fn draws_from(&mut self, logits: &[f32], history: &[u32], n: usize) -> Result<Vec<u32>> {
        let first_slot = history.len();
        self.settled = None; // the state is rewritten below
        if logits.len() != self.spec.vocab || first_slot == 0 || first_slot + n > self.max_seq + 1 {
            return Err(Error::InvalidArgument(format!(
                "draws_from: {} logits (vocab {}), slots {first_slot}..{} (1 to max_seq {})",
                logits.len(),
                self.spec.vocab,
                first_slot + n,
                self.max_seq
            )));
        }
        let plan = self.sampler.plan.unwrap_or(Plan {
            biased: false,
            penalties: false,
            random: false,
            top_k: false,
            top_p: false,
        });
        let gpu = &self.ops.gpu;
        gpu.stream
            .memcpy_htod(logits, &mut self.arena.logits)
            .map_err(driver_error("logits upload"))?;
        let history: Vec<i32> = history.iter().map(|&i| i as i32).collect();
        gpu.stream
            .memcpy_htod(&history, &mut self.sampler.history.slice_mut(..first_slot))
            .map_err(driver_error("history upload"))?;
        let mut st = [0i32; state::LEN];
        st[state::POSITION] = first_slot as i32 - 1;
        st[state::VALID_LEN] = first_slot as i32 - 1;
        gpu.stream
            .memcpy_htod(&st, &mut self.state)
            .map_err(driver_error("state"))?;
        let graph = gpu.capture(|| self.record_draw(plan, 1).and_then(|()| self.commit(-1)))?;
        for _ in 0..n {
            graph.launch().map_err(driver_error("graph launch"))?;
        }
        let st = self.read_state()?;
        let ids = self
            .ops
            .gpu
            .download(&self.arena.ring, st[state::RING_COUNT] as usize)?;
        self.rewind(0)?;
        Ok(ids.into_iter().map(|i| i as u32).collect())
    }
}
