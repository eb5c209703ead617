//! The interface every backend implements (CPU reference, CUDA): its own module, so that the
//! engine and the backends depend on it and not on each other.

use crate::error::Result;
use crate::sampling::{LogitBias, Sampling};
use crate::state::{StateReader, StateWriter, ValueType};

/// What a backend implements. The engine has validated every argument before calling.
pub trait Backend: Send {
    fn name(&self) -> &'static str;
    /// position = valid_len = `position` (at most the current one), finished = false, no
    /// pending token; the KV cache is not cleared: its slots below `position` stay the
    /// request's, the rest are overwritten before attention reads them. 0 starts a new request.
    fn rewind(&mut self, position: usize) -> Result<()>;
    /// Teacher-forces `ids` from the current position; then next_token = token = the id after
    /// the last one (greedy, or drawn under the sampling settings), finished = (next_token ==
    /// eos).
    fn prefill(&mut self, ids: &[u32]) -> Result<()>;
    /// Up to `out.len()` steps (feed token, next_token = argmax or the sampled id, token =
    /// next_token, position += 1, finished |= eos), writing each id; stops after the step that
    /// finishes.
    /// Returns the number of ids written.
    fn step_n(&mut self, out: &mut [u32]) -> Result<usize>;
    /// A speculative step (greedy, no logit bias: the engine checks): feeds the pending token
    /// and then `draft` from the current position in one forward, keeps the longest prefix of
    /// the draft that greedy steps would have fed, and writes the greedy ids those steps give
    /// (the accepted draft ids, then the id after them; through EOS at most) to `out`
    /// (`out.len()` > `draft.len()`), leaving the state as after that many steps. Returns the
    /// number of ids written. `draft.len()` is at most [`Self::draft_room`].
    fn step_draft(&mut self, draft: &[u32], out: &mut [u32]) -> Result<usize>;
    /// The longest draft [`Self::step_draft`] takes.
    fn draft_room(&self) -> usize;
    fn next_token(&mut self) -> Result<u32>;
    /// Copies the last forward's logits (`vocab` values).
    fn logits(&mut self, out: &mut [f32]) -> Result<()>;
    fn position(&mut self) -> Result<usize>;
    fn finished(&mut self) -> Result<bool>;
    /// The sampling settings of this and later requests (validated); a failure leaves the
    /// settings in force unchanged.
    fn set_sampling(&mut self, s: &Sampling) -> Result<()>;
    /// The logit bias of this and later requests (validated against the vocabulary); a
    /// failure leaves the bias in force unchanged.
    fn set_logit_bias(&mut self, bias: &LogitBias) -> Result<()>;
    /// The type its KV cache holds: the type of the values of the state files it saves.
    fn kv_value_type(&self) -> ValueType;
    /// Writes the ids at positions 0..`len` (at most the position) and then their KV slots, in
    /// [`crate::state::file_order`], to `file`; the state is unchanged.
    fn save_state(&mut self, len: usize, file: &mut StateWriter<'_>) -> Result<()>;
    /// Reads `file`'s ids and KV slots into positions 0..n (n = its ids, at most max_seq, the
    /// file checked against the model), then [`Self::rewind`]s to n: a prefill comes next.
    fn load_state(&mut self, file: &mut StateReader<'_>) -> Result<()>;
    /// Diagnostic: true while nothing was written past the last KV slot (backends with a
    /// guard region check it; others have nothing to check).
    fn kv_guard_intact(&mut self) -> Result<bool> {
        Ok(true)
    }
    /// The position of the first forward since the last call whose logits held inf or NaN, if
    /// any (backends that see their logits on the host check each; others report None).
    fn take_non_finite(&mut self) -> Option<usize> {
        None
    }
    /// Diagnostic: free device memory in bytes (None for host backends).
    fn device_free_bytes(&mut self) -> Result<Option<usize>> {
        Ok(None)
    }
    /// Diagnostic: device memory this backend holds, in bytes: free memory on its context
    /// before the load minus free memory now (None for host backends).
    fn device_used_bytes(&mut self) -> Result<Option<usize>> {
        Ok(None)
    }
    /// Timer: ms of the warm-up at load (CUDA: eager probe step + graph capture); None for
    /// backends without one.
    fn warmup_ms(&self) -> Option<f64> {
        None
    }
    /// Timer: ms of the weights' upload at load (CUDA: allocation, copies, each matrix's GEMM
    /// scale); None for backends without one.
    fn upload_ms(&self) -> Option<f64> {
        None
    }
}
