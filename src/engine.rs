//! The backend-agnostic session the C ABI wraps: load, reset, prefill, step, queries.
//!
//! State (seed spec §4-5), kept by the backend (on the device for CUDA):
//! - `token`: the id the next step feeds; `position`: the slot it writes;
//! - `valid_len`: KV prefix attention reads (= position after each forward);
//! - `next_token`: the last greedy id; `finished`: set when that id is the EOS id.
//!
//! The engine checks every call against a host mirror of position and finished, so a bad
//! call returns an error before anything runs and leaves the state as it was.

use std::sync::Arc;

use crate::arch::{preset, ArchSpec};
pub use crate::backend::Backend;
use crate::cpu::CpuBackend;
use crate::cuda::device::Gpu;
use crate::cuda::CudaBackend;
use crate::error::{Error, Result};
use crate::load::Metadata;
use crate::model::HostModel;
use crate::sampling::{LogitBias, Sampling};
pub use crate::speculate::MAX_DRAFT;
use crate::state::{self, StateReader, StateWriter};
use crate::synth;
use crate::tokenizer::Tokenizer;

/// Which backend runs the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// CUDA when a device is present and the model fits, else CPU.
    Auto,
    Cpu,
    Cuda,
}

#[derive(Clone, Debug)]
pub struct EngineOptions {
    pub backend: BackendKind,
    /// KV capacity in tokens; 0 takes the model's `max_seq` (on CUDA, where that does not fit
    /// the device, the largest multiple of 256 that does: [`Engine::fitted_from`]).
    pub max_seq: usize,
    /// Generating this id sets `finished`; `None` never finishes.
    pub eos: Option<u32>,
    /// Takes `eos` from the model file instead: its end-of-turn id where it names one, else its
    /// EOS id (a file load only; an error where the file names neither).
    pub eos_from_model: bool,
    /// CUDA device ordinal.
    pub device: usize,
    /// CUDA: replay the decode step as a captured graph (default on; `DV2_GRAPH=0` turns the
    /// default off, to measure eager launches against it).
    pub graph: bool,
    /// CUDA: prompt tokens per prefill chunk; 0 takes `DV2_PREFILL_CHUNK` or the default.
    pub prefill_chunk: usize,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            backend: BackendKind::Auto,
            max_seq: 0,
            eos: None,
            eos_from_model: false,
            device: 0,
            graph: crate::config::Config::from_env().graph,
            prefill_chunk: 0,
        }
    }
}

/// The backend [`Engine::admit`] chose for a model's shape: the CPU, or the device it opened
/// (kept for the backend, so that a load creates the device's context once).
enum Admitted {
    Cpu,
    /// The device and the KV capacity it takes.
    Cuda(Gpu, usize),
}

/// One decoding session over one model.
pub struct Engine {
    spec: ArchSpec,
    max_seq: usize,
    backend: Box<dyn Backend>,
    /// Host mirror of the backend's position (used to check calls, never to run a step).
    position: usize,
    finished: bool,
    /// A forward has run since load: logits and next_token exist.
    has_output: bool,
    /// A prompt has been prefilled since the last reset: there is a token to feed.
    has_token: bool,
    /// The model's own capacity where the device took only `max_seq` of it.
    fitted_from: Option<usize>,
    /// The model file's tokenizer, or why there is none.
    tokenizer: std::result::Result<Tokenizer, String>,
    meta: Metadata,
    /// [`state::fingerprint`] of the model: which state files it loads.
    fingerprint: u64,
    /// The request's ids (those fed, then the pending one): what drafts are looked up in. A
    /// draft is only a guess the backend checks, so this mirror need not be exact after an
    /// error.
    context: crate::speculate::Context,
    /// Speculative greedy decoding: the longest draft (0: off).
    max_draft: usize,
    /// Whether the sampling settings are greedy, and whether a logit bias is set: drafts are
    /// checked only under plain greedy decoding ([`Self::plain_greedy`]).
    greedy: bool,
    biased: bool,
    speculation: SpeculationStats,
}

/// What speculative decoding did since the engine was loaded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpeculationStats {
    /// Speculative steps (one forward over the pending id and a draft).
    pub checks: u64,
    /// Draft ids fed, and those greedy decoding produced (each one a step saved).
    pub drafted: u64,
    pub accepted: u64,
}

impl Engine {
    /// The KV capacity `opts` gives a model of shape `spec`, with the checks of `opts` that
    /// need only the shape (max_seq within int32, the EOS id within the vocabulary).
    fn max_seq_for(spec: &ArchSpec, opts: &EngineOptions) -> Result<usize> {
        let max_seq = if opts.max_seq == 0 {
            spec.max_seq
        } else {
            opts.max_seq
        };
        if max_seq > i32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "max_seq {max_seq} does not fit int32"
            )));
        }
        if let Some(eos) = opts.eos {
            if eos as usize >= spec.vocab {
                return Err(Error::InvalidArgument(format!(
                    "eos id {eos} >= vocab {}",
                    spec.vocab
                )));
            }
        }
        Ok(max_seq)
    }

    /// Whether a model of shape `spec` loads under `opts`, judged before its weights are read
    /// or built: the options, then (CUDA) the kernels' limits and the VRAM budget. Under
    /// [`BackendKind::Auto`], no device or too little memory is no refusal: the CPU runs it.
    fn admit(spec: &ArchSpec, opts: &EngineOptions) -> Result<Admitted> {
        spec.validate()?;
        let max_seq = Self::max_seq_for(spec, opts)?;
        // A capacity the host left to the model is fitted to the device; one it chose is not.
        let fit = opts.max_seq == 0;
        let cuda = || CudaBackend::admit(spec, max_seq, fit, opts.device, opts.prefill_chunk);
        match opts.backend {
            BackendKind::Cpu => Ok(Admitted::Cpu),
            BackendKind::Cuda => cuda().map(|(gpu, max_seq)| Admitted::Cuda(gpu, max_seq)),
            BackendKind::Auto => match cuda() {
                Ok((gpu, max_seq)) => Ok(Admitted::Cuda(gpu, max_seq)),
                Err(Error::BackendUnavailable(_) | Error::OutOfMemory(_)) => Ok(Admitted::Cpu),
                Err(e) => Err(e),
            },
        }
    }

    /// Builds an engine over a host model.
    pub fn new(model: HostModel, opts: &EngineOptions) -> Result<Self> {
        Self::build(model, opts, None)
    }

    /// [`Self::new`], on the backend [`Self::admit`] chose for the model's shape, if it did.
    fn build(model: HostModel, opts: &EngineOptions, admitted: Option<Admitted>) -> Result<Self> {
        model.validate()?;
        if opts.eos_from_model {
            return Err(Error::InvalidArgument(
                "EOS from the model file: only a model loaded from a file has one".into(),
            ));
        }
        let spec = model.spec;
        let fingerprint = state::fingerprint(&model);
        let wanted = Self::max_seq_for(&spec, opts)?;
        let admitted = match admitted {
            Some(admitted) => admitted,
            None => Self::admit(&spec, opts)?,
        };
        let cpu = |model: HostModel| -> Result<(Box<dyn Backend>, usize)> {
            let backend = CpuBackend::new(Arc::new(model.into_owned()), wanted, opts.eos)?;
            Ok((Box::new(backend), wanted))
        };
        let (backend, max_seq) = match admitted {
            Admitted::Cpu => cpu(model)?,
            Admitted::Cuda(gpu, max_seq) => {
                let (eos, graph, chunk) = (opts.eos, opts.graph, opts.prefill_chunk);
                match CudaBackend::on(gpu, &model, max_seq, eos, graph, chunk) {
                    Ok(b) => (Box::new(b) as Box<dyn Backend>, max_seq),
                    // Too large for the device after all: under Auto the CPU runs it.
                    Err(Error::BackendUnavailable(_) | Error::OutOfMemory(_))
                        if opts.backend == BackendKind::Auto =>
                    {
                        cpu(model)?
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        Ok(Self {
            spec,
            max_seq,
            fitted_from: (max_seq < wanted).then_some(wanted),
            backend,
            position: 0,
            finished: false,
            has_output: false,
            has_token: false,
            tokenizer: Err(
                "the model was not loaded from a file (a synthetic or host-built model)".into(),
            ),
            meta: Metadata::new(),
            fingerprint,
            context: Default::default(),
            max_draft: 0,
            greedy: true,
            biased: false,
            speculation: SpeculationStats::default(),
        })
    }

    /// Builds the synthetic model of a named preset (see [`crate::arch::PRESETS`]).
    pub fn load_synthetic(preset_name: &str, seed: u64, opts: &EngineOptions) -> Result<Self> {
        let spec = preset(preset_name)?;
        let admitted = Self::admit(&spec, opts)?;
        Self::build(synth::build(&spec, seed)?, opts, Some(admitted))
    }

    /// Loads a model file or directory (see [`crate::load`]).
    pub fn load_file(path: &std::path::Path, opts: &EngineOptions) -> Result<Self> {
        let admitted = std::cell::Cell::new(None);
        let crate::load::Loaded {
            model,
            tokenizer,
            meta,
        } = crate::load::load_admitted(path, &|spec| {
            admitted.replace(Some(Self::admit(spec, opts)?));
            Ok(())
        })?;
        let mut opts = opts.clone();
        if opts.eos_from_model {
            let special = tokenizer.as_ref().map(|t| t.special).map_err(|e| {
                Error::InvalidArgument(format!("EOS from the model file: no tokenizer ({e})"))
            })?;
            opts.eos = Some(special.eot.or(special.eos).ok_or_else(|| {
                Error::InvalidArgument(
                    "EOS from the model file: it names no end-of-turn or EOS token".into(),
                )
            })?);
            opts.eos_from_model = false;
        }
        let mut engine = Self::build(model, &opts, admitted.take())?;
        engine.tokenizer = tokenizer.map_err(|e| e.to_string());
        engine.meta = meta;
        Ok(engine)
    }

    /// The model file's metadata, by key (empty for a model not loaded from a file).
    pub fn meta(&self) -> &Metadata {
        &self.meta
    }

    /// The tokenizer of the model file, or an error saying why there is none.
    pub fn tokenizer(&self) -> Result<&Tokenizer> {
        self.tokenizer
            .as_ref()
            .map_err(|why| Error::Unsupported(format!("no tokenizer: {why}")))
    }

    pub fn spec(&self) -> &ArchSpec {
        &self.spec
    }

    /// KV capacity in tokens.
    pub fn max_seq(&self) -> usize {
        self.max_seq
    }

    /// The model's own capacity, where it did not fit the device with the weights and
    /// [`Self::max_seq`] is the largest multiple of 256 slots that did (only when the host left
    /// max_seq to the model); else None.
    pub fn fitted_from(&self) -> Option<usize> {
        self.fitted_from
    }

    /// KV slots left in this request (host-side count; no device read).
    pub fn room(&self) -> usize {
        self.max_seq - self.position
    }

    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// Sampling settings for the current request and the later ones (kept across reset until
    /// set again); the default is greedy. Refused values leave the settings as they were.
    pub fn set_sampling(&mut self, sampling: &Sampling) -> Result<()> {
        sampling.validate()?;
        self.run(|b| b.set_sampling(sampling))?;
        self.greedy = sampling.is_greedy();
        Ok(())
    }

    /// Adds `biases[i]` to the logit of `ids[i]` before the penalties and the draw, greedy or
    /// sampled, in the current request and the later ones (until set again; none clears it).
    /// Refused entries ([`LogitBias::new`]) leave the bias as it was.
    pub fn set_logit_bias(&mut self, ids: &[i32], biases: &[f32]) -> Result<()> {
        let bias = LogitBias::new(ids, biases, self.spec.vocab)?;
        self.run(|b| b.set_logit_bias(&bias))?;
        self.biased = !bias.is_empty();
        Ok(())
    }

    /// Speculative greedy decoding in [`Self::step_n`]: before each step, up to `max_draft`
    /// ids that followed an earlier occurrence of the request's last ids ([`crate::speculate`])
    /// are fed with the pending id in one forward, and those greedy decoding would have
    /// produced are kept: the same ids as steps one at a time, up to the rounding between the
    /// two paths' kernels on CUDA (near-ties), in fewer forwards where the text repeats its
    /// context. Only where decoding is plain greedy (no sampling, penalties or logit bias);
    /// otherwise, and with 0 (the default), every step is a step. At most [`MAX_DRAFT`].
    pub fn set_speculation(&mut self, max_draft: usize) -> Result<()> {
        if max_draft > MAX_DRAFT {
            return Err(Error::InvalidArgument(format!(
                "max_draft {max_draft} (0 to {MAX_DRAFT})"
            )));
        }
        self.max_draft = max_draft;
        Ok(())
    }

    /// What speculative decoding did since the engine was loaded.
    pub fn speculation_stats(&self) -> SpeculationStats {
        self.speculation
    }

    /// Starts a new request: position 0, not finished. Does not clear the KV cache.
    pub fn reset(&mut self) -> Result<()> {
        self.rewind(0)
    }

    /// Moves the request back to `position` (at most the current one), keeping the KV cache
    /// of the positions before it, so that a prompt sharing those ids is prefilled only from
    /// its first new one. Not finished, and no pending token: a prefill comes next. Position i
    /// holds the i-th id fed: the prompt's ids, then each id a step returned but the last.
    pub fn rewind(&mut self, position: usize) -> Result<()> {
        if position > self.position {
            return Err(Error::InvalidArgument(format!(
                "rewind to position {position} is past the current position {}",
                self.position
            )));
        }
        self.run(|b| b.rewind(position))?;
        self.position = position;
        self.finished = false;
        self.has_token = false;
        self.context.truncate(position);
        Ok(())
    }

    /// Saves the request's state to `path` (see [`crate::state`]): the ids at positions
    /// 0..position and their KV slots, so that [`Self::load_state`], in this process or a later
    /// one, on either backend, continues from there without prefilling them again. The pending
    /// id (the last one chosen) is not part of it. Returns the count of positions saved. The
    /// request is unchanged; a failed save leaves any earlier file at `path` whole.
    pub fn save_state(&mut self, path: &std::path::Path) -> Result<usize> {
        let (len, value_type) = (self.position, self.backend.kv_value_type());
        let file = StateWriter::create(path, &self.spec, self.fingerprint, value_type, len)?;
        self.save_into(file)
    }

    /// Bytes [`Self::save_state_bytes`] writes now: the size of the file [`Self::save_state`]
    /// would write.
    pub fn state_size(&self) -> usize {
        state::state_bytes(&self.spec, self.position, self.backend.kv_value_type()) as usize
    }

    /// [`Self::save_state`] into `out`, the same bytes as the file: returns their count
    /// ([`Self::state_size`]), at the start of `out`; `out` too small is
    /// [`Error::BufferTooSmall`] with nothing written.
    pub fn save_state_bytes(&mut self, out: &mut [u8]) -> Result<usize> {
        let size = self.state_size();
        let Some(out) = out.get_mut(..size) else {
            return Err(Error::BufferTooSmall(format!(
                "the state takes {size} bytes, capacity {}",
                out.len()
            )));
        };
        let (len, value_type) = (self.position, self.backend.kv_value_type());
        let buf = StateWriter::in_memory(out, &self.spec, self.fingerprint, value_type, len)?;
        self.save_into(buf)?;
        Ok(size)
    }

    fn save_into(&mut self, mut to: StateWriter<'_>) -> Result<usize> {
        let len = self.position;
        self.run(|b| b.save_state(len, &mut to))?;
        to.finish()?;
        Ok(len)
    }

    /// What a state must match to load into this engine.
    fn expected_state(&self) -> state::Expected<'_> {
        state::Expected {
            spec: &self.spec,
            fingerprint: self.fingerprint,
            max_seq: self.max_seq,
        }
    }

    /// Opens a state file [`Self::save_state`] wrote from this model (the same weights; any
    /// backend and max_seq) and checks it against this engine, its ids read; the engine is
    /// unchanged.
    pub fn open_state(&self, path: &std::path::Path) -> Result<StateReader<'static>> {
        StateReader::open(path, &self.expected_state())
    }

    /// [`Self::open_state`] on a state's bytes ([`Self::save_state_bytes`], or a file's).
    pub fn open_state_bytes<'b>(&self, bytes: &'b [u8]) -> Result<StateReader<'b>> {
        StateReader::from_bytes(bytes, &self.expected_state())
    }

    /// [`Self::open_state`], then [`Self::restore_state`]; returns the ids at the positions
    /// it holds.
    pub fn load_state(&mut self, path: &std::path::Path) -> Result<Vec<u32>> {
        let mut file = self.open_state(path)?;
        self.restore_state(&mut file)?;
        Ok(file.ids().to_vec())
    }

    /// Replaces the request with the state `file` holds: positions 0..n hold its ids and their
    /// KV slots; not finished, and no pending token (a prefill comes next, as after
    /// [`Self::rewind`]), so a prompt that begins with its ids is prefilled from its first new
    /// one. A file opened by another model's engine is refused with the engine unchanged; an
    /// error while the slots are written (the file's read or the device) leaves the engine at
    /// position 0.
    pub fn restore_state(&mut self, file: &mut StateReader<'_>) -> Result<()> {
        let n = file.ids().len();
        if file.fingerprint() != self.fingerprint || n > self.max_seq {
            return Err(Error::InvalidArgument(format!(
                "a state of {n} positions opened for another engine (this one's max_seq is {})",
                self.max_seq
            )));
        }
        self.finished = false;
        self.has_token = false;
        if let Err(e) = self.backend.load_state(file) {
            // Slots of the request before may be overwritten: it is gone either way.
            let _ = self.backend.rewind(0);
            self.position = self.backend.position().unwrap_or(0);
            self.context.clear();
            return Err(e);
        }
        self.position = n;
        self.context.set(file.ids());
        Ok(())
    }

    /// Teacher-forces `ids` from the current position and returns the greedy id after the
    /// last (also `next_token()`). The pending `next_token` from before is not fed: include
    /// it in `ids` to keep it in the context.
    pub fn prefill(&mut self, ids: &[u32]) -> Result<u32> {
        if ids.is_empty() {
            return Err(Error::InvalidArgument(
                "prefill needs at least one id".into(),
            ));
        }
        self.in_vocab(ids, "ids")?;
        let room = self.max_seq - self.position;
        if ids.len() > room {
            return Err(Error::SequenceFull(format!(
                "prefill of {} ids at position {} exceeds max_seq {}",
                ids.len(),
                self.position,
                self.max_seq
            )));
        }
        // The pending id, if any, is not fed: it leaves the context.
        self.context.truncate(self.position);
        self.run(|b| b.prefill(ids))?;
        self.position += ids.len();
        self.has_output = true;
        self.has_token = true;
        let next = self.run(|b| b.next_token())?;
        self.context.extend_from_slice(ids);
        self.context.push(next);
        self.finished = self.run(|b| b.finished())?;
        self.check_finite()?;
        Ok(next)
    }

    /// One greedy step; returns the new id.
    pub fn step(&mut self) -> Result<u32> {
        let mut id = [0u32];
        self.step_n(&mut id)?;
        Ok(id[0])
    }

    /// Up to `out.len()` steps (greedy, or sampled under [`Self::set_sampling`]), writing each id; stops early after the step that
    /// produces EOS and at max_seq. Returns how many ids were written (at least 1).
    pub fn step_n(&mut self, out: &mut [u32]) -> Result<usize> {
        if out.is_empty() {
            return Err(Error::InvalidArgument("step_n needs n >= 1".into()));
        }
        let room = self.steppable()?;
        let n = out.len().min(room);
        if self.max_draft == 0 || !self.plain_greedy() {
            let done = self.run(|b| b.step_n(&mut out[..n]))?;
            self.after_steps(&out[..done])?;
            return Ok(done);
        }
        let mut written = 0;
        while written < n && !self.finished {
            // The draft leaves a slot for the id after it, in `out` and in the cache.
            let room = (n - written).min(self.max_seq - self.position);
            let max = self.max_draft.min(self.backend.draft_room()).min(room - 1);
            let draft = self.context.draft(max);
            let slots = &mut out[written..n];
            let done = if draft.is_empty() {
                let done = self.run(|b| b.step_n(&mut slots[..1]))?;
                self.after_steps(&slots[..done])?;
                done
            } else {
                self.checked_draft(&draft, slots)?
            };
            written += done;
        }
        Ok(written)
    }

    /// One speculative step on a draft the host chose (a draft model's, its own lookup):
    /// feeds the pending id and `draft` in one forward, keeps the longest prefix of the draft
    /// that greedy steps would have fed, and writes the ids those steps give (the accepted
    /// draft ids, then the id after them; through EOS at most) to `out`. Returns their count,
    /// 1 to `draft.len() + 1`; the state is as after that many steps. Plain greedy decoding
    /// only (no sampling, penalties or logit bias: [`Error::InvalidState`]); `out` must hold
    /// `draft.len() + 1` ids and the cache that many slots; at most [`MAX_DRAFT`] ids (and on
    /// CUDA the prefill chunk less one).
    pub fn step_draft(&mut self, draft: &[u32], out: &mut [u32]) -> Result<usize> {
        let room = self.steppable()?;
        if !self.plain_greedy() {
            return Err(Error::InvalidState(
                "a draft is checked under plain greedy decoding only (no sampling, penalties \
                 or logit bias)"
                    .into(),
            ));
        }
        let max = MAX_DRAFT.min(self.backend.draft_room());
        if draft.is_empty() || draft.len() > max {
            return Err(Error::InvalidArgument(format!(
                "a draft of {} ids (1 to {max} here)",
                draft.len()
            )));
        }
        self.in_vocab(draft, "draft")?;
        if out.len() <= draft.len() {
            return Err(Error::BufferTooSmall(format!(
                "a draft of {} ids writes up to {} ids, capacity {}",
                draft.len(),
                draft.len() + 1,
                out.len()
            )));
        }
        if room <= draft.len() {
            return Err(Error::SequenceFull(format!(
                "a draft of {} ids at position {} needs {} slots, max_seq {}",
                draft.len(),
                self.position,
                draft.len() + 1,
                self.max_seq
            )));
        }
        self.checked_draft(draft, out)
    }

    /// [`Self::step_draft`] after its checks: the backend's step, the statistics, the mirror.
    fn checked_draft(&mut self, draft: &[u32], out: &mut [u32]) -> Result<usize> {
        let done = self.run(|b| b.step_draft(draft, out))?;
        let accepted = out[..done].iter().zip(draft).take_while(|(a, b)| a == b);
        self.speculation.checks += 1;
        self.speculation.drafted += draft.len() as u64;
        self.speculation.accepted += accepted.count() as u64;
        self.after_steps(&out[..done])?;
        Ok(done)
    }

    /// Greedy settings and no logit bias: each id is its logits' argmax, which a draft's check
    /// reproduces row by row.
    fn plain_greedy(&self) -> bool {
        self.greedy && !self.biased
    }

    /// Refuses the first of `ids` (the argument `name`) outside the vocabulary.
    fn in_vocab(&self, ids: &[u32], name: &str) -> Result<()> {
        match ids
            .iter()
            .enumerate()
            .find(|(_, id)| **id as usize >= self.spec.vocab)
        {
            Some((i, id)) => Err(Error::InvalidArgument(format!(
                "{name}[{i}] = {id} is out of range (vocab {})",
                self.spec.vocab
            ))),
            None => Ok(()),
        }
    }

    /// The checks before any step: a pending token, not finished, room in the cache; returns
    /// the room.
    fn steppable(&self) -> Result<usize> {
        if !self.has_token {
            return Err(Error::InvalidState(
                "no pending token: prefill a prompt first".into(),
            ));
        }
        if self.finished {
            return Err(Error::Finished);
        }
        let room = self.max_seq - self.position;
        if room == 0 {
            return Err(Error::SequenceFull(format!(
                "position {} has reached max_seq {}",
                self.position, self.max_seq
            )));
        }
        Ok(room)
    }

    /// The host mirror after steps that wrote `ids`: each fed the pending id and made the
    /// next one pending.
    fn after_steps(&mut self, ids: &[u32]) -> Result<()> {
        self.position += ids.len();
        self.context.extend_from_slice(ids);
        self.finished = self.run(|b| b.finished())?;
        self.check_finite()
    }

    /// The last greedy id.
    pub fn next_token(&mut self) -> Result<u32> {
        self.require_output()?;
        self.run(|b| b.next_token())
    }

    /// Log-probabilities under the last forward's logits: of `id`, and the `n_top` most likely
    /// ids (see [`crate::sampling::logprobs`]). On CUDA this reads the logits back: a call per
    /// step where they are wanted, not in the resident loop.
    pub fn logprobs(&mut self, id: u32, n_top: usize) -> Result<crate::sampling::Logprobs> {
        let mut logits = vec![0f32; self.spec.vocab];
        self.logits(&mut logits)?;
        crate::sampling::logprobs(&logits, id, n_top)
    }

    /// Copies the last forward's logits into `out` (`vocab` values).
    pub fn logits(&mut self, out: &mut [f32]) -> Result<()> {
        if out.len() != self.spec.vocab {
            return Err(Error::InvalidArgument(format!(
                "logits buffer holds {} values, vocab is {}",
                out.len(),
                self.spec.vocab
            )));
        }
        self.require_output()?;
        self.run(|b| b.logits(out))
    }

    /// Tokens in the KV cache for this request (the next write slot), read from the backend.
    pub fn position(&mut self) -> Result<usize> {
        self.run(|b| b.position())
    }

    /// Whether the request produced EOS, read from the backend.
    pub fn finished(&mut self) -> Result<bool> {
        self.run(|b| b.finished())
    }

    /// Diagnostic: true while no KV write ever landed past slot max_seq-1.
    pub fn kv_guard_intact(&mut self) -> Result<bool> {
        self.run(|b| b.kv_guard_intact())
    }

    /// ms the backend spent warming up at load (CUDA: eager probe + graph capture), apart
    /// from the rest of the load; None for the CPU backend.
    pub fn warmup_ms(&self) -> Option<f64> {
        self.backend.warmup_ms()
    }

    /// ms the backend spent uploading the weights at load (CUDA), apart from the rest of the
    /// load; None for the CPU backend.
    pub fn upload_ms(&self) -> Option<f64> {
        self.backend.upload_ms()
    }

    /// Diagnostic: device memory this engine holds (free memory before its load minus free
    /// memory now; None for host backends).
    pub fn device_used_bytes(&mut self) -> Result<Option<usize>> {
        self.run(|b| b.device_used_bytes())
    }

    /// Diagnostic: free device memory in bytes (None for host backends).
    pub fn device_free_bytes(&mut self) -> Result<Option<usize>> {
        self.run(|b| b.device_free_bytes())
    }

    fn require_output(&self) -> Result<()> {
        if self.has_output {
            Ok(())
        } else {
            Err(Error::InvalidState(
                "nothing has run yet: prefill first".into(),
            ))
        }
    }

    /// Runs a backend call; a backend error leaves the host mirror unknown, so it is
    /// resynchronised from the backend where possible.
    /// After a forward that ran: `NonFinite` where the backend saw logits with inf or NaN (the
    /// state moved on as for any step; the ids chosen from such logits mean nothing).
    fn check_finite(&mut self) -> Result<()> {
        match self.backend.take_non_finite() {
            Some(p) => Err(Error::NonFinite(format!(
                "the logits at position {p} hold inf or NaN (weights, activations or a loaded \
                 state's values past f32's range); the position moved on as for any step, reset \
                 to start again"
            ))),
            None => Ok(()),
        }
    }

    fn run<T>(&mut self, f: impl FnOnce(&mut dyn Backend) -> Result<T>) -> Result<T> {
        let result = f(self.backend.as_mut());
        if result.is_err() {
            if let Ok(p) = self.backend.position() {
                self.position = p;
                self.context.truncate(p);
            }
        }
        result
    }
}
