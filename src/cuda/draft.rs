//! A speculative step on the device ([`crate::backend::Backend::step_draft`]): the pending
//! token and a draft fed as one prefill chunk (so one pass over the weights checks every draft
//! id), each row's logits by one lm_head over the chunk's rows and their argmax, then the state
//! set to where greedy steps over the accepted ids would have left it.

use cudarc::driver::CudaSlice;

use super::device::{driver_error, Gpu};
use super::kernels::state;
use super::ops::{Epilogue, GemmMatrix, ARGMAX_SCRATCH};
use super::step::{Activations, CudaBackend};
use crate::error::Result;
use crate::speculate::MAX_DRAFT;

/// Buffers of the speculative step, allocated at its first use: the logits of each row of the
/// chunk, a decode state a row for argmax_logits (its finished flag clear, its position the
/// row's: a non-finite row marks itself), and the argmax's scratch a row (one launch takes
/// every row).
pub(super) struct DraftBuffers {
    logits: CudaSlice<f32>,
    rows_state: CudaSlice<i32>,
    argmax_scratch: CudaSlice<i32>,
}

impl DraftBuffers {
    fn new(gpu: &Gpu, vocab: usize) -> Result<Self> {
        Ok(Self {
            logits: gpu.zeros::<f32>((MAX_DRAFT + 1) * vocab)?,
            rows_state: gpu.zeros::<i32>((MAX_DRAFT + 1) * state::LEN)?,
            argmax_scratch: gpu.zeros::<i32>((MAX_DRAFT + 1) * ARGMAX_SCRATCH)?,
        })
    }
}

impl CudaBackend {
    /// The longest draft this engine's chunk holds beside the pending token (none where the
    /// prompt goes through the decode step a token at a time).
    pub(super) fn draft_capacity(&self) -> usize {
        MAX_DRAFT.min(self.chunk.saturating_sub(1))
    }

    /// [`crate::backend::Backend::step_draft`] on the device.
    pub(super) fn run_draft(&mut self, draft: &[u32], out: &mut [u32]) -> Result<usize> {
        let mut bufs = match self.draft.take() {
            Some(bufs) => bufs,
            None => DraftBuffers::new(&self.ops.gpu, self.spec.vocab)?,
        };
        let kept = self.check_draft(&mut bufs, draft, out);
        self.draft = Some(bufs);
        kept
    }

    /// The forward over the pending token and `draft`, the rows' ids read back, and the state,
    /// the history and the logits of the last row kept written; returns the ids kept.
    fn check_draft(
        &mut self,
        bufs: &mut DraftBuffers,
        draft: &[u32],
        out: &mut [u32],
    ) -> Result<usize> {
        let st = self.settled_state()?;
        let (pos, n, vocab) = (
            st[state::POSITION] as usize,
            draft.len() + 1,
            self.spec.vocab,
        );
        let fed: Vec<i32> = std::iter::once(st[state::TOKEN])
            .chain(draft.iter().map(|&id| id as i32))
            .collect();
        self.position = None;
        self.settled = None;
        let mut rows_state = vec![0i32; n * state::LEN];
        for (i, row) in rows_state.chunks_exact_mut(state::LEN).enumerate() {
            row[state::POSITION] = (pos + i) as i32;
        }
        let stream = &self.ops.gpu.stream;
        stream
            .memcpy_htod(&fed, &mut self.arena.prompt.slice_mut(..n))
            .map_err(driver_error("draft upload"))?;
        stream
            .memcpy_htod(
                &rows_state,
                &mut bufs.rows_state.slice_mut(..n * state::LEN),
            )
            .map_err(driver_error("draft rows' state"))?;
        // Every row's output: no prompt-tail shortcut (last = false), then lm_head over them.
        self.prefill_chunk(0, pos, n, false)?;
        let (ops, s) = (&self.ops, &self.spec);
        let Activations { x, xn, .. } = self.activations();
        let final_norm = self.ptr(&self.model.final_norm);
        ops.rms_rows(x, final_norm, xn, s.hidden, s.rms_eps, n, true)?;
        let lm_head = self.model.lm_head();
        let head = [GemmMatrix {
            m: lm_head.as_ref(&ops.gpu),
            rows: vocab,
            bias: 0,
        }];
        let logits = ops.gpu.ptr(&bufs.logits);
        ops.gemm(
            Epilogue::Store,
            &head,
            s.hidden,
            xn,
            n,
            logits,
            vocab,
            0,
            true,
        )?;
        let (rows_state, scratch) = (
            ops.gpu.ptr(&bufs.rows_state),
            ops.gpu.ptr(&bufs.argmax_scratch),
        );
        let mut argmax = ops.argmax_launch();
        argmax.grid_dim.1 = n as u32;
        let vocab_i = vocab as i32;
        launch!(ops.gpu, &ops.k.argmax_logits, argmax; logits, vocab_i, rows_state, scratch)?;
        let rows = ops.gpu.download(&bufs.rows_state, n * state::LEN)?;

        let rows: Vec<&[i32]> = rows.chunks_exact(state::LEN).collect();
        let ids: Vec<u32> = rows.iter().map(|r| r[state::NEXT_TOKEN] as u32).collect();
        let kept = crate::speculate::kept_rows(draft, &ids, |id| id as i32 == self.eos);
        out[..kept].copy_from_slice(&ids[..kept]);
        if let Some(i) = rows[..kept].iter().position(|r| r[state::NONFINITE] != 0) {
            self.non_finite.get_or_insert(pos + i);
        }
        let last = out[kept - 1] as i32;
        let mut next = [0i32; state::LEN];
        next[state::TOKEN] = last;
        next[state::NEXT_TOKEN] = last;
        next[state::POSITION] = (pos + kept) as i32;
        next[state::VALID_LEN] = (pos + kept) as i32;
        next[state::FINISHED] = (last == self.eos) as i32;
        // The history the penalties read: the ids fed, and the pending one at its position.
        let mut hist = fed[..kept].to_vec();
        hist.push(last);
        let stream = &self.ops.gpu.stream;
        stream
            .memcpy_htod(&next, &mut self.state)
            .map_err(driver_error("draft state"))?;
        stream
            .memcpy_htod(
                &hist,
                &mut self.sampler.history.slice_mut(pos..pos + kept + 1),
            )
            .map_err(driver_error("draft history"))?;
        let kept_row = (kept - 1) * vocab;
        stream
            .memcpy_dtod(
                &bufs.logits.slice(kept_row..kept_row + vocab),
                &mut self.arena.logits,
            )
            .map_err(driver_error("draft logits"))?;
        self.ops.gpu.sync()?;
        self.settled = Some(next);
        self.position = Some(pos + kept);
        Ok(kept)
    }
}
