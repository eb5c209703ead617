//! The C ABI: the only place with `extern "C"`. Thin wrappers over [`crate::engine`].
//!
//! Every entry runs inside `catch_unwind` (src/panics.rs): a panic comes back as
//! `DV2_ERR_INTERNAL` with a message, never unwinds into C, never aborts and prints nothing.
//! Every pointer is null-checked and every length and id range-checked before use. A failing
//! call stores its message for `dv2_last_error()` on the calling thread and, where the docs
//! say so, leaves the handle exactly as it was.

#![allow(non_camel_case_types)] // C names, as they appear in the header

use std::cell::RefCell;
use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::Mutex;

use crate::chat::Message;
use crate::engine::{BackendKind, Engine, EngineOptions};
use crate::error::{Error, Result};
use crate::panics;
use crate::sampling::Sampling;

/// Status code of every call. Numbers are stable and never reused.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum dv2_status {
    /// Success.
    DV2_OK = 0,
    /// A required pointer argument was NULL. The handle is unchanged.
    DV2_ERR_NULL_POINTER = 1,
    /// An argument is out of range (id < 0 or >= vocab, n = 0, buffer too small, ...).
    /// The handle is unchanged.
    DV2_ERR_INVALID_ARGUMENT = 2,
    /// The call does not fit the handle's state (e.g. step before any prefill).
    /// The handle is unchanged.
    DV2_ERR_INVALID_STATE = 3,
    /// No KV slot left: position + n would pass max_seq. The handle is unchanged.
    DV2_ERR_SEQUENCE_FULL = 4,
    /// The request already produced EOS; call dv2_reset to start a new one.
    /// The handle is unchanged.
    DV2_FINISHED = 5,
    /// No preset of that name.
    DV2_ERR_UNKNOWN_PRESET = 6,
    /// The file format or feature is not supported (yet).
    DV2_ERR_UNSUPPORTED = 7,
    /// A file could not be read (missing, permissions, ...).
    DV2_ERR_IO = 8,
    /// A model file is truncated, malformed or inconsistent.
    DV2_ERR_MODEL_FILE = 9,
    /// The requested backend cannot run here (no CUDA driver or device).
    DV2_ERR_BACKEND_UNAVAILABLE = 10,
    /// The model, its KV cache (max_seq) or its tables do not fit in device or host memory;
    /// the message gives the sizes.
    DV2_ERR_OUT_OF_MEMORY = 11,
    /// A CUDA driver or NVRTC call failed.
    DV2_ERR_CUDA = 12,
    /// A model's hyper-parameters break an invariant.
    DV2_ERR_INVALID_SPEC = 13,
    /// Weights could not be quantized (non-finite values).
    DV2_ERR_QUANTIZE = 14,
    /// A struct's `struct_size` does not match this library's.
    DV2_ERR_ABI_MISMATCH = 15,
    /// The forward ran (the position moved on) but its logits hold inf or NaN: the model's
    /// weights or activations, or a loaded state's values, passed f32's range. The ids it chose
    /// mean nothing; reset. Also dv2_logprobs on such logits.
    DV2_ERR_NON_FINITE = 16,
    /// An output buffer is smaller than the result; the call wrote the size it needs (ids or
    /// bytes) to its count out-pointer and nothing else. The handle is unchanged.
    DV2_ERR_BUFFER_TOO_SMALL = 17,
    /// A state file (dv2_state_save_file) is not one, is truncated or extended, or was saved
    /// from another model; the message says which. The handle is unchanged.
    DV2_ERR_STATE_FILE = 18,
    /// A bug in decodev2 (a caught panic). A handle it happened on is poisoned: every later
    /// call on it returns this status; free it.
    DV2_ERR_INTERNAL = 99,
}
use dv2_status::*;

fn status_of(e: &Error) -> dv2_status {
    match e {
        Error::NullPointer(_) => DV2_ERR_NULL_POINTER,
        Error::AbiMismatch(_) => DV2_ERR_ABI_MISMATCH,
        Error::InvalidArgument(_) => DV2_ERR_INVALID_ARGUMENT,
        Error::InvalidState(_) => DV2_ERR_INVALID_STATE,
        Error::InvalidSpec(_) => DV2_ERR_INVALID_SPEC,
        Error::Quantize(_) => DV2_ERR_QUANTIZE,
        Error::SequenceFull(_) => DV2_ERR_SEQUENCE_FULL,
        Error::Finished => DV2_FINISHED,
        Error::UnknownPreset(_) => DV2_ERR_UNKNOWN_PRESET,
        Error::Unsupported(_) => DV2_ERR_UNSUPPORTED,
        Error::Io(_) => DV2_ERR_IO,
        Error::ModelFile(_) => DV2_ERR_MODEL_FILE,
        Error::BackendUnavailable(_) => DV2_ERR_BACKEND_UNAVAILABLE,
        Error::OutOfMemory(_) => DV2_ERR_OUT_OF_MEMORY,
        Error::Cuda(_) => DV2_ERR_CUDA,
        Error::NonFinite(_) => DV2_ERR_NON_FINITE,
        Error::BufferTooSmall(_) => DV2_ERR_BUFFER_TOO_SMALL,
        Error::StateFile(_) => DV2_ERR_STATE_FILE,
        Error::Internal(_) => DV2_ERR_INTERNAL,
    }
}

/// Limits of the ABI.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum dv2_limits {
    /// The most alternatives dv2_logprobs gives per call (OpenAI's `top_logprobs` limit).
    DV2_MAX_TOP_LOGPROBS = 20,
    /// The most ids dv2_set_logit_bias takes.
    DV2_MAX_LOGIT_BIAS = 1024,
    /// The longest draft dv2_set_speculation takes.
    DV2_MAX_DRAFT = 15,
}
use dv2_limits::{DV2_MAX_DRAFT, DV2_MAX_LOGIT_BIAS, DV2_MAX_TOP_LOGPROBS};
const _: () = assert!(DV2_MAX_DRAFT as usize == crate::engine::MAX_DRAFT);
const _: () = assert!(DV2_MAX_TOP_LOGPROBS as usize == crate::sampling::MAX_TOP_LOGPROBS);
const _: () = assert!(DV2_MAX_LOGIT_BIAS as usize == crate::sampling::MAX_LOGIT_BIAS);

/// Backend choice in `dv2_options.backend`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum dv2_backend {
    /// CUDA when a device is present and the model fits, else CPU.
    DV2_BACKEND_AUTO = 0,
    /// The CPU reference backend.
    DV2_BACKEND_CPU = 1,
    /// CUDA; fails with DV2_ERR_BACKEND_UNAVAILABLE when there is no driver or device.
    DV2_BACKEND_CUDA = 2,
}

/// Log levels passed to the log callback.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum dv2_log_level {
    DV2_LOG_ERROR = 0,
    DV2_LOG_WARN = 1,
    DV2_LOG_INFO = 2,
    DV2_LOG_DEBUG = 3,
}

/// Flags of dv2_tokenize (OR them together).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum dv2_tokenize_flags {
    /// BOS (or what else the model file asks for) before the text.
    DV2_TOKENIZE_ADD_SPECIAL = 1,
    /// Special-token text in the input (e.g. `<|im_start|>`) becomes its special id; without
    /// it that text is tokenized as ordinary text.
    DV2_TOKENIZE_PARSE_SPECIAL = 2,
}

/// Flags of dv2_detokenize.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum dv2_detokenize_flags {
    /// Control tokens (BOS, EOS, chat markers) are left out of the text.
    DV2_DETOKENIZE_SKIP_SPECIAL = 1,
}

/// Sampling settings for dv2_set_sampling. Start from dv2_sampling_default() (greedy), then
/// change fields. Applied in this order: the penalties over the request's last
/// `penalty_last_n` ids (prompt included; -1: all), then temperature, top-k, top-p, min-p,
/// and a draw from what is left, renormalized: a Gumbel-max draw with noise from
/// Philox4x32-10 keyed by `seed` and counted by the position the id takes and the id (so the
/// ids depend on the seed, not on how steps are batched). Each truncation keeps the ids at or
/// above a logit: ids of equal logits are kept or dropped together. Temperature 0 is the
/// greedy argmax. On CUDA the draw runs inside the step's graph.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct dv2_sampling {
    /// sizeof(dv2_sampling); set by dv2_sampling_default().
    pub struct_size: u32,
    /// 0: greedy; else logits / temperature before the softmax. Finite, >= 0.
    pub temperature: f32,
    /// Keep the ids whose logit is at least the k-th largest; 0: all. >= 0.
    pub top_k: i32,
    /// Keep the most likely ids until their probabilities sum to at least top_p; in (0, 1].
    pub top_p: f32,
    /// Keep the ids at least min_p times as likely as the most likely; in [0, 1].
    pub min_p: f32,
    /// A seen id's logit divided by it where positive, multiplied where not; 1: none. > 0.
    pub repeat_penalty: f32,
    /// Subtracted once from a seen id's logit; 0: none.
    pub presence_penalty: f32,
    /// Subtracted per occurrence; 0: none.
    pub frequency_penalty: f32,
    /// The window of the penalties in ids; 0: none; -1: the whole request.
    pub penalty_last_n: i32,
    pub seed: u64,
}

/// The special tokens dv2_token_special names.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum dv2_special_token {
    DV2_TOKEN_BOS = 0,
    DV2_TOKEN_EOS = 1,
    /// End of turn (chat models), where the file names one apart from EOS.
    DV2_TOKEN_EOT = 2,
    DV2_TOKEN_PAD = 3,
}

/// One message of a conversation for dv2_chat_apply_template: NUL-terminated UTF-8 strings.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct dv2_chat_message {
    /// "system", "user", "assistant", ... as the template knows them.
    pub role: *const c_char,
    pub content: *const c_char,
}

/// Load options. Always start from dv2_options_default(), then change fields.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct dv2_options {
    /// sizeof(dv2_options); set by dv2_options_default(). Calls reject any other value with
    /// DV2_ERR_ABI_MISMATCH, so a host built against another header fails cleanly.
    pub struct_size: u32,
    /// A dv2_backend value.
    pub backend: i32,
    /// KV capacity in tokens; 0 = the model's own max_seq (on CUDA, where that does not fit
    /// the device, the largest multiple of 256 that does).
    pub max_seq: i32,
    /// Token id that ends a request (sets finished); -1 = none; -2 = the model file's own
    /// (its end-of-turn token where it names one, else its EOS; dv2_load only).
    pub eos_id: i32,
    /// CUDA device ordinal (0 = first device).
    pub device: i32,
}

/// Model facts, filled by dv2_get_model_info(). The host sets `struct_size` to
/// sizeof(dv2_model_info) before the call (`dv2_model_info info = {0}; info.struct_size =
/// sizeof info;`), so that a
/// host built against another version of this struct fails cleanly.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct dv2_model_info {
    pub struct_size: u32,
    pub n_layers: i32,
    pub hidden: i32,
    pub n_q_heads: i32,
    pub n_kv_heads: i32,
    pub head_dim: i32,
    pub intermediate: i32,
    /// Token ids are 0 .. vocab-1.
    pub vocab: i32,
    /// KV capacity of this handle in tokens.
    pub max_seq: i32,
    /// The backend actually running (a dv2_backend value, never AUTO).
    pub backend: i32,
}

impl Default for dv2_model_info {
    /// Zeros, with `struct_size` set.
    fn default() -> Self {
        Self {
            struct_size: std::mem::size_of::<Self>() as u32,
            n_layers: 0,
            hidden: 0,
            n_q_heads: 0,
            n_kv_heads: 0,
            head_dim: 0,
            intermediate: 0,
            vocab: 0,
            max_seq: 0,
            backend: 0,
        }
    }
}

/// An engine: one model, one request at a time. Opaque; create with dv2_load or
/// dv2_load_synthetic, free with dv2_free. One thread at a time per handle; separate
/// handles may be used from separate threads.
pub struct dv2_engine {
    engine: Engine,
    poisoned: bool,
}

/// Log callback: `level` is a dv2_log_level, `message` a NUL-terminated UTF-8 string valid
/// only during the call.
pub type dv2_log_callback =
    Option<unsafe extern "C" fn(level: i32, message: *const c_char, user_data: *mut c_void)>;

struct LogSink {
    callback: dv2_log_callback,
    user_data: usize,
}

static LOG: Mutex<LogSink> = Mutex::new(LogSink {
    callback: None,
    user_data: 0,
});

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Calls the host's log callback, if any. The lock is released before the call, so the
/// callback may call back into the library (dv2_set_log_callback included).
fn log(level: dv2_log_level, message: &str) {
    let (callback, user_data) = {
        let sink = LOG.lock().unwrap_or_else(|p| p.into_inner());
        (sink.callback, sink.user_data)
    };
    if let Some(cb) = callback {
        let text = CString::new(message.replace('\0', " ")).unwrap_or_default();
        // SAFETY: the host registered `cb` with this user_data through dv2_set_log_callback;
        // the string lives until the call returns.
        unsafe { cb(level as i32, text.as_ptr(), user_data as *mut c_void) };
    }
}

fn fail(e: &Error) -> dv2_status {
    let message = e.to_string();
    log(dv2_log_level::DV2_LOG_WARN, &message);
    LAST_ERROR.with(|slot| {
        *slot.borrow_mut() = CString::new(message.replace('\0', " ")).unwrap_or_default()
    });
    status_of(e)
}

/// Runs an entry's body: errors become statuses with a last-error message, panics (quiet:
/// see [`crate::panics`]) become DV2_ERR_INTERNAL.
fn guard(body: impl FnOnce() -> Result<()>) -> dv2_status {
    match panics::catch(body) {
        Ok(Ok(())) => DV2_OK,
        Ok(Err(e)) => fail(&e),
        Err(text) => fail(&Error::Internal(format!("panic inside decodev2: {text}"))),
    }
}

/// Like [`guard`] for calls on a handle: checks it, and poisons it when the body panics.
///
/// # Safety
/// `handle` is NULL or a live pointer from dv2_load*/not yet freed, used by one thread.
unsafe fn with_engine(
    handle: *mut dv2_engine,
    body: impl FnOnce(&mut Engine) -> Result<()>,
) -> dv2_status {
    if handle.is_null() {
        return fail(&Error::NullPointer("engine"));
    }
    // SAFETY: non-null and live by the caller's contract; one thread at a time.
    let h = unsafe { &mut *handle };
    if h.poisoned {
        return fail(&Error::Internal(
            "this handle was poisoned by an earlier internal error; free it".into(),
        ));
    }
    let status = guard(|| body(&mut h.engine));
    if status == DV2_ERR_INTERNAL {
        h.poisoned = true;
    }
    status
}

/// The host's ids (`name[i]`, int32) as the engine's, a negative one refused by its index.
fn ids_from_c(ids: &[i32], name: &str) -> Result<Vec<u32>> {
    ids.iter()
        .enumerate()
        .map(|(i, &id)| {
            u32::try_from(id)
                .map_err(|_| Error::InvalidArgument(format!("{name}[{i}] = {id} is negative")))
        })
        .collect()
}

/// Zeroes a call's id count first, so that every path, errors included, leaves it written (0
/// unless ids were).
///
/// # Safety
/// `out_count` is NULL or valid for one write.
unsafe fn clear_count(out_count: *mut usize) {
    if !out_count.is_null() {
        // SAFETY: non-null, writable by the caller's contract.
        unsafe { out_count.write(0) };
    }
}

/// Writes stepped ids to the host's array and their count.
///
/// # Safety
/// `out_ids` has room for `ids.len()` int32_t; `out_count` non-null and writable.
unsafe fn write_ids(ids: &[u32], out_ids: *mut i32, out_count: *mut usize) {
    // SAFETY: room for ids.len() values, and a writable count, by the caller's contract.
    unsafe {
        let out = std::slice::from_raw_parts_mut(out_ids, ids.len());
        out.iter_mut().zip(ids).for_each(|(o, id)| *o = *id as i32);
        out_count.write(ids.len());
    }
}

/// Writes `value` through an out-pointer, or fails naming it.
///
/// # Safety
/// `ptr` is NULL or valid for one write of T.
unsafe fn write_out<T>(ptr: *mut T, name: &'static str, value: T) -> Result<()> {
    if ptr.is_null() {
        return Err(Error::NullPointer(name));
    }
    // SAFETY: non-null, and valid for a write by the caller's contract.
    unsafe { ptr.write(value) };
    Ok(())
}

/// Non-null out-pointer check done before any work, so a failing call changes nothing.
fn require<T>(ptr: *const T, name: &'static str) -> Result<()> {
    if ptr.is_null() {
        Err(Error::NullPointer(name))
    } else {
        Ok(())
    }
}

fn c_str<'a>(ptr: *const c_char, name: &'static str) -> Result<&'a str> {
    require(ptr, name)?;
    // SAFETY: non-null; the caller promises a NUL-terminated string live for this call.
    unsafe { CStr::from_ptr(ptr) }
        .to_str()
        .map_err(|_| Error::InvalidArgument(format!("{name} is not valid UTF-8")))
}

/// A host struct's `struct_size`, read before anything else, against this library's layout
/// of `T`; `init` tells the host how to set it.
fn check_struct_size<T>(size: u32, name: &str, init: &str) -> Result<()> {
    if size as usize != std::mem::size_of::<T>() {
        return Err(Error::AbiMismatch(format!(
            "{name}.struct_size is {size}, this library expects {} ({init})",
            std::mem::size_of::<T>()
        )));
    }
    Ok(())
}

fn engine_options(opts: *const dv2_options) -> Result<EngineOptions> {
    if opts.is_null() {
        return Ok(EngineOptions::default());
    }
    // SAFETY: non-null; the caller promises a readable dv2_options. Only struct_size is read
    // before it is known to match the layout.
    let size = unsafe { std::ptr::addr_of!((*opts).struct_size).read_unaligned() };
    check_struct_size::<dv2_options>(size, "dv2_options", "initialise with dv2_options_default()")?;
    // SAFETY: as above, and the size matches.
    let o = unsafe { opts.read_unaligned() };
    let backend = match o.backend {
        0 => BackendKind::Auto,
        1 => BackendKind::Cpu,
        2 => BackendKind::Cuda,
        b => {
            return Err(Error::InvalidArgument(format!(
                "dv2_options.backend = {b} is not a dv2_backend"
            )))
        }
    };
    let non_negative = |v: i32, name: &str| {
        usize::try_from(v)
            .map_err(|_| Error::InvalidArgument(format!("dv2_options.{name} = {v} is negative")))
    };
    Ok(EngineOptions {
        backend,
        max_seq: non_negative(o.max_seq, "max_seq")?,
        eos: match o.eos_id {
            -1 | -2 => None,
            id => Some(non_negative(id, "eos_id")? as u32),
        },
        eos_from_model: o.eos_id == -2,
        device: non_negative(o.device, "device")?,
        ..EngineOptions::default()
    })
}

/// Boxes a new engine into `*out`.
///
/// # Safety
/// `out` was checked non-null and is valid for a write.
unsafe fn hand_out(engine: Engine, out: *mut *mut dv2_engine, what: &str) {
    let fitted = match engine.fitted_from() {
        Some(own) => format!(
            ": the model's {own} with the weights do not fit the device; set max_seq to choose"
        ),
        None => String::new(),
    };
    log(
        dv2_log_level::DV2_LOG_INFO,
        &format!(
            "loaded {what} on backend {} (max_seq {}{fitted})",
            engine.backend_name(),
            engine.max_seq()
        ),
    );
    let handle = Box::into_raw(Box::new(dv2_engine {
        engine,
        poisoned: false,
    }));
    // SAFETY: see the function's contract.
    unsafe { out.write(handle) };
}

/// The library version, e.g. "0.1.0". Static storage; never free it.
#[no_mangle]
pub extern "C" fn dv2_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// The message of the most recent failing call on this thread ("" if none). Not cleared by
/// successful calls. Owned by the library; valid until the next failing call on this thread.
#[no_mangle]
pub extern "C" fn dv2_last_error() -> *const c_char {
    LAST_ERROR.with(|slot| slot.borrow().as_ptr())
}

/// A short constant name for a status ("DV2_OK", ...), or "DV2_UNKNOWN_STATUS" for any other
/// integer. Static storage; never free it. (The status is taken as a plain integer: a C enum
/// can hold any int.)
#[no_mangle]
pub extern "C" fn dv2_status_name(status: i32) -> *const c_char {
    const NAMES: [(dv2_status, &str); 20] = [
        (DV2_OK, "DV2_OK\0"),
        (DV2_ERR_NULL_POINTER, "DV2_ERR_NULL_POINTER\0"),
        (DV2_ERR_INVALID_ARGUMENT, "DV2_ERR_INVALID_ARGUMENT\0"),
        (DV2_ERR_INVALID_STATE, "DV2_ERR_INVALID_STATE\0"),
        (DV2_ERR_SEQUENCE_FULL, "DV2_ERR_SEQUENCE_FULL\0"),
        (DV2_FINISHED, "DV2_FINISHED\0"),
        (DV2_ERR_UNKNOWN_PRESET, "DV2_ERR_UNKNOWN_PRESET\0"),
        (DV2_ERR_UNSUPPORTED, "DV2_ERR_UNSUPPORTED\0"),
        (DV2_ERR_IO, "DV2_ERR_IO\0"),
        (DV2_ERR_MODEL_FILE, "DV2_ERR_MODEL_FILE\0"),
        (DV2_ERR_BACKEND_UNAVAILABLE, "DV2_ERR_BACKEND_UNAVAILABLE\0"),
        (DV2_ERR_OUT_OF_MEMORY, "DV2_ERR_OUT_OF_MEMORY\0"),
        (DV2_ERR_CUDA, "DV2_ERR_CUDA\0"),
        (DV2_ERR_INVALID_SPEC, "DV2_ERR_INVALID_SPEC\0"),
        (DV2_ERR_QUANTIZE, "DV2_ERR_QUANTIZE\0"),
        (DV2_ERR_ABI_MISMATCH, "DV2_ERR_ABI_MISMATCH\0"),
        (DV2_ERR_NON_FINITE, "DV2_ERR_NON_FINITE\0"),
        (DV2_ERR_BUFFER_TOO_SMALL, "DV2_ERR_BUFFER_TOO_SMALL\0"),
        (DV2_ERR_STATE_FILE, "DV2_ERR_STATE_FILE\0"),
        (DV2_ERR_INTERNAL, "DV2_ERR_INTERNAL\0"),
    ];
    let name = NAMES
        .iter()
        .find(|(s, _)| *s as i32 == status)
        .map_or("DV2_UNKNOWN_STATUS\0", |(_, name)| name);
    name.as_ptr().cast()
}

/// Sets (or, with NULL, clears) the process-wide log callback. It may be called from any
/// thread that uses the library, one call at a time; `user_data` is passed back unchanged.
#[no_mangle]
pub extern "C" fn dv2_set_log_callback(callback: dv2_log_callback, user_data: *mut c_void) {
    let mut sink = LOG.lock().unwrap_or_else(|p| p.into_inner());
    sink.callback = callback;
    sink.user_data = user_data as usize;
}

/// Default options: backend AUTO, max_seq 0 (model's), eos_id -1 (none), device 0, and
/// struct_size set.
#[no_mangle]
pub extern "C" fn dv2_options_default() -> dv2_options {
    dv2_options {
        struct_size: std::mem::size_of::<dv2_options>() as u32,
        backend: dv2_backend::DV2_BACKEND_AUTO as i32,
        max_seq: 0,
        eos_id: -1,
        device: 0,
    }
}

/// Loads a model file (GGUF) or Hugging Face directory. `opts` may be NULL (defaults).
/// On success `*out` receives a new handle, owned by the caller, freed with dv2_free.
/// Returns DV2_ERR_IO (missing/unreadable), DV2_ERR_MODEL_FILE (not a model file),
/// DV2_ERR_UNSUPPORTED (a recognised format this version cannot read yet); `*out` is then
/// left untouched.
///
/// # Safety
/// `path` is a NUL-terminated string; `opts` NULL or a dv2_options; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn dv2_load(
    path: *const c_char,
    opts: *const dv2_options,
    out: *mut *mut dv2_engine,
) -> dv2_status {
    guard(|| {
        require(out, "out")?;
        let path = c_str(path, "path")?;
        let opts = engine_options(opts)?;
        log(
            dv2_log_level::DV2_LOG_INFO,
            &format!(
                "loading {path} (re-quantizing to NF4 on {} threads)",
                crate::par::threads()
            ),
        );
        let started = std::time::Instant::now();
        let engine = Engine::load_file(std::path::Path::new(path), &opts)?;
        let path = &format!("{path} in {:.2} s", started.elapsed().as_secs_f64());
        // SAFETY: `out` checked non-null above; writable by the caller's contract.
        unsafe { hand_out(engine, out, path) };
        Ok(())
    })
}

/// Builds a seeded synthetic model ("tiny_llama", "tiny_internlm", "medium_llama",
/// "qwen25_3b", "qwen25_32b"; the same seed gives the same weights everywhere). `opts` may be NULL.
/// On success `*out` receives a new handle, owned by the caller, freed with dv2_free.
///
/// # Safety
/// `preset` is a NUL-terminated string; `opts` NULL or a dv2_options; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn dv2_load_synthetic(
    preset: *const c_char,
    seed: u64,
    opts: *const dv2_options,
    out: *mut *mut dv2_engine,
) -> dv2_status {
    guard(|| {
        require(out, "out")?;
        let name = c_str(preset, "preset")?;
        let started = std::time::Instant::now();
        let engine = Engine::load_synthetic(name, seed, &engine_options(opts)?)?;
        let what = format!(
            "preset {name} seed {seed} in {:.2} s",
            started.elapsed().as_secs_f64()
        );
        // SAFETY: `out` checked non-null above; writable by the caller's contract.
        unsafe { hand_out(engine, out, &what) };
        Ok(())
    })
}

/// Frees a handle and everything it holds (host and device memory). NULL is a no-op. The
/// handle must not be used afterwards.
///
/// # Safety
/// `engine` is NULL or a handle from dv2_load*/dv2_load_synthetic not yet freed.
#[no_mangle]
pub unsafe extern "C" fn dv2_free(engine: *mut dv2_engine) {
    if engine.is_null() {
        return;
    }
    // SAFETY: a live handle from Box::into_raw by the caller's contract; freed once.
    let boxed = unsafe { Box::from_raw(engine) };
    if panics::catch(move || drop(boxed)).is_err() {
        log(
            dv2_log_level::DV2_LOG_ERROR,
            "panic while freeing an engine",
        );
    }
}

/// Starts a new request: position 0, finished cleared. The KV cache is not cleared
/// (attention never reads past the current position). Also clears DV2_FINISHED.
///
/// # Safety
/// `engine` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn dv2_reset(engine: *mut dv2_engine) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe { with_engine(engine, |e| e.reset()) }
}

/// Moves the current request back to `position` (0 <= position <= dv2_position), keeping
/// the KV cache of the positions before it: the next dv2_prefill continues from there, so a
/// prompt that begins with the ids at those positions (a chat's earlier turns) is prefilled
/// only from its first new id. Position i holds the i-th id fed: the prompt ids, then each id
/// a step returned except the last (still pending). Clears finished and the pending token, as
/// dv2_reset does (a step needs a dv2_prefill first); dv2_rewind(engine, 0) is dv2_reset.
/// Errors (handle unchanged): DV2_ERR_INVALID_ARGUMENT (position < 0 or past the current one).
///
/// # Safety
/// `engine` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn dv2_rewind(engine: *mut dv2_engine, position: i32) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            let position = usize::try_from(position)
                .map_err(|_| Error::InvalidArgument(format!("position {position} is negative")))?;
            e.rewind(position)
        })
    }
}

/// Saves the current request to the file at `path`: the ids at positions 0..dv2_position and
/// their KV slots (the CPU's f32, the GPU's bf16: 2 x layers x KV width x 2 bytes a position on
/// the GPU), so that dv2_state_load_file, in this process or a later one, on either backend,
/// continues the request without prefilling those ids again (a long system prompt or document
/// computed once). The pending id (the last one chosen) is not saved. The file is written
/// beside `path` and renamed over it when complete: a failed save leaves an earlier file whole.
/// Errors: DV2_ERR_IO (the file cannot be written), DV2_ERR_CUDA. The handle is unchanged.
///
/// # Safety
/// `engine` is NULL or a live handle; `path` a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn dv2_state_save_file(
    engine: *mut dv2_engine,
    path: *const c_char,
) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            let path = c_str(path, "path")?;
            e.save_state(std::path::Path::new(path)).map(drop)
        })
    }
}

/// Loads a file dv2_state_save_file wrote from the same model (same weights; any backend,
/// any max_seq that holds it) as the current request: positions 0..n hold its ids, written to
/// `out_ids[0 .. *out_n]`, and their KV slots. Then, as after dv2_rewind, nothing is pending:
/// dv2_prefill continues from position n (feed at least the last id again, or the next
/// prompt's new ids). A `cap` of max_seq (dv2_model_info) always holds the ids; a smaller one
/// than n gives DV2_ERR_BUFFER_TOO_SMALL with n in `*out_n` and loads nothing (only the
/// file's header and ids are read: `cap` = 0 asks for n cheaply). Errors, handle unchanged:
/// DV2_ERR_IO (missing, unreadable), DV2_ERR_STATE_FILE (not a state file, truncated or
/// extended, another model, an id outside the vocabulary), DV2_ERR_SEQUENCE_FULL (n >
/// max_seq), DV2_ERR_OUT_OF_MEMORY. An error while the slots are written (DV2_ERR_CUDA from the
/// device, or DV2_ERR_IO / DV2_ERR_STATE_FILE where the file fails a read after those checks,
/// changed or cut short meanwhile) leaves the handle reset to position 0.
///
/// # Safety
/// `engine` is NULL or a live handle; `path` a NUL-terminated string; `out_ids` has room for
/// `cap` int32_t; `out_n` writable.
#[no_mangle]
pub unsafe extern "C" fn dv2_state_load_file(
    engine: *mut dv2_engine,
    path: *const c_char,
    out_ids: *mut i32,
    cap: usize,
    out_n: *mut usize,
) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            require(out_n, "out_n")?;
            let path = c_str(path, "path")?;
            let file = e.open_state(std::path::Path::new(path))?;
            restore_opened(e, file, out_ids, cap, out_n)
        })
    }
}

/// Makes an opened state the request and writes its ids out, as dv2_state_load_file and
/// dv2_state_load_data do: a `cap` too small for them loads nothing.
///
/// # Safety
/// As [`copy_out`]'s.
unsafe fn restore_opened(
    e: &mut Engine,
    mut state: crate::state::StateReader<'_>,
    out_ids: *mut i32,
    cap: usize,
    out_n: *mut usize,
) -> Result<()> {
    let ids: Vec<i32> = state.ids().iter().map(|&id| id as i32).collect();
    if ids.len() <= cap {
        e.restore_state(&mut state)?;
    }
    // SAFETY: forwarded contract.
    unsafe { copy_out(&ids, out_ids, cap, out_n) }
}

/// Writes the current request's state to `buf[0 .. *out_bytes]`: the bytes dv2_state_save_file
/// writes into its file, for a host that keeps states in memory (a cache of conversations)
/// and loads them with dv2_state_load_data, or writes them to a file that dv2_state_load_file
/// reads. When `cap` is too small: DV2_ERR_BUFFER_TOO_SMALL with the bytes needed in
/// `*out_bytes` and nothing written (call with `cap` = 0 and `buf` = NULL to ask; the size
/// grows by the same count of bytes with each position). The request is unchanged. Errors:
/// DV2_ERR_NULL_POINTER (`out_bytes`, or `buf` where `cap` holds the state), DV2_ERR_CUDA.
///
/// # Safety
/// `engine` is NULL or a live handle; `buf` NULL or writable for `cap` bytes; `out_bytes`
/// writable.
#[no_mangle]
pub unsafe extern "C" fn dv2_state_save_data(
    engine: *mut dv2_engine,
    buf: *mut u8,
    cap: usize,
    out_bytes: *mut usize,
) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            require(out_bytes, "out_bytes")?;
            let size = e.state_size();
            // SAFETY: non-null and writable by contract.
            out_bytes.write(size);
            if size > cap {
                return Err(Error::BufferTooSmall(format!(
                    "the state takes {size} bytes, capacity {cap}"
                )));
            }
            require(buf, "buf")?;
            // SAFETY: non-null and writable for `cap` >= `size` bytes by contract (`size` is
            // a state's length in host memory: it fits isize).
            let out = std::slice::from_raw_parts_mut(buf, size);
            e.save_state_bytes(out).map(drop)
        })
    }
}

/// dv2_state_load_file on a state in memory, `data[0 .. len]` (what dv2_state_save_data wrote,
/// or a state file's contents): the same results, and the same errors but DV2_ERR_IO;
/// DV2_ERR_NULL_POINTER for `data` or `out_n`.
///
/// # Safety
/// `engine` is NULL or a live handle; `data` NULL or readable for `len` bytes; `out_ids` has
/// room for `cap` int32_t; `out_n` writable.
#[no_mangle]
pub unsafe extern "C" fn dv2_state_load_data(
    engine: *mut dv2_engine,
    data: *const u8,
    len: usize,
    out_ids: *mut i32,
    cap: usize,
    out_n: *mut usize,
) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            require(out_n, "out_n")?;
            require(data, "data")?;
            if len > isize::MAX as usize {
                return Err(Error::InvalidArgument(format!("len = {len}")));
            }
            // SAFETY: non-null, readable for `len` bytes by contract, `len` within isize.
            let bytes = std::slice::from_raw_parts(data, len);
            let state = e.open_state_bytes(bytes)?;
            restore_opened(e, state, out_ids, cap, out_n)
        })
    }
}

/// Feeds `n_ids` prompt ids from the current position (teacher-forced) and computes the
/// next token (greedy, or sampled under dv2_set_sampling), written to `*out_next` when `out_next` is not NULL. Consecutive calls
/// append. Errors (handle unchanged): DV2_ERR_NULL_POINTER (ids), DV2_ERR_INVALID_ARGUMENT
/// (n_ids = 0, an id < 0 or >= vocab), DV2_ERR_SEQUENCE_FULL (position + n_ids > max_seq).
///
/// # Safety
/// `ids` points to `n_ids` readable int32_t; `out_next` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn dv2_prefill(
    engine: *mut dv2_engine,
    ids: *const i32,
    n_ids: usize,
    out_next: *mut i32,
) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            require(ids, "ids")?;
            if n_ids == 0 {
                return Err(Error::InvalidArgument("n_ids is 0".into()));
            }
            let room = e.room();
            if n_ids > room {
                return Err(Error::SequenceFull(format!(
                    "prefill of {n_ids} ids with {room} of max_seq {} slots left",
                    e.max_seq()
                )));
            }
            // SAFETY: non-null, n_ids <= max_seq (so the byte length fits isize), readable by
            // the caller's contract.
            let ids = std::slice::from_raw_parts(ids, n_ids);
            let ids = ids_from_c(ids, "ids")?;
            let next = e.prefill(&ids)?;
            if !out_next.is_null() {
                out_next.write(next as i32);
            }
            Ok(())
        })
    }
}

/// One decode step (greedy, or sampled under dv2_set_sampling): feeds the pending token, writes the new id to `*out_id` when
/// `out_id` is not NULL. Errors (handle unchanged): DV2_ERR_INVALID_STATE (no prefill since
/// load/reset), DV2_FINISHED (EOS already produced), DV2_ERR_SEQUENCE_FULL.
///
/// # Safety
/// `engine` NULL or live; `out_id` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn dv2_step(engine: *mut dv2_engine, out_id: *mut i32) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            let id = e.step()?;
            if !out_id.is_null() {
                out_id.write(id as i32);
            }
            Ok(())
        })
    }
}

/// Up to `n` steps in one call (one host synchronisation on the GPU), writing the ids
/// to `out_ids[0 .. *out_count]`. Stops early after the step that produces EOS (the EOS id is
/// written and finished is set) and when max_seq is reached. Same errors as dv2_step, plus
/// DV2_ERR_INVALID_ARGUMENT for n = 0; on error `*out_count` is 0.
///
/// # Safety
/// `out_ids` has room for `n` int32_t; `out_count` writable.
#[no_mangle]
pub unsafe extern "C" fn dv2_step_n(
    engine: *mut dv2_engine,
    n: usize,
    out_ids: *mut i32,
    out_count: *mut usize,
) -> dv2_status {
    // SAFETY: NULL or writable by the caller's contract.
    unsafe { clear_count(out_count) };
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            require(out_ids, "out_ids")?;
            require(out_count, "out_count")?;
            if n == 0 {
                return Err(Error::InvalidArgument("n is 0".into()));
            }
            // Never more than the slots left, so the buffer below stays small.
            let n = n.min(e.room().max(1));
            let mut ids = vec![0u32; n];
            let done = e.step_n(&mut ids)?;
            // SAFETY: done <= n <= the caller's n; out_ids has room for n by contract.
            write_ids(&ids[..done], out_ids, out_count);
            Ok(())
        })
    }
}

/// One speculative step on the host's own draft (a draft model's ids, its own lookup): feeds
/// the pending id and `draft[0 .. n_draft]` in one forward, keeps the longest prefix of the
/// draft that greedy steps would have produced, and writes the ids those steps give (the
/// accepted draft ids, then the id after them; through EOS at most) to
/// `out_ids[0 .. *out_count]`, 1 to n_draft + 1 of them; the request is then as after that many
/// dv2_step calls (dv2_logits holds the last one's logits). Plain greedy decoding only
/// (DV2_ERR_INVALID_STATE under sampling, penalties or a logit bias). Errors, the request
/// unchanged and `*out_count` 0: DV2_ERR_INVALID_ARGUMENT (n_draft 0 or past DV2_MAX_DRAFT,
/// or on CUDA past the prefill chunk less one; a draft id outside the vocabulary),
/// DV2_ERR_BUFFER_TOO_SMALL (n_out under n_draft + 1), DV2_ERR_SEQUENCE_FULL (fewer than
/// n_draft + 1 slots left), and those of dv2_step.
///
/// # Safety
/// `draft` readable for `n_draft` ids; `out_ids` has room for `n_out`; `out_count` writable.
#[no_mangle]
pub unsafe extern "C" fn dv2_step_draft(
    engine: *mut dv2_engine,
    draft: *const i32,
    n_draft: usize,
    out_ids: *mut i32,
    n_out: usize,
    out_count: *mut usize,
) -> dv2_status {
    // SAFETY: NULL or writable by the caller's contract.
    unsafe { clear_count(out_count) };
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            require(draft, "draft")?;
            require(out_ids, "out_ids")?;
            require(out_count, "out_count")?;
            if n_draft == 0 || n_draft > DV2_MAX_DRAFT as usize {
                return Err(Error::InvalidArgument(format!(
                    "a draft of {n_draft} ids (1 to {})",
                    DV2_MAX_DRAFT as usize
                )));
            }
            // SAFETY: non-null, n_draft <= DV2_MAX_DRAFT ids, readable by the contract.
            let draft = std::slice::from_raw_parts(draft, n_draft);
            let draft = ids_from_c(draft, "draft")?;
            // The engine writes at most n_draft + 1 ids; a shorter room is its error.
            let mut ids = vec![0u32; n_out.min(n_draft + 1)];
            let done = e.step_draft(&draft, &mut ids)?;
            // SAFETY: done <= ids.len() <= n_out; out_ids has room for n_out by contract.
            write_ids(&ids[..done], out_ids, out_count);
            Ok(())
        })
    }
}

/// The last id chosen (after prefill or step). DV2_ERR_INVALID_STATE before any prefill.
///
/// # Safety
/// `out_id` writable.
#[no_mangle]
pub unsafe extern "C" fn dv2_next_token(engine: *mut dv2_engine, out_id: *mut i32) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            require(out_id, "out_id")?;
            let id = e.next_token()?;
            write_out(out_id, "out_id", id as i32)
        })
    }
}

/// Copies the logits of the last forward (prefill's last position or the last step) into
/// `out[0 .. vocab]`; `n_out` is the buffer's length in floats and must be >= vocab.
/// DV2_ERR_INVALID_STATE before any prefill.
///
/// # Safety
/// `out` has room for `n_out` floats.
#[no_mangle]
pub unsafe extern "C" fn dv2_logits(
    engine: *mut dv2_engine,
    out: *mut f32,
    n_out: usize,
) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            require(out, "out")?;
            let vocab = e.spec().vocab;
            if n_out < vocab {
                return Err(Error::InvalidArgument(format!(
                    "n_out = {n_out} < vocab = {vocab}"
                )));
            }
            // SAFETY: non-null with room for n_out >= vocab floats by contract.
            e.logits(std::slice::from_raw_parts_mut(out, vocab))
        })
    }
}

/// Log-probabilities under the last forward's distribution: the log-softmax of its logits,
/// before penalties, temperature and truncation (what the model says; OpenAI's `logprobs`).
/// `*out_logprob` (may be NULL) receives that of `id`; `top_ids[0 .. n_top]` and
/// `top_logprobs[0 .. n_top]` the `n_top` most likely ids, most likely first (the lower id
/// first on a tie), fewer than `n_top` only where the vocabulary is smaller. `n_top` in 0 ..=
/// DV2_MAX_TOP_LOGPROBS; the two arrays may be NULL when it is 0. On CUDA the logits are read
/// back: call it per step where logprobs are wanted. DV2_ERR_INVALID_STATE before any prefill;
/// DV2_ERR_NON_FINITE where the logits hold inf or NaN (nothing written).
///
/// # Safety
/// `out_logprob` NULL or writable; `top_ids` and `top_logprobs` NULL or with room for `n_top`
/// values each.
#[no_mangle]
pub unsafe extern "C" fn dv2_logprobs(
    engine: *mut dv2_engine,
    id: i32,
    n_top: i32,
    out_logprob: *mut f32,
    top_ids: *mut i32,
    top_logprobs: *mut f32,
) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            let n = usize::try_from(n_top)
                .ok()
                .filter(|n| *n <= DV2_MAX_TOP_LOGPROBS as usize)
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "n_top = {n_top} (0 to {})",
                        DV2_MAX_TOP_LOGPROBS as usize
                    ))
                })?;
            if n > 0 {
                require(top_ids, "top_ids")?;
                require(top_logprobs, "top_logprobs")?;
            }
            let id = u32::try_from(id)
                .map_err(|_| Error::InvalidArgument(format!("id {id} is negative")))?;
            let lp = e.logprobs(id, n)?;
            if !out_logprob.is_null() {
                write_out(out_logprob, "out_logprob", lp.id)?;
            }
            for (i, (top_id, logprob)) in lp.top.into_iter().enumerate() {
                // SAFETY: i < n_top, for which both arrays have room by contract.
                *top_ids.add(i) = top_id as i32;
                *top_logprobs.add(i) = logprob;
            }
            Ok(())
        })
    }
}

/// Tokens in the KV cache for the current request (the next slot a step writes).
///
/// # Safety
/// `out_position` writable.
#[no_mangle]
pub unsafe extern "C" fn dv2_position(
    engine: *mut dv2_engine,
    out_position: *mut i32,
) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            require(out_position, "out_position")?;
            let p = e.position()?;
            write_out(out_position, "out_position", p as i32)
        })
    }
}

/// 1 when the current request produced EOS, else 0.
///
/// # Safety
/// `out_finished` writable.
#[no_mangle]
pub unsafe extern "C" fn dv2_finished(
    engine: *mut dv2_engine,
    out_finished: *mut i32,
) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            require(out_finished, "out_finished")?;
            let f = e.finished()?;
            write_out(out_finished, "out_finished", f as i32)
        })
    }
}

/// Fills `*out` with the model's shape, this handle's max_seq and the running backend.
///
/// # Safety
/// `out` writable.
#[no_mangle]
pub unsafe extern "C" fn dv2_get_model_info(
    engine: *mut dv2_engine,
    out: *mut dv2_model_info,
) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            require(out, "out")?;
            // SAFETY: non-null; writable (and so readable) by contract. Only struct_size is
            // read before it is known to match the layout.
            let size = std::ptr::addr_of!((*out).struct_size).read_unaligned();
            check_struct_size::<dv2_model_info>(
                size,
                "dv2_model_info",
                "set it to sizeof(dv2_model_info)",
            )?;
            let s = *e.spec();
            let backend = match e.backend_name() {
                "cuda" => dv2_backend::DV2_BACKEND_CUDA,
                _ => dv2_backend::DV2_BACKEND_CPU,
            };
            let info = dv2_model_info {
                struct_size: size,
                n_layers: s.n_layers as i32,
                hidden: s.hidden as i32,
                n_q_heads: s.n_q_heads as i32,
                n_kv_heads: s.n_kv_heads as i32,
                head_dim: s.head_dim as i32,
                intermediate: s.intermediate as i32,
                vocab: s.vocab as i32,
                max_seq: e.max_seq() as i32,
                backend: backend as i32,
            };
            write_out(out, "out", info)
        })
    }
}

/// Checks `flags` against the bits an entry knows.
fn known_flags(flags: u32, known: u32, name: &str) -> Result<()> {
    if flags & !known != 0 {
        return Err(Error::InvalidArgument(format!(
            "{name} = {flags:#x} has unknown bits {:#x}",
            flags & !known
        )));
    }
    Ok(())
}

/// Writes `values` to `out[0 .. cap]` and their count to `*out_n`; when they do not fit, only
/// the count, and DV2_ERR_BUFFER_TOO_SMALL.
///
/// # Safety
/// `out_n` is non-null and writable; `out` has room for `cap` values (NULL when `cap` is 0).
unsafe fn copy_out<T: Copy>(
    values: &[T],
    out: *mut T,
    cap: usize,
    out_n: *mut usize,
) -> Result<()> {
    // SAFETY: see the contract.
    unsafe { out_n.write(values.len()) };
    if values.len() > cap {
        return Err(Error::BufferTooSmall(format!(
            "{} needed, capacity {cap}",
            values.len()
        )));
    }
    if !values.is_empty() {
        require(out, "out")?;
        // SAFETY: non-null with room for cap >= values.len() by contract.
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), out, values.len()) };
    }
    Ok(())
}

/// The model file's tokenizer turns `text[0 .. text_len]` (UTF-8, not NUL-terminated) into
/// ids, written to `out_ids[0 .. *out_n]`. `flags`: dv2_tokenize_flags ORed together. When
/// `cap` is too small: DV2_ERR_BUFFER_TOO_SMALL with the count needed in `*out_n` (call with
/// `cap` = 0 and `out_ids` = NULL to ask for it). Errors: DV2_ERR_UNSUPPORTED (the model has no
/// tokenizer: synthetic presets, a directory without tokenizer.json; the message says why),
/// DV2_ERR_INVALID_ARGUMENT (text not UTF-8, unknown flags). The handle is unchanged.
///
/// # Safety
/// `text` has `text_len` readable bytes (NULL only when `text_len` is 0); `out_ids` has room
/// for `cap` int32_t; `out_n` writable.
#[no_mangle]
pub unsafe extern "C" fn dv2_tokenize(
    engine: *mut dv2_engine,
    text: *const c_char,
    text_len: usize,
    flags: u32,
    out_ids: *mut i32,
    cap: usize,
    out_n: *mut usize,
) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            require(out_n, "out_n")?;
            known_flags(flags, 3, "flags")?;
            let bytes = if text_len == 0 {
                &[][..]
            } else {
                require(text, "text")?;
                if text_len > isize::MAX as usize {
                    return Err(Error::InvalidArgument(format!("text_len = {text_len}")));
                }
                // SAFETY: non-null with text_len readable bytes by contract.
                std::slice::from_raw_parts(text.cast::<u8>(), text_len)
            };
            let text = std::str::from_utf8(bytes).map_err(|err| {
                Error::InvalidArgument(format!("text is not UTF-8 (at byte {})", err.valid_up_to()))
            })?;
            let add = flags & dv2_tokenize_flags::DV2_TOKENIZE_ADD_SPECIAL as u32 != 0;
            let parse = flags & dv2_tokenize_flags::DV2_TOKENIZE_PARSE_SPECIAL as u32 != 0;
            let ids: Vec<i32> = e
                .tokenizer()?
                .encode(text, add, parse)?
                .into_iter()
                .map(|id| id as i32)
                .collect();
            copy_out(&ids, out_ids, cap, out_n)
        })
    }
}

/// The ids' text: the bytes of their pieces one after another (UTF-8 for a whole sequence of
/// a byte-level vocabulary; not NUL-terminated), written to `out[0 .. *out_len]`. `flags`:
/// dv2_detokenize_flags. Same buffer rule and errors as dv2_tokenize, and
/// DV2_ERR_INVALID_ARGUMENT for an id outside the tokenizer's vocabulary.
///
/// # Safety
/// `ids` has `n_ids` readable int32_t (NULL only when `n_ids` is 0); `out` has room for `cap`
/// bytes; `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn dv2_detokenize(
    engine: *mut dv2_engine,
    ids: *const i32,
    n_ids: usize,
    flags: u32,
    out: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            require(out_len, "out_len")?;
            known_flags(flags, 1, "flags")?;
            let ids = if n_ids == 0 {
                &[][..]
            } else {
                require(ids, "ids")?;
                if n_ids > isize::MAX as usize / 4 {
                    return Err(Error::InvalidArgument(format!("n_ids = {n_ids}")));
                }
                // SAFETY: non-null with n_ids readable int32_t by contract.
                std::slice::from_raw_parts(ids, n_ids)
            };
            let ids = ids_from_c(ids, "ids")?;
            let skip = flags & dv2_detokenize_flags::DV2_DETOKENIZE_SKIP_SPECIAL as u32 != 0;
            let bytes = e.tokenizer()?.decode(&ids, skip)?;
            copy_out(&bytes, out.cast::<u8>(), cap, out_len)
        })
    }
}

/// The bytes of one id's piece, written to `out[0 .. *out_len]` (not NUL-terminated). A piece
/// can end inside a UTF-8 character (a byte-level vocabulary splits characters such as emoji
/// over several ids): a streaming host appends each piece to a byte buffer and prints its
/// longest valid UTF-8 prefix, keeping the rest for the next piece. Same buffer rule and
/// errors as dv2_detokenize.
///
/// # Safety
/// `out` has room for `cap` bytes; `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn dv2_token_to_piece(
    engine: *mut dv2_engine,
    id: i32,
    out: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            require(out_len, "out_len")?;
            let id = u32::try_from(id)
                .map_err(|_| Error::InvalidArgument(format!("id {id} is negative")))?;
            let piece = e.tokenizer()?.piece(id)?.to_vec();
            copy_out(&piece, out.cast::<u8>(), cap, out_len)
        })
    }
}

/// `messages[0 .. n_messages]` through the model file's own chat template (Jinja, rendered as
/// transformers renders it), written to `out[0 .. *out_len]` (UTF-8, not NUL-terminated);
/// `add_generation_prompt` nonzero appends the opening of the assistant's turn. Tokenize the
/// result with DV2_TOKENIZE_PARSE_SPECIAL so that its markers become their ids. Same buffer rule
/// as dv2_tokenize. Errors: DV2_ERR_UNSUPPORTED (no tokenizer, or no template in the file),
/// DV2_ERR_INVALID_ARGUMENT (a string not UTF-8, or the template refusing the conversation,
/// e.g. its `raise_exception`), DV2_ERR_NULL_POINTER. The handle is unchanged.
///
/// # Safety
/// `messages` has `n_messages` readable entries whose strings are NUL-terminated (NULL only
/// when `n_messages` is 0); `out` has room for `cap` bytes; `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn dv2_chat_apply_template(
    engine: *mut dv2_engine,
    messages: *const dv2_chat_message,
    n_messages: usize,
    add_generation_prompt: i32,
    out: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            require(out_len, "out_len")?;
            let messages = if n_messages == 0 {
                &[][..]
            } else {
                require(messages, "messages")?;
                if n_messages > isize::MAX as usize / std::mem::size_of::<dv2_chat_message>() {
                    return Err(Error::InvalidArgument(format!("n_messages = {n_messages}")));
                }
                // SAFETY: non-null with n_messages readable entries by contract.
                std::slice::from_raw_parts(messages, n_messages)
            };
            let messages = messages
                .iter()
                .map(|m| {
                    Ok(Message {
                        role: c_str(m.role, "messages[].role")?.to_string(),
                        content: c_str(m.content, "messages[].content")?.to_string(),
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let text = e
                .tokenizer()?
                .apply_chat_template(&messages, add_generation_prompt != 0)?;
            copy_out(text.as_bytes(), out.cast::<u8>(), cap, out_len)
        })
    }
}

/// The id of a special token the model file names, or -1 in `*out_id` where it names none.
/// `which`: a dv2_special_token. Errors: DV2_ERR_UNSUPPORTED (no tokenizer),
/// DV2_ERR_INVALID_ARGUMENT (not a dv2_special_token).
///
/// # Safety
/// `out_id` writable.
#[no_mangle]
pub unsafe extern "C" fn dv2_token_special(
    engine: *mut dv2_engine,
    which: i32,
    out_id: *mut i32,
) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            require(out_id, "out_id")?;
            let special = e.tokenizer()?.special;
            let id = match which {
                0 => special.bos,
                1 => special.eos,
                2 => special.eot,
                3 => special.pad,
                w => {
                    return Err(Error::InvalidArgument(format!(
                        "which = {w} is not a dv2_special_token"
                    )))
                }
            };
            write_out(out_id, "out_id", id.map_or(-1, |id| id as i32))
        })
    }
}

/// `*out_flag` = 1 when generating `id` ends the model's turn (its EOS or end-of-turn id, or a
/// control token such as `<|im_end|>` or `<|eot_id|>`), else 0. Errors: DV2_ERR_UNSUPPORTED
/// (no tokenizer), DV2_ERR_INVALID_ARGUMENT (id negative).
///
/// # Safety
/// `out_flag` writable.
#[no_mangle]
pub unsafe extern "C" fn dv2_token_is_eog(
    engine: *mut dv2_engine,
    id: i32,
    out_flag: *mut i32,
) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            require(out_flag, "out_flag")?;
            let id = u32::try_from(id)
                .map_err(|_| Error::InvalidArgument(format!("id {id} is negative")))?;
            let eog = e.tokenizer()?.is_eog(id);
            write_out(out_flag, "out_flag", eog as i32)
        })
    }
}

/// The model file's metadata value for `key` (NUL-terminated) as text, written to
/// `out[0 .. *out_len]` (not NUL-terminated): a GGUF's key/value pairs (e.g.
/// "general.name", "llama.context_length"; arrays as JSON), a Hugging Face directory's
/// config.json fields (strings as they are, others as JSON). Same buffer rule as dv2_tokenize.
/// Errors: DV2_ERR_INVALID_ARGUMENT (no such key; an array too long to give as text, e.g. the
/// vocabulary), DV2_ERR_NULL_POINTER.
///
/// # Safety
/// `key` NUL-terminated; `out` has room for `cap` bytes; `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn dv2_meta_str(
    engine: *mut dv2_engine,
    key: *const c_char,
    out: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            require(out_len, "out_len")?;
            let key = c_str(key, "key")?;
            let value = match e.meta().get(key) {
                Some(Ok(text)) => text,
                Some(Err(n)) => {
                    return Err(Error::InvalidArgument(format!(
                        "metadata {key} is an array of {n} values, too long to give as text"
                    )))
                }
                None => {
                    return Err(Error::InvalidArgument(format!(
                        "no metadata key {key:?} ({} keys; dv2_meta_key lists them)",
                        e.meta().len()
                    )))
                }
            };
            copy_out(value.as_bytes(), out.cast::<u8>(), cap, out_len)
        })
    }
}

/// The number of metadata keys of the model file (0 for a model not loaded from a file).
///
/// # Safety
/// `out_count` writable.
#[no_mangle]
pub unsafe extern "C" fn dv2_meta_count(
    engine: *mut dv2_engine,
    out_count: *mut usize,
) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            write_out(out_count, "out_count", e.meta().len())
        })
    }
}

/// The metadata key at `index` (0 .. count-1, in byte order of the keys), written to
/// `out[0 .. *out_len]` (not NUL-terminated). Same buffer rule as dv2_tokenize;
/// DV2_ERR_INVALID_ARGUMENT for an index past the count.
///
/// # Safety
/// `out` has room for `cap` bytes; `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn dv2_meta_key(
    engine: *mut dv2_engine,
    index: usize,
    out: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            require(out_len, "out_len")?;
            let count = e.meta().len();
            let key = e.meta().keys().nth(index).ok_or_else(|| {
                Error::InvalidArgument(format!("index {index} >= {count} metadata keys"))
            })?;
            copy_out(key.as_bytes(), out.cast::<u8>(), cap, out_len)
        })
    }
}

/// Greedy sampling settings (temperature 0, top_k 0, top_p 1, min_p 0, no penalties over a
/// window of 64, seed 0) with `struct_size` set.
#[no_mangle]
pub extern "C" fn dv2_sampling_default() -> dv2_sampling {
    let s = Sampling::default();
    dv2_sampling {
        struct_size: std::mem::size_of::<dv2_sampling>() as u32,
        temperature: s.temperature,
        top_k: s.top_k,
        top_p: s.top_p,
        min_p: s.min_p,
        repeat_penalty: s.repeat_penalty,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        penalty_last_n: s.penalty_last_n,
        seed: s.seed,
    }
}

/// Sets the sampling of the current request and the later ones (kept across dv2_reset until
/// set again). Errors (settings unchanged): DV2_ERR_ABI_MISMATCH (struct_size),
/// DV2_ERR_INVALID_ARGUMENT (a value out of its range, named). On CUDA the first request
/// under a new combination of penalties, temperature, top-k and top-p captures its step's
/// graph here (milliseconds); changing values alone costs nothing.
///
/// # Safety
/// `sampling` readable.
#[no_mangle]
pub unsafe extern "C" fn dv2_set_sampling(
    engine: *mut dv2_engine,
    sampling: *const dv2_sampling,
) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            require(sampling, "sampling")?;
            // Only struct_size is read before it is known to match the layout.
            let size = std::ptr::addr_of!((*sampling).struct_size).read_unaligned();
            check_struct_size::<dv2_sampling>(
                size,
                "dv2_sampling",
                "initialise with dv2_sampling_default()",
            )?;
            let c = sampling.read_unaligned();
            e.set_sampling(&Sampling {
                temperature: c.temperature,
                top_k: c.top_k,
                top_p: c.top_p,
                min_p: c.min_p,
                repeat_penalty: c.repeat_penalty,
                presence_penalty: c.presence_penalty,
                frequency_penalty: c.frequency_penalty,
                penalty_last_n: c.penalty_last_n,
                seed: c.seed,
            })
        })
    }
}

/// Adds `biases[i]` to the logit of `ids[i]` (i < n) before the penalties and the draw, greedy
/// or sampled, in the current request and the later ones (kept across dv2_reset until set
/// again; n = 0 clears it, and ids and biases may then be NULL). A bias of -INFINITY bans its
/// id; the logits dv2_logits and dv2_logprobs read are the model's, without it. Errors (bias
/// unchanged): DV2_ERR_INVALID_ARGUMENT (a NULL array with n > 0, more than
/// DV2_MAX_LOGIT_BIAS ids, an id outside the vocabulary or given twice, a bias NaN or
/// +INFINITY; the entry named). On CUDA the first request with a bias under given sampling
/// settings captures its step's graph here, as dv2_set_sampling does.
///
/// # Safety
/// `ids` and `biases` readable for `n` values each.
#[no_mangle]
pub unsafe extern "C" fn dv2_set_logit_bias(
    engine: *mut dv2_engine,
    ids: *const i32,
    biases: *const f32,
    n: usize,
) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            if n == 0 {
                return e.set_logit_bias(&[], &[]);
            }
            require(ids, "ids")?;
            require(biases, "biases")?;
            if n > DV2_MAX_LOGIT_BIAS as usize {
                return Err(Error::InvalidArgument(format!(
                    "logit bias: {n} ids (at most {})",
                    DV2_MAX_LOGIT_BIAS as usize
                )));
            }
            // SAFETY: non-null, n <= DV2_MAX_LOGIT_BIAS (the byte lengths fit isize), readable
            // by the caller's contract.
            let (ids, biases) = (
                std::slice::from_raw_parts(ids, n),
                std::slice::from_raw_parts(biases, n),
            );
            e.set_logit_bias(ids, biases)
        })
    }
}

/// Speculative greedy decoding in dv2_step and dv2_step_n (prompt lookup): before each step,
/// up to `max_draft` ids that followed the last earlier occurrence of the request's last two or
/// three ids are fed with the pending id in one forward, and those greedy decoding would have
/// produced are kept. The ids are those of steps one at a time (on CUDA up to near-ties: the
/// check runs on the prefill's kernels, whose rounding differs from the step's), in fewer
/// forwards where the text repeats its context (code being edited, an answer quoting its
/// source); where it does not, a failed check costs about one step more than the step it
/// replaces. Only while decoding is plain greedy: under sampling, penalties or a logit bias
/// every step is a step. 0, the default, turns it off; kept across dv2_reset. Errors (setting
/// unchanged): DV2_ERR_INVALID_ARGUMENT for `max_draft` outside 0..DV2_MAX_DRAFT.
///
/// # Safety
/// `engine` a live handle or NULL.
#[no_mangle]
pub unsafe extern "C" fn dv2_set_speculation(
    engine: *mut dv2_engine,
    max_draft: i32,
) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            let max_draft = usize::try_from(max_draft).map_err(|_| {
                Error::InvalidArgument(format!(
                    "max_draft {max_draft} (0 to {})",
                    DV2_MAX_DRAFT as usize
                ))
            })?;
            e.set_speculation(max_draft)
        })
    }
}

/// What speculative decoding did since the handle was loaded: the checks (forwards over a
/// draft), the draft ids fed and those accepted (each accepted id is a step saved). Any
/// output pointer may be NULL.
///
/// # Safety
/// Each non-NULL output pointer writable.
#[no_mangle]
pub unsafe extern "C" fn dv2_speculation_stats(
    engine: *mut dv2_engine,
    out_checks: *mut u64,
    out_drafted: *mut u64,
    out_accepted: *mut u64,
) -> dv2_status {
    // SAFETY: forwarded contract.
    unsafe {
        with_engine(engine, |e| {
            let stats = e.speculation_stats();
            for (ptr, value) in [
                (out_checks, stats.checks),
                (out_drafted, stats.drafted),
                (out_accepted, stats.accepted),
            ] {
                if !ptr.is_null() {
                    // SAFETY: non-null, writable by the caller's contract.
                    ptr.write_unaligned(value);
                }
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_comes_back_as_internal_and_poisons_the_handle() {
        let mut h: *mut dv2_engine = std::ptr::null_mut();
        let opts = dv2_options_default();
        // SAFETY: valid strings and pointers.
        unsafe {
            assert_eq!(
                dv2_load_synthetic(c"tiny_llama".as_ptr(), 0, &opts, &mut h),
                DV2_OK
            );
            let status = with_engine(h, |_| panic!("planted test panic"));
            assert_eq!(status, DV2_ERR_INTERNAL);
            let msg = CStr::from_ptr(dv2_last_error()).to_str().unwrap();
            assert!(msg.contains("planted test panic"), "{msg}");
            assert_eq!(
                dv2_reset(h),
                DV2_ERR_INTERNAL,
                "poisoned handle refuses work"
            );
            dv2_free(h);
        }
        assert_eq!(guard(|| panic!("no handle")), DV2_ERR_INTERNAL);
    }
}
