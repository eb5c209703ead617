//! The crate's one error type. Each variant maps to exactly one C status code (see `ffi`).

/// Everything that can go wrong inside decodev2. Messages name the offending value.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A required pointer argument (named) was NULL.
    #[error("null pointer: {0}")]
    NullPointer(&'static str),
    /// A struct passed across the C ABI has an unknown size or version.
    #[error("ABI mismatch: {0}")]
    AbiMismatch(String),
    /// A caller-supplied argument is out of range or malformed.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A model specification breaks an invariant (shapes, head counts, ...).
    #[error("invalid model spec: {0}")]
    InvalidSpec(String),
    /// Input to the NF4 quantizer cannot be encoded (non-finite values, bad length).
    #[error("NF4 quantization: {0}")]
    Quantize(String),
    /// The request has no KV slot left: position reached max_seq.
    #[error("sequence full: {0}")]
    SequenceFull(String),
    /// The call does not fit the engine's state (e.g. step before any prefill).
    #[error("invalid state: {0}")]
    InvalidState(String),
    /// The request produced its EOS token; call reset before stepping again.
    #[error("request finished (EOS produced); reset to start a new request")]
    Finished,
    /// No preset of that name exists.
    #[error("unknown preset: {0}")]
    UnknownPreset(String),
    /// The feature or file kind is not supported (yet).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// Reading a file failed.
    #[error("i/o: {0}")]
    Io(String),
    /// A model file is truncated, malformed or inconsistent.
    #[error("model file: {0}")]
    ModelFile(String),
    /// The requested backend cannot run here (no driver, no device).
    #[error("backend unavailable: {0}")]
    BackendUnavailable(String),
    /// The model, its KV cache or its tables do not fit in device (or host) memory.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// A CUDA driver or NVRTC call failed.
    #[error("cuda: {0}")]
    Cuda(String),
    /// A forward ran but its logits hold inf or NaN (weights, activations or a loaded state's
    /// values past f32's range).
    #[error("non-finite logits: {0}")]
    NonFinite(String),
    /// An output buffer is smaller than the result; the entry reports the size it needs.
    #[error("buffer too small: {0}")]
    BufferTooSmall(String),
    /// A state file is not one, is truncated or extended, or was saved from another model.
    #[error("state file: {0}")]
    StateFile(String),
    /// A bug in decodev2 (a caught panic, a broken internal invariant).
    #[error("internal error: {0}")]
    Internal(String),
}

pub type Result<T> = std::result::Result<T, Error>;

/// A host buffer of `len` default values, or `OutOfMemory` naming `what` instead of the abort
/// an infallible allocation would cause (a caller-chosen max_seq sizes several buffers).
/// Requests larger than the machine's memory (MemTotal + SwapTotal on Linux) are refused
/// before allocating: with overcommit, a reservation can succeed and only fail when touched.
pub fn host_buffer<T: Clone + Default>(len: usize, what: &str) -> Result<Vec<T>> {
    let bytes = len.saturating_mul(std::mem::size_of::<T>());
    let too_big = || {
        Error::OutOfMemory(format!(
            "{what}: {len} elements ({} MiB) do not fit in host memory",
            bytes >> 20
        ))
    };
    if host_memory_bytes().is_some_and(|total| bytes > total) {
        return Err(too_big());
    }
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| too_big())?;
    v.resize(len, T::default());
    Ok(v)
}

/// Physical memory plus swap, from /proc/meminfo, capped by the cgroup's memory limit (a
/// container's /proc/meminfo shows the host's memory, not what the container may use); None
/// where neither is known.
fn host_memory_bytes() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok();
    let kib = |key: &str| -> Option<usize> {
        let line = info.as_ref()?.lines().find(|l| l.starts_with(key))?;
        line.split_whitespace().nth(1)?.parse().ok()
    };
    let physical =
        kib("MemTotal:").map(|total| (total + kib("SwapTotal:").unwrap_or(0)).saturating_mul(1024));
    // cgroup v2, then v1; "max" (or v1's huge sentinel) means no limit.
    let limit = [
        "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    ]
    .iter()
    .find_map(|p| {
        std::fs::read_to_string(p)
            .ok()?
            .trim()
            .parse::<usize>()
            .ok()
    });
    match (physical, limit) {
        (Some(p), Some(l)) => Some(p.min(l)),
        (p, l) => p.or(l),
    }
}
