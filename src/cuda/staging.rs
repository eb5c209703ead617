//! Host-to-device copies of the weights through two page-locked staging buffers.
//!
//! A copy from pageable memory (`cuMemcpyHtoDAsync` from a `Vec`) is staged by the driver
//! itself, one bounce buffer at a time on one thread. Here the host fills one buffer, on every
//! core for a large tensor, while the DMA engine drains the other: the copy runs at the slower
//! of the two, not their sum. The 32B shape's 18.4 GB went up in 2.5–3.4 s pageable, 1.4–1.6 s
//! staged (docs/lab.md, session 35); `DV2_STAGED_UPLOAD=0` takes the pageable copies, as does a
//! host that cannot page-lock the buffers.

use cudarc::driver::{CudaEvent, CudaSlice, DeviceRepr, PinnedHostSlice};

use super::device::{driver_error, Gpu};
use crate::error::Result;

/// Bytes of one staging buffer: two of them page-locked for the whole upload.
const STAGE_BYTES: usize = 32 << 20;

/// Bytes each thread copies into a buffer (a 32 MiB chunk on 16 threads: 2 MiB each); a
/// tensor smaller than this is copied by the calling thread alone.
const PIECE_BYTES: usize = 2 << 20;

/// Element types whose values are their bytes, so a slice of them can be copied as bytes.
///
/// # Safety
/// An implementing type has no padding and every bit pattern of its size is a valid value.
pub unsafe trait Plain: DeviceRepr + Copy {}
// SAFETY: integers and floats: no padding, every bit pattern valid.
unsafe impl Plain for u8 {}
// SAFETY: as above.
unsafe impl Plain for u16 {}
// SAFETY: as above.
unsafe impl Plain for f32 {}

fn as_bytes<T: Plain>(data: &[T]) -> &[u8] {
    // SAFETY: `Plain` types have no padding (their contract); the byte view covers
    // exactly the slice's memory and borrows it for as long as the slice.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data)) }
}

/// The weights' uploads of one model: through the staging buffers, or (`staged` false) each a
/// pageable copy as [`Gpu::upload`] makes it.
pub struct Staging<'g> {
    gpu: &'g Gpu,
    buffers: Option<Buffers>,
}

struct Buffers {
    pinned: [PinnedHostSlice<u8>; 2],
    /// Recorded after the copy out of the buffer of the same index: the host may refill that
    /// buffer once it has fired.
    drained: [CudaEvent; 2],
    next: usize,
}

impl<'g> Staging<'g> {
    pub fn new(gpu: &'g Gpu, staged: bool) -> Result<Self> {
        let pinned = || {
            // SAFETY: the buffer's bytes are written (by `upload`) before any copy reads them.
            unsafe { gpu.ctx.alloc_pinned::<u8>(STAGE_BYTES) }
                .map_err(driver_error("page-locked staging buffer"))
        };
        let event = || {
            gpu.ctx
                .new_event(None)
                .map_err(driver_error("staging event"))
        };
        let buffers = || -> Result<Buffers> {
            Ok(Buffers {
                pinned: [pinned()?, pinned()?],
                drained: [event()?, event()?],
                next: 0,
            })
        };
        // A host that cannot page-lock 64 MiB now still loads, by the pageable copies.
        let buffers = if staged { buffers().ok() } else { None };
        Ok(Self { gpu, buffers })
    }

    /// A new device buffer holding `data`, copied in chunks through the staging buffers. The
    /// copies are in flight on the stream when this returns, ordered before anything launched
    /// after it; dropping the staging waits for them.
    pub fn upload<T: Plain>(&mut self, data: &[T]) -> Result<CudaSlice<T>> {
        let Some(bufs) = self.buffers.as_mut().filter(|_| !data.is_empty()) else {
            return self.gpu.upload(data);
        };
        // SAFETY: every byte of the allocation is written by the copies below, which the
        // stream orders before any kernel that reads it.
        let dst = unsafe { self.gpu.stream.alloc::<T>(data.len()) }
            .map_err(driver_error("allocation"))?;
        let base = self.gpu.ptr(&dst);
        for (i, chunk) in as_bytes(data).chunks(STAGE_BYTES).enumerate() {
            let b = bufs.next;
            bufs.next ^= 1;
            bufs.drained[b]
                .synchronize()
                .map_err(driver_error("staging wait"))?;
            let stage = &mut bufs.pinned[b]
                .as_mut_slice()
                .map_err(driver_error("staging buffer"))?[..chunk.len()];
            crate::par::copy(stage, chunk, PIECE_BYTES);
            // SAFETY: `dst` holds `data`'s bytes from `base`, this chunk at its offset; the
            // staged bytes stay unwritten until `drained[b]`, recorded after this copy, fires.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    base + (i * STAGE_BYTES) as u64,
                    stage,
                    self.gpu.stream.cu_stream(),
                )
            }
            .map_err(driver_error("upload"))?;
            bufs.drained[b]
                .record(&self.gpu.stream)
                .map_err(driver_error("staging event"))?;
        }
        Ok(dst)
    }
}

impl Drop for Buffers {
    /// The page-locked buffers are freed after the copies out of them are done.
    fn drop(&mut self) {
        for event in &self.drained {
            let _ = event.synchronize();
        }
    }
}
