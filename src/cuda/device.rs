//! The CUDA device: driver probe, one context and one stream, allocation helpers.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use cudarc::driver::sys::{
    cuLaunchKernelEx, CUdevice_attribute, CUgraphInstantiate_flags, CUlaunchAttribute,
    CUlaunchAttributeID, CUlaunchAttributeValue, CUlaunchConfig, CUstreamCaptureMode,
};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
    DriverError, LaunchConfig, ValidAsZeroBits,
};

use crate::config::Config;
use crate::error::{Error, Result};

/// Maps a driver error to ours; out-of-memory keeps its own status.
pub fn driver_error(what: &str) -> impl FnOnce(DriverError) -> Error + '_ {
    move |e| {
        let text = format!("{what}: {e:?}");
        if text.contains("OUT_OF_MEMORY") {
            Error::OutOfMemory(text)
        } else {
            Error::Cuda(text)
        }
    }
}

/// True when libcuda can be loaded. cudarc panics on a missing library, so ask inside
/// `catch_unwind`.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda.
    catch_unwind(|| unsafe { cudarc::driver::sys::is_culib_present() }).unwrap_or(false)
}

/// What of the device the kernels use, chosen from its compute capability, its shared-memory
/// limit and the switches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Thread-block clusters and distributed shared memory (sm_90 and later; `DV2_HOPPER=0`
    /// off): the long-context attention, the GEMM's K split across CTAs and the column
    /// kernels' pairs.
    pub clusters: bool,
    /// Programmatic dependent launch (sm_90 and later; `DV2_PDL=0` or `DV2_HOPPER=0` off):
    /// each kernel may start while the one before it drains; the kernels' `pdl_wait()` orders
    /// their reads and writes after it (kernels/common.cuh).
    pub pdl: bool,
    /// Shared memory one CTA may opt into, in bytes (static and dynamic together).
    pub max_smem_per_cta: usize,
}

impl Capabilities {
    pub fn of(major: i32, max_smem_per_cta: usize, cfg: &Config) -> Self {
        let hopper = major >= 9 && cfg.hopper;
        Self {
            clusters: hopper,
            pdl: hopper && cfg.pdl,
            max_smem_per_cta,
        }
    }
}

/// One device with its context and the stream every launch goes to.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub caps: Capabilities,
}

/// A kernel argument as the driver takes it: the address of the value.
pub fn kernel_arg<T: DeviceRepr>(value: &T) -> *mut c_void {
    value as *const T as *mut c_void
}

/// The oldest driver API the library calls: CUDA 12.0 (every kernel launches through
/// cuLaunchKernelEx). The library builds against cudarc's 12.0 bindings too (feature `cuda-12`,
/// checked by .ci/run), so it calls no entry point that a 12.0 driver lacks.
pub const MIN_DRIVER_VERSION: i32 = 12000;

/// The driver's CUDA version as cuDriverGetVersion gives it (12080: 12.8), refused with a
/// message naming both versions below [`MIN_DRIVER_VERSION`].
fn check_driver_version() -> Result<()> {
    let mut version = 0;
    // SAFETY: writes one int; callable before cuInit.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(driver_error("cuDriverGetVersion"))?;
    if version < MIN_DRIVER_VERSION {
        let v = |v: i32| format!("{}.{}", v / 1000, v % 1000 / 10);
        return Err(Error::BackendUnavailable(format!(
            "the CUDA driver here implements CUDA {}; decodev2 needs {} or later (update the \
             NVIDIA driver)",
            v(version),
            v(MIN_DRIVER_VERSION)
        )));
    }
    Ok(())
}

/// A launch attribute `id` whose value `set` fills in from all zeros.
fn launch_attribute(
    id: CUlaunchAttributeID,
    set: impl FnOnce(&mut CUlaunchAttributeValue),
) -> CUlaunchAttribute {
    // SAFETY: the attribute value is a C union of plain integers; all zero bits is valid.
    let mut value: CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
    set(&mut value);
    CUlaunchAttribute {
        id,
        pad: [0; 4],
        value,
    }
}

impl Gpu {
    /// Opens device `ordinal` with the capabilities `cfg` allows ([`Capabilities::of`]);
    /// `BackendUnavailable` when there is no driver, a driver older than
    /// [`MIN_DRIVER_VERSION`], or no such device.
    pub fn open(ordinal: usize, cfg: &Config) -> Result<Self> {
        if !driver_present() {
            return Err(Error::BackendUnavailable(
                "no CUDA driver (libcuda.so.1 not found)".into(),
            ));
        }
        let open = || -> Result<Self> {
            check_driver_version()?;
            let count = CudaContext::device_count().map_err(driver_error("cuDeviceGetCount"))?;
            if ordinal >= count.max(0) as usize {
                return Err(Error::BackendUnavailable(format!(
                    "CUDA device {ordinal} requested, {count} present"
                )));
            }
            let ctx = CudaContext::new(ordinal).map_err(driver_error("cuCtxCreate"))?;
            // Graph capture needs one stream and no cross-stream event bookkeeping; this must
            // happen before the first allocation.
            // SAFETY: no allocation or stream exists yet on this context.
            unsafe { ctx.disable_event_tracking() };
            let stream = ctx.new_stream().map_err(driver_error("cuStreamCreate"))?;
            let (major, _) = ctx
                .compute_capability()
                .map_err(driver_error("compute capability"))?;
            let smem = ctx
                .attribute(
                    CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                )
                .map_err(driver_error("shared memory per block"))?;
            Ok(Self {
                ctx,
                stream,
                caps: Capabilities::of(major, smem.max(0) as usize, cfg),
            })
        };
        catch_unwind(AssertUnwindSafe(open)).unwrap_or_else(|_| {
            Err(Error::BackendUnavailable(
                "the CUDA driver lacks a required entry point".into(),
            ))
        })
    }

    /// "sm_90" etc.
    pub fn arch(&self) -> Result<String> {
        let (major, minor) = self
            .ctx
            .compute_capability()
            .map_err(driver_error("compute capability"))?;
        Ok(format!("sm_{major}{minor}"))
    }

    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "unknown device".into())
    }

    /// (free, total) bytes of device memory.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.ctx
            .mem_get_info()
            .map_err(driver_error("cuMemGetInfo"))
    }

    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>> {
        self.stream.clone_htod(data).map_err(driver_error("upload"))
    }

    /// `len` u16 (at least one), every one `value`: a device memset, no host buffer (the KV
    /// cache's poison is gigabytes at long contexts).
    pub fn filled_u16(&self, len: usize, value: u16) -> Result<CudaSlice<u16>> {
        let len = len.max(1);
        // SAFETY: the memset below writes every element before anything reads one.
        let buf = unsafe { self.stream.alloc::<u16>(len) }.map_err(driver_error("allocation"))?;
        // SAFETY: `buf` holds `len` u16 on this context; the memset is ordered on the stream
        // the allocation was made on.
        unsafe {
            cudarc::driver::sys::cuMemsetD16Async(
                self.ptr(&buf),
                value,
                len,
                self.stream.cu_stream(),
            )
        }
        .result()
        .map_err(driver_error("memset"))?;
        Ok(buf)
    }

    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<CudaSlice<T>> {
        self.stream
            .alloc_zeros(len.max(1))
            .map_err(driver_error("allocation"))
    }

    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        src: &CudaSlice<T>,
        len: usize,
    ) -> Result<Vec<T>> {
        let mut out = vec![T::default(); len];
        self.stream
            .memcpy_dtoh(&src.slice(..len), &mut out)
            .map_err(driver_error("download"))?;
        self.sync()?;
        Ok(out)
    }

    pub fn sync(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(driver_error("stream synchronize"))
    }

    /// Launches `f` on the stream, with programmatic dependent launch when [`Capabilities::pdl`].
    ///
    /// # Safety
    /// `args` holds one [`kernel_arg`] per parameter of `f`, in order and of the declared
    /// types; every device address among them points to a live buffer large enough for the
    /// shapes passed.
    pub unsafe fn launch(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        self.launch_in_clusters(f, cfg, (1, 1, 1), args)
    }

    /// [`Self::launch`] in thread-block clusters of `cluster` CTAs along (x, y, z) ((1, 1, 1):
    /// no clusters; each grid dimension must be a multiple of the cluster's).
    ///
    /// # Safety
    /// As [`Self::launch`].
    pub unsafe fn launch_in_clusters(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        cluster: (u32, u32, u32),
        args: &mut [*mut c_void],
    ) -> Result<()> {
        if cluster == (1, 1, 1) {
            return self.launch_with(f, cfg, None, args);
        }
        let attr = launch_attribute(
            CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
            |v| {
                v.clusterDim.x = cluster.0;
                v.clusterDim.y = cluster.1;
                v.clusterDim.z = cluster.2;
            },
        );
        self.launch_with(f, cfg, Some(attr), args)
    }

    /// [`Self::launch`] as a cooperative kernel: the driver makes every CTA of the grid
    /// resident at once (or fails the launch), so that the CTAs may wait on each other.
    ///
    /// # Safety
    /// As [`Self::launch`].
    pub unsafe fn launch_cooperative(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        let attr = launch_attribute(CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE, |v| {
            v.cooperative = 1
        });
        self.launch_with(f, cfg, Some(attr), args)
    }

    /// cuLaunchKernelEx with programmatic dependent launch where [`Gpu::pdl`] and the
    /// attribute `extra`.
    ///
    /// # Safety
    /// As [`Self::launch`].
    unsafe fn launch_with(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        extra: Option<CUlaunchAttribute>,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(driver_error("bind context"))?;
        let pdl = launch_attribute(
            CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            |v| v.programmaticStreamSerializationAllowed = 1,
        );
        // The attributes that apply, first `count` of the array (no allocation per launch).
        let (mut attrs, count) = match (self.caps.pdl, extra) {
            (true, Some(e)) => ([pdl, e], 2),
            (true, None) => ([pdl, pdl], 1),
            (false, Some(e)) => ([e, e], 1),
            (false, None) => ([pdl, pdl], 0),
        };
        let config = CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: if count == 0 {
                std::ptr::null_mut()
            } else {
                attrs.as_mut_ptr()
            },
            numAttrs: count,
        };
        // SAFETY: `config` and the attributes it points to outlive the call; `args` is as this
        // function's contract requires; the context is bound to this thread.
        cuLaunchKernelEx(
            &config,
            f.cu_function(),
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
        .result()
        .map_err(driver_error("kernel launch"))
    }

    /// The work `record` enqueues on the stream, captured into a graph (nothing runs).
    pub fn capture(&self, record: impl FnOnce() -> Result<()>) -> Result<CudaGraph> {
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(driver_error("begin capture"))?;
        let recorded = record();
        let graph = self
            .stream
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(driver_error("end capture"));
        recorded?;
        graph?.ok_or_else(|| Error::Cuda("stream capture produced no graph".into()))
    }

    /// Raw device address of a buffer, for kernel arguments. Event tracking is off, so this
    /// records nothing.
    pub fn ptr<T>(&self, buf: &CudaSlice<T>) -> u64 {
        buf.device_ptr(&self.stream).0
    }
}
