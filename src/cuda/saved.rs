//! A request's ids and KV slots to and from a state file ([`crate::state`]), through the
//! staging buffers: each layer's slots 0..n are one run of bytes of its cache, and the file's
//! reads overlap the copies of the runs before.

use super::budget::kv_stride;
use super::device::driver_error;
use super::ops::Ops;
use super::staging::{StageBuffers, Staging};
use super::step::CudaBackend;
use crate::backend::Backend;
use crate::error::Result;
use crate::state::{file_order, Kv, StateReader, StateWriter};

/// Bytes of one staging buffer of a state's copies, two of them page-locked at the first save or
/// load and kept by the backend from then on. Page-locking costs time by the byte, and each
/// buffer is a synchronization: an 8k state of the 3B shape loaded (with its last id
/// prefilled) in 50-61 ms on an H100 through 2 or 4 MiB buffers, 56-66 through 1 MiB, 59-68
/// through 8 and 65-71 through 16; a 2k state in 20-22 ms through 2 or 4 MiB, 27 through 8
/// (docs/lab.md, session 70).
const STATE_STAGE_BYTES: usize = 4 << 20;

/// A staging for a state's copies, through the buffers the last one gave back (`kept`), if any.
fn state_staging<'g>(ops: &'g Ops, kept: &mut Option<StageBuffers>) -> Staging<'g> {
    Staging::resume(
        &ops.gpu,
        ops.cfg.staged_upload,
        STATE_STAGE_BYTES,
        kept.take(),
    )
}

impl CudaBackend {
    /// The device address and the bytes of layer `layer`'s slots 0..n in `kv`'s cache (bf16).
    fn layer_run(&self, kv: Kv, layer: usize, n: usize) -> (u64, usize) {
        let kv_dim = self.spec.kv_dim();
        let cache = match kv {
            Kv::Keys => &self.k_cache,
            Kv::Values => &self.v_cache,
        };
        let first = layer * kv_stride(self.max_seq) * kv_dim;
        (self.ptr(cache) + 2 * first as u64, 2 * n * kv_dim)
    }

    /// Writes the history's ids at positions 0..len, then their keys and values (bf16), to
    /// `file`.
    pub(super) fn save_state_to(&mut self, len: usize, file: &mut StateWriter<'_>) -> Result<()> {
        if len == 0 {
            return file.write_ids(&[]);
        }
        let mut ids = vec![0i32; len];
        self.ops
            .gpu
            .stream
            .memcpy_dtoh(&self.sampler.history.slice(..len), &mut ids)
            .map_err(driver_error("history download"))?;
        self.ops.gpu.sync()?;
        file.write_ids(&ids.iter().map(|&id| id as u32).collect::<Vec<_>>())?;
        let mut staging = state_staging(&self.ops, &mut self.state_stage);
        for (kv, layer) in file_order(self.spec.n_layers) {
            let (src, bytes) = self.layer_run(kv, layer, len);
            // SAFETY: `layer_run` gives a range inside the cache, which `self` keeps allocated.
            unsafe { staging.from_device(src, bytes, |chunk| file.write_bf16_bytes(chunk)) }?;
        }
        self.state_stage = staging.finish()?;
        Ok(())
    }

    /// Reads `file`'s keys and values (as bf16) into slots 0..n of each layer and its ids into
    /// the history, then rewinds to n.
    pub(super) fn load_state_from(&mut self, file: &mut StateReader<'_>) -> Result<()> {
        let n = file.ids().len();
        if n > 0 {
            let mut staging = state_staging(&self.ops, &mut self.state_stage);
            for (kv, layer) in file_order(self.spec.n_layers) {
                let (dst, bytes) = self.layer_run(kv, layer, n);
                // SAFETY: `layer_run` gives a range inside the cache, which `self` keeps
                // allocated; no kernel runs on it before the rewind below synchronizes.
                unsafe { staging.to_device(dst, bytes, |_, stage| file.read_bf16_bytes(stage)) }?;
            }
            self.state_stage = staging.finish()?;
            let ids: Vec<i32> = file.ids().iter().map(|&id| id as i32).collect();
            self.ops
                .gpu
                .stream
                .memcpy_htod(&ids, &mut self.sampler.history.slice_mut(..n))
                .map_err(driver_error("history upload"))?;
        }
        // rewind synchronizes the stream: the host's copies above are read by then.
        self.rewind(n)
    }
}
