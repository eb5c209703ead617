//! Copies between the host and the device through two page-locked staging buffers: the weights
//! at load, a state file's KV slots ([`crate::state`]).
//!
//! A copy from pageable memory (`cuMemcpyHtoDAsync` from a `Vec`) is staged by the driver
//! itself, one bounce buffer at a time on one thread. Here the host fills one buffer (on every
//! core for a large tensor, or by a file's read) while the DMA engine drains the other: the
//! copy runs at the slower of the two, not their sum. The 32B shape's 18.4 GB went up in
//! 2.5–3.4 s pageable, 1.4–1.6 s staged (docs/lab.md, session 35); `DV2_STAGED_UPLOAD=0` takes
//! the pageable copies for the weights, as does a host that cannot page-lock the buffers.

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DeviceRepr, PinnedHostSlice};

use super::device::{driver_error, Gpu};
use crate::error::Result;

/// Bytes of one staging buffer of the weights' upload: two of them page-locked for the whole
/// upload.
pub const WEIGHT_STAGE_BYTES: usize = 32 << 20;

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

/// Copies through the staging buffers, or (`staged` false, or the host refused to page-lock
/// them) each a pageable copy.
pub struct Staging<'g> {
    gpu: &'g Gpu,
    buffers: Option<StageBuffers>,
    stage_bytes: usize,
}

/// The two page-locked buffers of a [`Staging`], which a holder may keep between stagings of
/// the same size ([`Staging::resume`], [`Staging::finish`]).
pub struct StageBuffers {
    pinned: [PinnedHostSlice<u8>; 2],
    /// Recorded after the copy out of (an upload) or into (a download) the buffer of the same
    /// index: the host may refill or read that buffer once it has fired.
    drained: [CudaEvent; 2],
    next: usize,
}

impl<'g> Staging<'g> {
    /// Two buffers of `stage_bytes` each, page-locked where `staged`.
    pub fn new(gpu: &'g Gpu, staged: bool, stage_bytes: usize) -> Self {
        Self::resume(gpu, staged, stage_bytes, None)
    }

    /// As [`Self::new`], through `kept` (buffers of `stage_bytes` that an earlier staging's
    /// [`Self::finish`] gave back) where `staged` and given: page-locking costs time by the
    /// byte, each time.
    pub fn resume(
        gpu: &'g Gpu,
        staged: bool,
        stage_bytes: usize,
        kept: Option<StageBuffers>,
    ) -> Self {
        let buffers = match kept {
            _ if !staged => None,
            Some(kept) if kept.pinned[0].len() == stage_bytes => Some(kept),
            // A host that cannot page-lock the buffers now still copies, by the pageable copies.
            _ => StageBuffers::new(gpu, stage_bytes).ok(),
        };
        Self {
            gpu,
            buffers,
            stage_bytes,
        }
    }

    /// A new device buffer holding `data`, copied in chunks through the staging buffers. The
    /// copies are in flight on the stream when this returns, ordered before anything launched
    /// after it; dropping the staging waits for them.
    pub fn upload<T: Plain>(&mut self, data: &[T]) -> Result<CudaSlice<T>> {
        if self.buffers.is_none() || data.is_empty() {
            return self.gpu.upload(data);
        }
        // SAFETY: every byte of the allocation is written by the copies below, which the
        // stream orders before any kernel that reads it.
        let dst = unsafe { self.gpu.stream.alloc::<T>(data.len()) }
            .map_err(driver_error("allocation"))?;
        let bytes = as_bytes(data);
        let fill = |at: usize, stage: &mut [u8]| {
            crate::par::copy(stage, &bytes[at..at + stage.len()], PIECE_BYTES);
            Ok(())
        };
        // SAFETY: `dst`, just allocated on this context, holds `bytes.len()` bytes; the caller
        // owns it from here, and the stream orders the copies before anything it launches.
        unsafe { self.to_device(self.gpu.ptr(&dst), bytes.len(), fill) }?;
        Ok(dst)
    }

    /// Copies `len` bytes to the device memory at `dst`, a buffer at a time: `fill(at, stage)`
    /// writes the bytes at offset `at` of the `len` into `stage`. With the page-locked buffers
    /// the copies are in flight on the stream when this returns (dropping the staging waits for
    /// them); without, each is done before the next fill.
    ///
    /// # Safety
    /// `dst .. dst + len` is device memory of this staging's context that nothing else reads or
    /// writes until the stream is past the copies, and stays allocated until then.
    pub unsafe fn to_device(
        &mut self,
        dst: u64,
        len: usize,
        mut fill: impl FnMut(usize, &mut [u8]) -> Result<()>,
    ) -> Result<()> {
        let stream = &self.gpu.stream;
        let mut pageable = Vec::new();
        for at in (0..len).step_by(self.stage_bytes) {
            let size = self.stage_bytes.min(len - at);
            // The buffer to fill, and the event its copy records (none for pageable memory,
            // whose copy is waited for instead).
            let (stage, drained): (&mut [u8], _) = match self.buffers.as_mut() {
                Some(StageBuffers {
                    pinned,
                    drained,
                    next,
                }) => {
                    let b = *next;
                    *next ^= 1;
                    drained[b]
                        .synchronize()
                        .map_err(driver_error("staging wait"))?;
                    let stage = pinned[b]
                        .as_mut_slice()
                        .map_err(driver_error("staging buffer"))?;
                    (&mut stage[..size], Some(&drained[b]))
                }
                None => {
                    pageable.resize(size, 0);
                    (&mut pageable[..], None)
                }
            };
            fill(at, stage)?;
            // SAFETY: this chunk lies inside the `len` bytes from `dst` (this function's
            // contract); the staged bytes stay unwritten until `drained`, recorded after this
            // copy, fires, or (pageable) until the synchronize below.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    dst + at as u64,
                    &*stage,
                    stream.cu_stream(),
                )
            }
            .map_err(driver_error("upload"))?;
            match drained {
                Some(event) => event
                    .record(stream)
                    .map_err(driver_error("staging event"))?,
                None => self.gpu.sync()?,
            }
        }
        Ok(())
    }

    /// Copies `len` bytes of the device memory at `src` to the host, a buffer at a time, after
    /// everything on the stream before it: `take(stage)` is given each chunk in order once it
    /// has arrived. With the page-locked buffers the next chunk's copy runs while `take` has
    /// this one.
    ///
    /// # Safety
    /// `src .. src + len` is device memory of this staging's context, allocated until this
    /// returns.
    pub unsafe fn from_device(
        &mut self,
        src: u64,
        len: usize,
        mut take: impl FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let chunks: Vec<(u64, usize)> = (0..len)
            .step_by(self.stage_bytes)
            .map(|at| (src + at as u64, self.stage_bytes.min(len - at)))
            .collect();
        let stream = &self.gpu.stream;
        let Some(buffers) = self.buffers.as_mut() else {
            let mut pageable = Vec::new();
            for (from, size) in chunks {
                pageable.resize(size, 0);
                // SAFETY: the chunk lies inside the `len` bytes from `src` (this function's
                // contract); the synchronize below ends the copy before `pageable` is read.
                unsafe {
                    cudarc::driver::result::memcpy_dtoh_async(
                        &mut pageable[..],
                        from,
                        stream.cu_stream(),
                    )
                }
                .map_err(driver_error("download"))?;
                self.gpu.sync()?;
                take(&pageable)?;
            }
            return Ok(());
        };
        // Chunk i goes through buffer i % 2; chunk i + 1's copy starts before the host takes
        // chunk i, into the buffer the host took chunk i - 1 from.
        let start = |buffers: &mut StageBuffers, i: usize| match chunks.get(i) {
            // SAFETY: the chunk lies inside the `len` bytes from `src` (this function's
            // contract); the host reads its buffer only through `arrived`.
            Some(&(from, size)) => unsafe { buffers.start_download(i % 2, from, size, stream) },
            None => Ok(()),
        };
        start(buffers, 0)?;
        for (i, &(_, size)) in chunks.iter().enumerate() {
            start(buffers, i + 1)?;
            take(buffers.arrived(i % 2, size)?)?;
        }
        Ok(())
    }

    /// Waits for the copies through the page-locked buffers, then gives the buffers back (None
    /// for pageable copies) for a later [`Self::resume`].
    pub fn finish(self) -> Result<Option<StageBuffers>> {
        if let Some(buffers) = &self.buffers {
            for event in &buffers.drained {
                event.synchronize().map_err(driver_error("staging wait"))?;
            }
        }
        Ok(self.buffers)
    }
}

impl StageBuffers {
    fn new(gpu: &Gpu, stage_bytes: usize) -> Result<Self> {
        let pinned = || {
            // SAFETY: the buffer's bytes are written (by `to_device`'s fill) before any copy
            // reads them, and read (by `from_device`) only after the copy into them is done.
            unsafe { gpu.ctx.alloc_pinned::<u8>(stage_bytes) }
                .map_err(driver_error("page-locked staging buffer"))
        };
        let event = || {
            gpu.ctx
                .new_event(None)
                .map_err(driver_error("staging event"))
        };
        Ok(Self {
            pinned: [pinned()?, pinned()?],
            drained: [event()?, event()?],
            next: 0,
        })
    }

    /// Starts the copy of `size` bytes at `from` into buffer `b`, after everything on `stream`
    /// before it (an upload's copies out of the buffer included).
    ///
    /// # Safety
    /// `from .. from + size` is device memory of the buffers' context, allocated until the
    /// copy is done; the host neither reads nor writes buffer `b` until [`Self::arrived`].
    unsafe fn start_download(
        &mut self,
        b: usize,
        from: u64,
        size: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        let stage = self.pinned[b]
            .as_mut_slice()
            .map_err(driver_error("staging buffer"))?;
        // SAFETY: the range is device memory allocated until the copy is done (this
        // function's contract); `arrived` waits for the copy before the host reads `stage`.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut stage[..size], from, stream.cu_stream())
        }
        .map_err(driver_error("download"))?;
        self.drained[b]
            .record(stream)
            .map_err(driver_error("staging event"))
    }

    /// The first `size` bytes of buffer `b` once the copy [`Self::start_download`] started
    /// into it is done.
    fn arrived(&self, b: usize, size: usize) -> Result<&[u8]> {
        self.drained[b]
            .synchronize()
            .map_err(driver_error("staging wait"))?;
        let stage = self.pinned[b]
            .as_slice()
            .map_err(driver_error("staging buffer"))?;
        Ok(&stage[..size])
    }
}

impl Drop for StageBuffers {
    /// The page-locked buffers are freed after the copies out of or into them are done.
    fn drop(&mut self) {
        for event in &self.drained {
            let _ = event.synchronize();
        }
    }
}
