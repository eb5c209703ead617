//! Bad input through the real C ABI (the `extern "C"` functions, called as C would): every
//! case returns its documented status with a message, nothing crashes, and the handle stays
//! usable where the docs say so.

mod common;

use std::ffi::{CStr, CString};
use std::ptr::{null, null_mut};

use common::*;
use decodev2::ffi::dv2_status::*;
use decodev2::ffi::*;

fn last_error() -> String {
    // SAFETY: dv2_last_error returns a valid NUL-terminated string.
    unsafe { CStr::from_ptr(dv2_last_error()) }
        .to_str()
        .unwrap()
        .to_owned()
}

fn expect(status: dv2_status, want: dv2_status, needle: &str) {
    assert_eq!(status, want, "last error: {}", last_error());
    let msg = last_error();
    assert!(
        msg.contains(needle),
        "message {msg:?} should mention {needle:?}"
    );
}

fn tiny() -> (*mut dv2_engine, Case) {
    let case = case("tiny_llama");
    let mut h = null_mut();
    let mut opts = dv2_options_default();
    opts.backend = dv2_backend::DV2_BACKEND_CPU as i32;
    let name = CString::new(case.preset.clone()).unwrap();
    // SAFETY: valid arguments.
    assert_eq!(
        unsafe { dv2_load_synthetic(name.as_ptr(), case.seed, &opts, &mut h) },
        DV2_OK
    );
    (h, case)
}

/// The handle still gives the fixture's greedy ids after a reset.
fn still_usable(h: *mut dv2_engine, case: &Case) {
    let prompt: Vec<i32> = case.prompt[..case.prefill_len]
        .iter()
        .map(|&v| v as i32)
        .collect();
    let mut ids = vec![0i32; case.greedy.len()];
    let mut count = 0usize;
    // SAFETY: valid handle and buffers.
    unsafe {
        assert_eq!(dv2_reset(h), DV2_OK);
        assert_eq!(
            dv2_prefill(h, prompt.as_ptr(), prompt.len(), &mut ids[0]),
            DV2_OK
        );
        assert_eq!(
            dv2_step_n(h, ids.len() - 1, ids[1..].as_mut_ptr(), &mut count),
            DV2_OK
        );
    }
    assert_eq!(count, ids.len() - 1);
    let want: Vec<i32> = case.greedy.iter().map(|&v| v as i32).collect();
    assert_eq!(ids, want);
}

#[test]
fn null_handle_everywhere() {
    let mut v = 0i32;
    let mut n = 0usize;
    let mut f = 0f32;
    let mut info = dv2_model_info::default();
    let ids = [1i32];
    // SAFETY: NULL handles are part of the contract; other pointers are valid.
    unsafe {
        expect(dv2_reset(null_mut()), DV2_ERR_NULL_POINTER, "engine");
        expect(dv2_rewind(null_mut(), 0), DV2_ERR_NULL_POINTER, "engine");
        expect(
            dv2_prefill(null_mut(), ids.as_ptr(), 1, &mut v),
            DV2_ERR_NULL_POINTER,
            "engine",
        );
        expect(dv2_step(null_mut(), &mut v), DV2_ERR_NULL_POINTER, "engine");
        expect(
            dv2_step_n(null_mut(), 1, &mut v, &mut n),
            DV2_ERR_NULL_POINTER,
            "engine",
        );
        expect(
            dv2_next_token(null_mut(), &mut v),
            DV2_ERR_NULL_POINTER,
            "engine",
        );
        expect(
            dv2_logits(null_mut(), &mut f, 1),
            DV2_ERR_NULL_POINTER,
            "engine",
        );
        expect(
            dv2_position(null_mut(), &mut v),
            DV2_ERR_NULL_POINTER,
            "engine",
        );
        expect(
            dv2_finished(null_mut(), &mut v),
            DV2_ERR_NULL_POINTER,
            "engine",
        );
        expect(
            dv2_get_model_info(null_mut(), &mut info),
            DV2_ERR_NULL_POINTER,
            "engine",
        );
        dv2_free(null_mut());
    }
}

#[test]
fn null_out_pointers_and_arguments() {
    let (h, case) = tiny();
    let mut v = 0i32;
    let mut n = 0usize;
    let opts = dv2_options_default();
    // SAFETY: the NULLs are the point; everything else is valid.
    unsafe {
        expect(
            dv2_load_synthetic(c"tiny_llama".as_ptr(), 0, &opts, null_mut()),
            DV2_ERR_NULL_POINTER,
            "out",
        );
        let mut out = null_mut();
        expect(
            dv2_load_synthetic(null(), 0, &opts, &mut out),
            DV2_ERR_NULL_POINTER,
            "preset",
        );
        assert!(out.is_null(), "*out untouched on failure");
        expect(
            dv2_load(null(), &opts, &mut out),
            DV2_ERR_NULL_POINTER,
            "path",
        );
        expect(
            dv2_prefill(h, null(), 3, &mut v),
            DV2_ERR_NULL_POINTER,
            "ids",
        );
        expect(
            dv2_next_token(h, null_mut()),
            DV2_ERR_NULL_POINTER,
            "out_id",
        );
        expect(
            dv2_position(h, null_mut()),
            DV2_ERR_NULL_POINTER,
            "out_position",
        );
        expect(
            dv2_finished(h, null_mut()),
            DV2_ERR_NULL_POINTER,
            "out_finished",
        );
        expect(
            dv2_get_model_info(h, null_mut()),
            DV2_ERR_NULL_POINTER,
            "out",
        );
        expect(dv2_logits(h, null_mut(), 32), DV2_ERR_NULL_POINTER, "out");
        expect(
            dv2_step_n(h, 2, null_mut(), &mut n),
            DV2_ERR_NULL_POINTER,
            "out_ids",
        );
        expect(
            dv2_step_n(h, 2, &mut v, null_mut()),
            DV2_ERR_NULL_POINTER,
            "out_count",
        );
        // NULL is allowed for the optional outputs of prefill and step.
        let ids = [1i32, 2];
        assert_eq!(dv2_prefill(h, ids.as_ptr(), 2, null_mut()), DV2_OK);
        assert_eq!(dv2_step(h, null_mut()), DV2_OK);
    }
    still_usable(h, &case);
    // SAFETY: live handle, freed once.
    unsafe { dv2_free(h) };
}

#[test]
fn out_of_range_counts_and_ids() {
    let (h, case) = tiny();
    let mut v = 0i32;
    let mut n = 99usize;
    let mut logits = vec![0f32; 31];
    // SAFETY: valid pointers; the values are what is wrong.
    unsafe {
        let ids = [1i32, 2];
        expect(
            dv2_prefill(h, ids.as_ptr(), 0, &mut v),
            DV2_ERR_INVALID_ARGUMENT,
            "n_ids is 0",
        );
        expect(
            dv2_prefill(h, [3, -1].as_ptr(), 2, &mut v),
            DV2_ERR_INVALID_ARGUMENT,
            "ids[1] = -1",
        );
        expect(
            dv2_prefill(h, [32].as_ptr(), 1, &mut v),
            DV2_ERR_INVALID_ARGUMENT,
            "ids[0] = 32",
        );
        expect(
            dv2_prefill(h, [i32::MAX].as_ptr(), 1, &mut v),
            DV2_ERR_INVALID_ARGUMENT,
            "out of range",
        );
        let mut pos = -1;
        assert_eq!(dv2_position(h, &mut pos), DV2_OK);
        assert_eq!(pos, 0, "a rejected prefill consumes nothing");
        expect(dv2_step(h, &mut v), DV2_ERR_INVALID_STATE, "prefill");
        expect(dv2_next_token(h, &mut v), DV2_ERR_INVALID_STATE, "prefill");
        assert_eq!(dv2_prefill(h, ids.as_ptr(), 2, &mut v), DV2_OK);
        expect(
            dv2_step_n(h, 0, &mut v, &mut n),
            DV2_ERR_INVALID_ARGUMENT,
            "n is 0",
        );
        assert_eq!(n, 0);
        expect(
            dv2_logits(h, logits.as_mut_ptr(), 31),
            DV2_ERR_INVALID_ARGUMENT,
            "vocab = 32",
        );
        expect(dv2_rewind(h, -1), DV2_ERR_INVALID_ARGUMENT, "negative");
        expect(
            dv2_rewind(h, 3),
            DV2_ERR_INVALID_ARGUMENT,
            "past the current position 2",
        );
        assert_eq!(dv2_position(h, &mut pos), DV2_OK);
        assert_eq!(pos, 2, "a refused rewind moves nothing");
        assert_eq!(dv2_rewind(h, 1), DV2_OK);
        assert_eq!(dv2_position(h, &mut pos), DV2_OK);
        assert_eq!(pos, 1);
        expect(dv2_step(h, &mut v), DV2_ERR_INVALID_STATE, "prefill");
    }
    logits.push(0.0);
    // SAFETY: 32 floats.
    assert_eq!(unsafe { dv2_logits(h, logits.as_mut_ptr(), 32) }, DV2_OK);
    still_usable(h, &case);
    // SAFETY: live handle, freed once.
    unsafe { dv2_free(h) };
}

#[test]
fn capacity_and_eos() {
    let (h, case) = tiny();
    let mut v = 0i32;
    let mut n = 0usize;
    let long: Vec<i32> = (0..17).collect();
    let mut out = vec![0i32; 64];
    // SAFETY: valid pointers throughout.
    unsafe {
        expect(
            dv2_prefill(h, long.as_ptr(), 17, &mut v),
            DV2_ERR_SEQUENCE_FULL,
            "max_seq 16",
        );
        // A huge n is clipped to the slots left, not trusted as a buffer length.
        assert_eq!(dv2_prefill(h, long.as_ptr(), 10, &mut v), DV2_OK);
        assert_eq!(dv2_step_n(h, usize::MAX, out.as_mut_ptr(), &mut n), DV2_OK);
        assert_eq!(n, 6);
        expect(dv2_step(h, &mut v), DV2_ERR_SEQUENCE_FULL, "max_seq 16");
        expect(
            dv2_step_n(h, 4, out.as_mut_ptr(), &mut n),
            DV2_ERR_SEQUENCE_FULL,
            "max_seq 16",
        );
        expect(
            dv2_prefill(h, long.as_ptr(), 1, &mut v),
            DV2_ERR_SEQUENCE_FULL,
            "0 of max_seq 16",
        );
    }
    still_usable(h, &case);
    // SAFETY: live handle, freed once.
    unsafe { dv2_free(h) };

    // EOS: the fixture's 4th greedy id ends the request.
    let eos = case.greedy[3] as i32;
    let first = case.greedy.iter().position(|&id| id as i32 == eos).unwrap();
    let mut opts = dv2_options_default();
    opts.backend = dv2_backend::DV2_BACKEND_CPU as i32;
    opts.eos_id = eos;
    let mut h = null_mut();
    let prompt: Vec<i32> = case.prompt[..case.prefill_len]
        .iter()
        .map(|&v| v as i32)
        .collect();
    // SAFETY: valid pointers throughout.
    unsafe {
        assert_eq!(
            dv2_load_synthetic(c"tiny_llama".as_ptr(), case.seed, &opts, &mut h),
            DV2_OK
        );
        assert_eq!(
            dv2_prefill(h, prompt.as_ptr(), prompt.len(), &mut v),
            DV2_OK
        );
        assert_eq!(dv2_step_n(h, 8, out.as_mut_ptr(), &mut n), DV2_OK);
        assert_eq!(n, first);
        assert_eq!(out[n - 1], eos);
        let mut fin = 0;
        assert_eq!(dv2_finished(h, &mut fin), DV2_OK);
        assert_eq!(fin, 1);
        expect(dv2_step(h, &mut v), DV2_FINISHED, "EOS");
        expect(
            dv2_step_n(h, 3, out.as_mut_ptr(), &mut n),
            DV2_FINISHED,
            "EOS",
        );
        assert_eq!(dv2_reset(h), DV2_OK);
        assert_eq!(dv2_finished(h, &mut fin), DV2_OK);
        assert_eq!(fin, 0);
        assert_eq!(
            dv2_prefill(h, prompt.as_ptr(), prompt.len(), &mut v),
            DV2_OK
        );
        assert_eq!(v as u32, case.greedy[0]);
        dv2_free(h);
    }
}

#[test]
fn loading_failures() {
    let dir = std::env::temp_dir().join(format!("dv2-bad-input-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let random = dir.join("random.bin");
    let mut state = 0x1234_5678u32;
    let bytes: Vec<u8> = (0..4096)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state as u8
        })
        .collect();
    std::fs::write(&random, bytes).unwrap();
    let gguf = dir.join("model.gguf");
    std::fs::write(&gguf, b"GGUF\x03\x00\x00\x00").unwrap();
    let hf = dir.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    std::fs::write(hf.join("config.json"), b"{}").unwrap();
    let c = |p: &std::path::Path| CString::new(p.to_str().unwrap()).unwrap();
    let mut h = null_mut();
    let opts = dv2_options_default();
    // SAFETY: valid strings and pointers.
    unsafe {
        expect(
            dv2_load(c(&dir.join("missing.gguf")).as_ptr(), &opts, &mut h),
            DV2_ERR_IO,
            "missing.gguf",
        );
        expect(
            dv2_load(c(&random).as_ptr(), &opts, &mut h),
            DV2_ERR_MODEL_FILE,
            "not a model file",
        );
        expect(
            dv2_load(c(&gguf).as_ptr(), null(), &mut h),
            DV2_ERR_MODEL_FILE,
            "truncated",
        );
        expect(
            dv2_load(c(&hf).as_ptr(), &opts, &mut h),
            DV2_ERR_UNSUPPORTED,
            "architecture",
        );
        expect(
            dv2_load_synthetic(c"tiny_lama".as_ptr(), 0, &opts, &mut h),
            DV2_ERR_UNKNOWN_PRESET,
            "tiny_llama",
        );
        expect(
            dv2_load_synthetic(c"\xff".as_ptr(), 0, &opts, &mut h),
            DV2_ERR_INVALID_ARGUMENT,
            "UTF-8",
        );
    }
    assert!(h.is_null());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_options() {
    let mut h = null_mut();
    let name = c"tiny_llama";
    let mut opts = dv2_options_default();
    // SAFETY: valid pointers; the option values are what is wrong.
    unsafe {
        opts.struct_size = 12;
        expect(
            dv2_load_synthetic(name.as_ptr(), 0, &opts, &mut h),
            DV2_ERR_ABI_MISMATCH,
            "struct_size is 12",
        );
        opts = dv2_options_default();
        opts.backend = 7;
        expect(
            dv2_load_synthetic(name.as_ptr(), 0, &opts, &mut h),
            DV2_ERR_INVALID_ARGUMENT,
            "backend = 7",
        );
        opts = dv2_options_default();
        opts.max_seq = -4;
        expect(
            dv2_load_synthetic(name.as_ptr(), 0, &opts, &mut h),
            DV2_ERR_INVALID_ARGUMENT,
            "max_seq = -4",
        );
        opts = dv2_options_default();
        opts.backend = dv2_backend::DV2_BACKEND_CPU as i32;
        opts.max_seq = i32::MAX;
        expect(
            dv2_load_synthetic(name.as_ptr(), 0, &opts, &mut h),
            DV2_ERR_OUT_OF_MEMORY,
            "host memory",
        );
        opts = dv2_options_default();
        opts.eos_id = 32;
        expect(
            dv2_load_synthetic(name.as_ptr(), 0, &opts, &mut h),
            DV2_ERR_INVALID_ARGUMENT,
            "eos id 32",
        );
        assert!(h.is_null());
        // The model file's own EOS: a synthetic model has no file.
        opts.eos_id = -2;
        expect(
            dv2_load_synthetic(name.as_ptr(), 0, &opts, &mut h),
            DV2_ERR_INVALID_ARGUMENT,
            "only a model loaded from a file",
        );
        opts.eos_id = -3;
        expect(
            dv2_load_synthetic(name.as_ptr(), 0, &opts, &mut h),
            DV2_ERR_INVALID_ARGUMENT,
            "eos_id = -3 is negative",
        );
        assert!(h.is_null());
        // NULL options mean defaults.
        assert_eq!(dv2_load_synthetic(name.as_ptr(), 0, null(), &mut h), DV2_OK);
        let mut info = dv2_model_info::default();
        assert_eq!(dv2_get_model_info(h, &mut info), DV2_OK);
        assert_eq!((info.vocab, info.max_seq, info.hidden), (32, 16, 64));
        dv2_free(h);
    }
}

#[test]
fn status_names_and_version() {
    // SAFETY: static strings.
    unsafe {
        assert_eq!(
            CStr::from_ptr(dv2_status_name(DV2_FINISHED as i32))
                .to_str()
                .unwrap(),
            "DV2_FINISHED"
        );
        assert_eq!(
            CStr::from_ptr(dv2_version()).to_str().unwrap(),
            env!("CARGO_PKG_VERSION")
        );
    }
}

fn name_of(status: i32) -> String {
    // SAFETY: dv2_status_name returns a static NUL-terminated string for any integer.
    unsafe { CStr::from_ptr(dv2_status_name(status)) }
        .to_str()
        .unwrap()
        .to_owned()
}

/// A C enum can hold any int: every integer gets a name, none crashes.
#[test]
fn status_names_of_any_integer() {
    for status in [
        DV2_OK,
        DV2_ERR_NON_FINITE,
        DV2_ERR_STATE_FILE,
        DV2_ERR_INTERNAL,
    ] {
        assert_eq!(name_of(status as i32), format!("{status:?}"));
    }
    for status in [-1, 19, 98, 100, i32::MIN, i32::MAX] {
        assert_eq!(name_of(status), "DV2_UNKNOWN_STATUS");
    }
}

fn c_path(p: &std::path::Path) -> CString {
    CString::new(p.to_str().unwrap()).unwrap()
}

/// Loads `path` on the CPU backend in a thread, failing the test (not hanging it) after 60 s.
fn load_within_a_minute(path: &std::path::Path) -> (dv2_status, String) {
    let path = c_path(path);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut h = null_mut();
        let mut opts = dv2_options_default();
        opts.backend = dv2_backend::DV2_BACKEND_CPU as i32;
        // SAFETY: valid string and pointers.
        let status = unsafe { dv2_load(path.as_ptr(), &opts, &mut h) };
        if !h.is_null() {
            // SAFETY: a handle from dv2_load.
            unsafe { dv2_free(h) };
        }
        let _ = tx.send((status, last_error()));
    });
    rx.recv_timeout(std::time::Duration::from_secs(60))
        .expect("dv2_load hung")
}

/// A FIFO, as the model path or as an HF directory's config.json, is refused before an open
/// that would wait for a writer.
#[test]
fn a_fifo_is_refused_not_waited_on() {
    let dir = scratch("fifo");
    let fifo = dir.join("model.gguf");
    let hf = dir.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    for path in [&fifo, &hf.join("config.json")] {
        let c = c_path(path);
        // SAFETY: a valid path string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    }
    for path in [&fifo, &hf] {
        let (status, message) = load_within_a_minute(path);
        assert_eq!(status, DV2_ERR_MODEL_FILE, "{message}");
        assert!(message.contains("not a regular file"), "{message}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Counts read from a file are bounded before they size anything: a GGUF with 2^32 - 1
/// layers, one whose tensor count fills its 4 MB, an HF config with 2^40 layers.
#[test]
fn counts_from_files_cannot_size_an_allocation() {
    use common::gguf_writer::{GgufWriter, Meta};
    let dir = scratch("counts");
    let mut w = GgufWriter::tiny_llama();
    w.set_meta("llama.block_count", Meta::U32(u32::MAX));
    let layers = dir.join("layers.gguf");
    std::fs::write(&layers, w.bytes()).unwrap();
    let (status, message) = load_within_a_minute(&layers);
    assert_eq!(status, DV2_ERR_UNSUPPORTED, "{message}");
    assert!(message.contains("n_layers"), "{message}");

    // GGUF v3: magic, version, tensor count, metadata count, then 4 MB of zeros.
    let mut bytes = b"GGUF".to_vec();
    bytes.extend(3u32.to_le_bytes());
    bytes.extend((4u64 << 20).to_le_bytes());
    bytes.extend(0u64.to_le_bytes());
    bytes.resize(bytes.len() + (4 << 20), 0);
    let tensors = dir.join("tensors.gguf");
    std::fs::write(&tensors, bytes).unwrap();
    let (status, message) = load_within_a_minute(&tensors);
    assert_eq!(status, DV2_ERR_MODEL_FILE, "{message}");

    let hf = dir.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    std::fs::write(
        hf.join("config.json"),
        r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 32,
            "num_hidden_layers": 1099511627776, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 16}"#,
    )
    .unwrap();
    let (status, message) = load_within_a_minute(&hf);
    assert!(
        matches!(status, DV2_ERR_UNSUPPORTED | DV2_ERR_MODEL_FILE),
        "{status:?}: {message}"
    );
    assert!(
        message.contains("n_layers") || message.contains("num_hidden_layers"),
        "{message}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A final norm weight near f32's (and bf16's) largest makes the logits overflow: the forward
/// reports it with its own status instead of handing out ids chosen from inf and NaN, and a
/// reset recovers the handle.
#[test]
fn non_finite_logits_are_a_status() {
    use common::gguf_writer::GgufWriter;
    let dir = scratch("non-finite");
    let mut w = GgufWriter::tiny_llama();
    w.tensor_mut("output_norm.weight").2.fill(3e38);
    let path = dir.join("huge.gguf");
    std::fs::write(&path, w.bytes()).unwrap();
    let mut h = null_mut();
    let mut opts = dv2_options_default();
    opts.backend = dv2_backend::DV2_BACKEND_CPU as i32;
    let prompt = [1i32, 2, 3];
    let mut id = -1;
    // SAFETY: valid strings, buffers and handle.
    unsafe {
        assert_eq!(
            dv2_load(c_path(&path).as_ptr(), &opts, &mut h),
            DV2_OK,
            "{}",
            last_error()
        );
        expect(
            dv2_prefill(h, prompt.as_ptr(), prompt.len(), &mut id),
            DV2_ERR_NON_FINITE,
            "inf or NaN",
        );
        assert_eq!(dv2_reset(h), DV2_OK);
        dv2_free(h);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A linear weight whose block's absmax f16 cannot hold (NF4 scales are f16: src/nf4.rs) is
/// refused at load, naming the tensor, the row and the columns.
#[test]
fn a_weight_past_an_f16_scale_is_refused_at_load() {
    use common::gguf_writer::GgufWriter;
    let dir = scratch("huge-weight");
    let mut w = GgufWriter::tiny_llama();
    w.tensor_mut("blk.0.ffn_down.weight").2[64 * 3 + 70] = -3e38;
    let path = dir.join("huge.gguf");
    std::fs::write(&path, w.bytes()).unwrap();
    let mut h = null_mut();
    let mut opts = dv2_options_default();
    opts.backend = dv2_backend::DV2_BACKEND_CPU as i32;
    // SAFETY: valid strings and out-pointer.
    unsafe {
        let status = dv2_load(c_path(&path).as_ptr(), &opts, &mut h);
        assert_ne!(status, DV2_OK);
        assert!(h.is_null());
    }
    let err = last_error();
    assert!(
        err.contains("blk.0.ffn_down.weight") && err.contains("absmax") && err.contains("f16"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// dv2_step_n writes *out_count on every path, errors included.
#[test]
fn step_n_writes_its_count_on_errors() {
    let mut ids = [0i32; 4];
    let mut count = 77usize;
    // SAFETY: a NULL handle is an argument error; the buffers are valid.
    unsafe {
        expect(
            dv2_step_n(null_mut(), 4, ids.as_mut_ptr(), &mut count),
            DV2_ERR_NULL_POINTER,
            "engine",
        );
    }
    assert_eq!(count, 0);
    let (h, _case) = tiny();
    count = 77;
    // SAFETY: a valid handle before any prefill, and a NULL id buffer.
    unsafe {
        expect(
            dv2_step_n(h, 4, null_mut(), &mut count),
            DV2_ERR_NULL_POINTER,
            "out_ids",
        );
        assert_eq!(count, 0);
        count = 77;
        expect(
            dv2_step_n(h, 4, ids.as_mut_ptr(), &mut count),
            DV2_ERR_INVALID_STATE,
            "prefill",
        );
        assert_eq!(count, 0);
        dv2_free(h);
    }
}

static REENTERED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A log callback that calls back into the library (the callback setter included).
unsafe extern "C" fn reentrant_log(
    _level: i32,
    _message: *const std::ffi::c_char,
    _user: *mut std::ffi::c_void,
) {
    dv2_set_log_callback(Some(reentrant_log), null_mut());
    let _ = dv2_status_name(0);
    let mut opts = dv2_options_default();
    opts.backend = dv2_backend::DV2_BACKEND_CPU as i32;
    // A failing load logs again from inside this callback: once is enough.
    if REENTERED.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
        let mut h = null_mut();
        // SAFETY: valid arguments; the load fails (unknown preset).
        unsafe { dv2_load_synthetic(c"no-such-preset".as_ptr(), 0, &opts, &mut h) };
    }
}

/// No lock is held while the host's log callback runs: it may call any dv2_* entry.
#[test]
fn a_log_callback_may_call_the_library() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        dv2_set_log_callback(Some(reentrant_log), null_mut());
        let mut h = null_mut();
        let opts = dv2_options_default();
        // SAFETY: valid arguments; the load fails and logs.
        let status = unsafe { dv2_load_synthetic(c"tiny_lama".as_ptr(), 0, &opts, &mut h) };
        dv2_set_log_callback(None, null_mut());
        let _ = tx.send(status);
    });
    let status = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("a log callback that calls the library deadlocked");
    assert_eq!(status, DV2_ERR_UNKNOWN_PRESET);
    assert!(REENTERED.load(std::sync::atomic::Ordering::SeqCst) >= 1);
}

/// SmolLM2 (the GGUF .ci/run fetches) on the CPU backend at max_seq 64, or None (after SKIP)
/// where the file is absent: a model with a tokenizer, a chat template and metadata.
fn smollm2_handle() -> Option<*mut dv2_engine> {
    let path = smollm2_path()?;
    let mut h = null_mut();
    let mut opts = dv2_options_default();
    opts.backend = dv2_backend::DV2_BACKEND_CPU as i32;
    opts.max_seq = 64;
    let c_path = c_path(&path);
    // SAFETY: valid arguments.
    let status = unsafe { dv2_load(c_path.as_ptr(), &opts, &mut h) };
    assert_eq!(status, DV2_OK, "{}", last_error());
    Some(h)
}

/// The text entries (dv2_tokenize, dv2_detokenize, dv2_token_to_piece): NULL handles and
/// pointers, a model without a tokenizer, invalid UTF-8, unknown flags, ids out of range,
/// capacities too small (the size needed comes back) and zero; the handle stays usable.
#[test]
fn text_entries_with_bad_input() {
    let mut n = 0usize;
    let mut ids = [0i32; 64];
    let mut bytes = [0 as std::ffi::c_char; 256];
    let text = "The capital of France is";
    // SAFETY: NULL handles are part of the contract; other pointers are valid.
    unsafe {
        expect(
            dv2_tokenize(
                null_mut(),
                text.as_ptr().cast(),
                text.len(),
                0,
                ids.as_mut_ptr(),
                64,
                &mut n,
            ),
            DV2_ERR_NULL_POINTER,
            "engine",
        );
        expect(
            dv2_detokenize(
                null_mut(),
                ids.as_ptr(),
                1,
                0,
                bytes.as_mut_ptr(),
                256,
                &mut n,
            ),
            DV2_ERR_NULL_POINTER,
            "engine",
        );
        expect(
            dv2_token_to_piece(null_mut(), 1, bytes.as_mut_ptr(), 256, &mut n),
            DV2_ERR_NULL_POINTER,
            "engine",
        );
    }
    // A synthetic model has no tokenizer: a clear error, the handle unchanged.
    let (h, case) = tiny();
    // SAFETY: valid handle and buffers.
    unsafe {
        expect(
            dv2_tokenize(
                h,
                text.as_ptr().cast(),
                text.len(),
                0,
                ids.as_mut_ptr(),
                64,
                &mut n,
            ),
            DV2_ERR_UNSUPPORTED,
            "no tokenizer",
        );
        expect(
            dv2_token_to_piece(h, 1, bytes.as_mut_ptr(), 256, &mut n),
            DV2_ERR_UNSUPPORTED,
            "no tokenizer",
        );
    }
    still_usable(h, &case);
    // SAFETY: a live handle.
    unsafe { dv2_free(h) };

    let Some(h) = smollm2_handle() else { return };
    // SAFETY: valid arguments and buffers throughout; the bad ones are the cases under test.
    unsafe {
        let tokenize = |t: &[u8], flags: u32, out: *mut i32, cap: usize, n: &mut usize| {
            dv2_tokenize(h, t.as_ptr().cast(), t.len(), flags, out, cap, n)
        };
        expect(
            dv2_tokenize(
                h,
                text.as_ptr().cast(),
                text.len(),
                0,
                ids.as_mut_ptr(),
                64,
                null_mut(),
            ),
            DV2_ERR_NULL_POINTER,
            "out_n",
        );
        expect(
            dv2_tokenize(h, null(), 5, 0, ids.as_mut_ptr(), 64, &mut n),
            DV2_ERR_NULL_POINTER,
            "text",
        );
        expect(
            tokenize(b"caf\xc3", 0, ids.as_mut_ptr(), 64, &mut n),
            DV2_ERR_INVALID_ARGUMENT,
            "not UTF-8 (at byte 3)",
        );
        expect(
            tokenize(text.as_bytes(), 4, ids.as_mut_ptr(), 64, &mut n),
            DV2_ERR_INVALID_ARGUMENT,
            "unknown bits",
        );
        // Zero capacity: the count needed, nothing written.
        n = 0;
        expect(
            tokenize(text.as_bytes(), 0, null_mut(), 0, &mut n),
            DV2_ERR_BUFFER_TOO_SMALL,
            "5 needed",
        );
        assert_eq!(n, 5);
        expect(
            tokenize(text.as_bytes(), 0, ids.as_mut_ptr(), 4, &mut n),
            DV2_ERR_BUFFER_TOO_SMALL,
            "capacity 4",
        );
        assert_eq!(
            tokenize(text.as_bytes(), 0, ids.as_mut_ptr(), 5, &mut n),
            DV2_OK
        );
        assert_eq!((n, &ids[..5]), (5, &[504, 3575, 282, 4649, 314][..]));
        let prompt = ids[..5].to_vec();
        // Empty text: no ids, no pointer needed.
        assert_eq!(dv2_tokenize(h, null(), 0, 3, null_mut(), 0, &mut n), DV2_OK);
        assert_eq!(n, 0);
        // Special-token text, parsed and not.
        let chat = b"<|im_start|>user";
        assert_eq!(tokenize(chat, 2, ids.as_mut_ptr(), 64, &mut n), DV2_OK);
        assert_eq!(&ids[..n], &[1, 4093]);
        assert_eq!(tokenize(chat, 0, ids.as_mut_ptr(), 64, &mut n), DV2_OK);
        assert!(n > 2);

        expect(
            dv2_detokenize(
                h,
                [1, 49152].as_ptr(),
                2,
                0,
                bytes.as_mut_ptr(),
                256,
                &mut n,
            ),
            DV2_ERR_INVALID_ARGUMENT,
            "out of the tokenizer's range",
        );
        expect(
            dv2_detokenize(h, [-1].as_ptr(), 1, 0, bytes.as_mut_ptr(), 256, &mut n),
            DV2_ERR_INVALID_ARGUMENT,
            "negative",
        );
        expect(
            dv2_detokenize(h, null(), 2, 0, bytes.as_mut_ptr(), 256, &mut n),
            DV2_ERR_NULL_POINTER,
            "ids",
        );
        expect(
            dv2_detokenize(h, prompt.as_ptr(), 5, 2, bytes.as_mut_ptr(), 256, &mut n),
            DV2_ERR_INVALID_ARGUMENT,
            "unknown bits",
        );
        expect(
            dv2_detokenize(h, prompt.as_ptr(), 5, 0, bytes.as_mut_ptr(), 10, &mut n),
            DV2_ERR_BUFFER_TOO_SMALL,
            "24 needed",
        );
        assert_eq!(n, text.len());
        assert_eq!(
            dv2_detokenize(h, prompt.as_ptr(), 5, 0, bytes.as_mut_ptr(), 256, &mut n),
            DV2_OK
        );
        let got: Vec<u8> = bytes[..n].iter().map(|&b| b as u8).collect();
        assert_eq!(got, text.as_bytes());
        let marked = [1, 4093];
        assert_eq!(
            dv2_detokenize(h, marked.as_ptr(), 2, 1, bytes.as_mut_ptr(), 256, &mut n),
            DV2_OK
        );
        assert_eq!(n, 4, "the control token left out: \"user\"");

        expect(
            dv2_token_to_piece(h, -1, bytes.as_mut_ptr(), 256, &mut n),
            DV2_ERR_INVALID_ARGUMENT,
            "negative",
        );
        expect(
            dv2_token_to_piece(h, 49152, bytes.as_mut_ptr(), 256, &mut n),
            DV2_ERR_INVALID_ARGUMENT,
            "out of the tokenizer's range",
        );
        expect(
            dv2_token_to_piece(h, 1, null_mut(), 0, &mut n),
            DV2_ERR_BUFFER_TOO_SMALL,
            "12 needed",
        );
        expect(
            dv2_token_to_piece(h, 1, bytes.as_mut_ptr(), 256, null_mut()),
            DV2_ERR_NULL_POINTER,
            "out_len",
        );
        assert_eq!(
            dv2_token_to_piece(h, 7042, bytes.as_mut_ptr(), 256, &mut n),
            DV2_OK
        );
        let piece: Vec<u8> = bytes[..n].iter().map(|&b| b as u8).collect();
        assert_eq!(piece, b" Paris");

        // Still usable: the tokenized prompt decodes.
        let mut next = 0i32;
        assert_eq!(
            dv2_prefill(h, prompt.as_ptr(), prompt.len(), &mut next),
            DV2_OK
        );
        assert_eq!(next, 7042, "\" Paris\"");
        dv2_free(h);
    }
}

/// dv2_chat_apply_template: NULL handle, messages and strings, invalid UTF-8, a model without
/// a tokenizer, capacities; the render equals the template's (tests/tokenizer.rs checks it
/// against Jinja2) and the handle stays usable.
#[test]
fn chat_template_entry_with_bad_input() {
    let mut n = 0usize;
    let mut out = vec![0 as std::ffi::c_char; 512];
    let (role, content) = (CString::new("user").unwrap(), CString::new("Hi").unwrap());
    let msg = dv2_chat_message {
        role: role.as_ptr(),
        content: content.as_ptr(),
    };
    // SAFETY: NULL handles are part of the contract; other pointers are valid.
    unsafe {
        expect(
            dv2_chat_apply_template(null_mut(), &msg, 1, 1, out.as_mut_ptr(), 512, &mut n),
            DV2_ERR_NULL_POINTER,
            "engine",
        );
    }
    let (h, case) = tiny();
    // SAFETY: valid handle and buffers.
    unsafe {
        expect(
            dv2_chat_apply_template(h, &msg, 1, 1, out.as_mut_ptr(), 512, &mut n),
            DV2_ERR_UNSUPPORTED,
            "no tokenizer",
        );
    }
    still_usable(h, &case);
    // SAFETY: a live handle.
    unsafe { dv2_free(h) };

    let Some(h) = smollm2_handle() else { return };
    let bad = [b'c', b'a', b'f', 0xc3, 0];
    // SAFETY: valid arguments and buffers; the bad ones are the cases under test.
    unsafe {
        expect(
            dv2_chat_apply_template(h, null(), 1, 1, out.as_mut_ptr(), 512, &mut n),
            DV2_ERR_NULL_POINTER,
            "messages",
        );
        let no_role = dv2_chat_message {
            role: null(),
            content: content.as_ptr(),
        };
        expect(
            dv2_chat_apply_template(h, &no_role, 1, 1, out.as_mut_ptr(), 512, &mut n),
            DV2_ERR_NULL_POINTER,
            "messages[].role",
        );
        let not_utf8 = dv2_chat_message {
            role: role.as_ptr(),
            content: bad.as_ptr().cast(),
        };
        expect(
            dv2_chat_apply_template(h, &not_utf8, 1, 1, out.as_mut_ptr(), 512, &mut n),
            DV2_ERR_INVALID_ARGUMENT,
            "UTF-8",
        );
        expect(
            dv2_chat_apply_template(h, &msg, 1, 1, out.as_mut_ptr(), 512, null_mut()),
            DV2_ERR_NULL_POINTER,
            "out_len",
        );
        let want = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
        expect(
            dv2_chat_apply_template(h, &msg, 1, 1, null_mut(), 0, &mut n),
            DV2_ERR_BUFFER_TOO_SMALL,
            "needed",
        );
        assert_eq!(n, want.len());
        assert_eq!(
            dv2_chat_apply_template(h, &msg, 1, 1, out.as_mut_ptr(), 512, &mut n),
            DV2_OK
        );
        let got: Vec<u8> = out[..n].iter().map(|&b| b as u8).collect();
        assert_eq!(String::from_utf8(got).unwrap(), want);
        // No messages: the template renders nothing but the generation prompt.
        assert_eq!(
            dv2_chat_apply_template(h, null(), 0, 1, out.as_mut_ptr(), 512, &mut n),
            DV2_OK
        );
        assert_eq!(n, "<|im_start|>assistant\n".len());
        dv2_free(h);
    }
}

/// dv2_get_model_info's struct_size, the metadata entries and the special-token entries:
/// wrong sizes, NULLs, unknown keys and kinds, arrays too long for text, indexes past the
/// count, negative ids; the handle stays usable.
#[test]
fn model_info_metadata_and_special_tokens_with_bad_input() {
    let mut n = 0usize;
    let mut flag = 0i32;
    let mut out = vec![0 as std::ffi::c_char; 256];
    let (h, case) = tiny();
    // SAFETY: valid handles and buffers; the bad ones are the cases under test.
    unsafe {
        let mut info = dv2_model_info {
            struct_size: 4,
            ..dv2_model_info::default()
        };
        expect(
            dv2_get_model_info(h, &mut info),
            DV2_ERR_ABI_MISMATCH,
            "struct_size is 4",
        );
        expect(
            dv2_get_model_info(h, null_mut()),
            DV2_ERR_NULL_POINTER,
            "out",
        );
        assert_eq!(dv2_meta_count(h, &mut n), DV2_OK);
        assert_eq!(n, 0, "a synthetic model has no file metadata");
        expect(
            dv2_meta_str(h, c"general.name".as_ptr(), out.as_mut_ptr(), 256, &mut n),
            DV2_ERR_INVALID_ARGUMENT,
            "no metadata key \"general.name\"",
        );
        expect(
            dv2_token_special(h, 1, &mut flag),
            DV2_ERR_UNSUPPORTED,
            "no tokenizer",
        );
    }
    still_usable(h, &case);
    // SAFETY: a live handle.
    unsafe { dv2_free(h) };

    let Some(h) = smollm2_handle() else { return };
    // SAFETY: as above.
    unsafe {
        let mut info = dv2_model_info::default();
        assert_eq!(dv2_get_model_info(h, &mut info), DV2_OK);
        assert_eq!((info.vocab, info.max_seq), (49152, 64));
        let text = |out: &[std::ffi::c_char], n: usize| -> String {
            String::from_utf8(out[..n].iter().map(|&b| b as u8).collect()).unwrap()
        };
        assert_eq!(
            dv2_meta_str(h, c"general.name".as_ptr(), out.as_mut_ptr(), 256, &mut n),
            DV2_OK
        );
        assert_eq!(text(&out, n), "Smollm2 135M 8k Lc100K Mix1 Ep2");
        assert_eq!(
            dv2_meta_str(
                h,
                c"llama.block_count".as_ptr(),
                out.as_mut_ptr(),
                256,
                &mut n
            ),
            DV2_OK
        );
        assert_eq!(text(&out, n), "30");
        expect(
            dv2_meta_str(
                h,
                c"tokenizer.ggml.tokens".as_ptr(),
                out.as_mut_ptr(),
                256,
                &mut n,
            ),
            DV2_ERR_INVALID_ARGUMENT,
            "array of 49152 values",
        );
        expect(
            dv2_meta_str(h, null(), out.as_mut_ptr(), 256, &mut n),
            DV2_ERR_NULL_POINTER,
            "key",
        );
        expect(
            dv2_meta_str(h, c"general.name".as_ptr(), out.as_mut_ptr(), 4, &mut n),
            DV2_ERR_BUFFER_TOO_SMALL,
            "capacity 4",
        );
        assert_eq!(n, "Smollm2 135M 8k Lc100K Mix1 Ep2".len());
        let mut count = 0usize;
        assert_eq!(dv2_meta_count(h, &mut count), DV2_OK);
        assert!(count > 20, "{count}");
        let mut keys = Vec::new();
        for i in 0..count {
            assert_eq!(dv2_meta_key(h, i, out.as_mut_ptr(), 256, &mut n), DV2_OK);
            keys.push(text(&out, n));
        }
        assert!(keys.windows(2).all(|w| w[0] < w[1]), "keys in byte order");
        assert!(keys.contains(&"tokenizer.chat_template".to_string()));
        expect(
            dv2_meta_key(h, count, out.as_mut_ptr(), 256, &mut n),
            DV2_ERR_INVALID_ARGUMENT,
            "metadata keys",
        );
        let mut id = 0i32;
        for (which, want) in [(0, 1), (1, 2), (2, -1), (3, 2)] {
            assert_eq!(dv2_token_special(h, which, &mut id), DV2_OK);
            assert_eq!(id, want, "dv2_special_token {which}");
        }
        expect(
            dv2_token_special(h, 4, &mut id),
            DV2_ERR_INVALID_ARGUMENT,
            "not a dv2_special_token",
        );
        expect(
            dv2_token_special(h, 0, null_mut()),
            DV2_ERR_NULL_POINTER,
            "out_id",
        );
        for (token, want) in [(2, 1), (0, 1), (1, 0), (504, 0)] {
            assert_eq!(dv2_token_is_eog(h, token, &mut flag), DV2_OK);
            assert_eq!(flag, want, "id {token}");
        }
        expect(
            dv2_token_is_eog(h, -1, &mut flag),
            DV2_ERR_INVALID_ARGUMENT,
            "negative",
        );
        let prompt = [504, 3575, 282, 4649, 314];
        let mut next = 0i32;
        assert_eq!(dv2_prefill(h, prompt.as_ptr(), 5, &mut next), DV2_OK);
        assert_eq!(next, 7042);
        dv2_free(h);
    }
}

/// dv2_set_sampling: NULL handle and settings, a wrong struct_size, values out of range (each
/// named, the settings left as they were); the CPU backend samples with the seed's ids.
#[test]
fn sampling_with_bad_input() {
    let s = dv2_sampling_default();
    assert_eq!(s.struct_size as usize, std::mem::size_of::<dv2_sampling>());
    assert_eq!(
        (s.temperature, s.top_k, s.top_p, s.min_p),
        (0.0, 0, 1.0, 0.0)
    );
    // SAFETY: NULL handles are part of the contract; other pointers are valid.
    unsafe {
        expect(
            dv2_set_sampling(null_mut(), &s),
            DV2_ERR_NULL_POINTER,
            "engine",
        );
    }
    let (h, case) = tiny();
    // SAFETY: a valid handle; the bad settings are the cases under test.
    unsafe {
        expect(
            dv2_set_sampling(h, null()),
            DV2_ERR_NULL_POINTER,
            "sampling",
        );
        let wrong = dv2_sampling {
            struct_size: 8,
            ..s
        };
        expect(
            dv2_set_sampling(h, &wrong),
            DV2_ERR_ABI_MISMATCH,
            "struct_size is 8",
        );
        for (bad, field) in [
            (
                dv2_sampling {
                    temperature: f32::NAN,
                    ..s
                },
                "temperature",
            ),
            (
                dv2_sampling {
                    temperature: -0.5,
                    ..s
                },
                "temperature",
            ),
            (dv2_sampling { top_p: 0.0, ..s }, "top_p"),
            (dv2_sampling { top_p: 1.01, ..s }, "top_p"),
            (dv2_sampling { top_k: -1, ..s }, "top_k"),
            (dv2_sampling { min_p: 2.0, ..s }, "min_p"),
            (
                dv2_sampling {
                    repeat_penalty: -1.0,
                    ..s
                },
                "repeat_penalty",
            ),
            (
                dv2_sampling {
                    penalty_last_n: -5,
                    ..s
                },
                "penalty_last_n",
            ),
        ] {
            expect(dv2_set_sampling(h, &bad), DV2_ERR_INVALID_ARGUMENT, field);
        }
    }
    // Nothing was applied: still the greedy fixture ids.
    still_usable(h, &case);
    // SAFETY: valid handle and settings.
    unsafe {
        let hot = dv2_sampling {
            temperature: 2.0,
            seed: 3,
            ..s
        };
        assert_eq!(dv2_set_sampling(h, &hot), DV2_OK);
        // Back to greedy, then the fixture ids again.
        assert_eq!(dv2_set_sampling(h, &s), DV2_OK);
    }
    still_usable(h, &case);
    // SAFETY: a live handle.
    unsafe { dv2_free(h) };
}

/// dv2_set_logit_bias: a NULL handle, NULL arrays with n > 0, too many ids, an id outside the
/// vocabulary or given twice, a NaN or +inf bias: each refused with the entry named, the bias
/// left as it was (none: the greedy fixture ids); n = 0 with NULL arrays clears it.
#[test]
fn logit_bias_with_bad_input() {
    let (h, case) = tiny();
    let vocab = decodev2::arch::TINY_LLAMA.vocab as i32;
    let many = vec![0i32; dv2_limits::DV2_MAX_LOGIT_BIAS as usize + 1];
    // SAFETY: the arrays are valid for the counts given, or NULL as each case says.
    unsafe {
        expect(
            dv2_set_logit_bias(null_mut(), [1].as_ptr(), [1.0].as_ptr(), 1),
            DV2_ERR_NULL_POINTER,
            "engine",
        );
        expect(
            dv2_set_logit_bias(h, null(), [1.0].as_ptr(), 1),
            DV2_ERR_NULL_POINTER,
            "ids",
        );
        expect(
            dv2_set_logit_bias(h, [1].as_ptr(), null(), 1),
            DV2_ERR_NULL_POINTER,
            "biases",
        );
        let zeros = vec![0f32; many.len()];
        expect(
            dv2_set_logit_bias(h, many.as_ptr(), zeros.as_ptr(), many.len()),
            DV2_ERR_INVALID_ARGUMENT,
            "at most 1024",
        );
        for (ids, biases, needle) in [
            (vec![vocab], vec![1.0f32], "outside the vocabulary"),
            (vec![-3], vec![1.0], "id -3"),
            (vec![4, 9, 4], vec![1.0, 1.0, 1.0], "id 4 given twice"),
            (vec![2], vec![f32::NAN], "entry 0: bias NaN"),
            (vec![5, 2], vec![0.0, f32::INFINITY], "entry 1: bias inf"),
        ] {
            expect(
                dv2_set_logit_bias(h, ids.as_ptr(), biases.as_ptr(), ids.len()),
                DV2_ERR_INVALID_ARGUMENT,
                needle,
            );
        }
    }
    still_usable(h, &case);
    // SAFETY: valid arrays; NULL ones with n = 0 are part of the contract.
    unsafe {
        let first = case.greedy[0] as i32;
        assert_eq!(
            dv2_set_logit_bias(h, [first].as_ptr(), [f32::NEG_INFINITY].as_ptr(), 1),
            DV2_OK
        );
        let mut next = 0;
        let prompt: Vec<i32> = case.prompt[..case.prefill_len]
            .iter()
            .map(|&i| i as i32)
            .collect();
        assert_eq!(dv2_reset(h), DV2_OK);
        assert_eq!(
            dv2_prefill(h, prompt.as_ptr(), prompt.len(), &mut next),
            DV2_OK
        );
        assert_ne!(next, first, "the banned id was chosen");
        assert_eq!(dv2_set_logit_bias(h, null(), null(), 0), DV2_OK);
    }
    still_usable(h, &case);
    // SAFETY: a live handle.
    unsafe { dv2_free(h) };
}

/// dv2_logprobs: a NULL handle, no forward yet, n_top outside 0..=20, an id outside the
/// vocabulary, NULL arrays with n_top > 0 are each refused, the handle stays usable; a good
/// call gives the greedy id's log-probability as the top one, in order, summing to at most 1.
#[test]
fn logprobs_refuse_bad_arguments_and_give_the_log_softmax() {
    let (h, case) = tiny();
    let (mut lp, mut ids, mut lps) = (0f32, [0i32; 20], [0f32; 20]);
    // SAFETY: valid buffers; the handle is valid or NULL as each case says.
    unsafe {
        expect(
            dv2_logprobs(
                null_mut(),
                0,
                1,
                &mut lp,
                ids.as_mut_ptr(),
                lps.as_mut_ptr(),
            ),
            DV2_ERR_NULL_POINTER,
            "engine",
        );
        expect(
            dv2_logprobs(h, 0, 1, &mut lp, ids.as_mut_ptr(), lps.as_mut_ptr()),
            DV2_ERR_INVALID_STATE,
            "prefill",
        );
        let prompt: Vec<i32> = case.prompt.iter().map(|&i| i as i32).collect();
        let mut next = -1;
        assert_eq!(
            dv2_prefill(h, prompt.as_ptr(), prompt.len(), &mut next),
            DV2_OK
        );
        for (id, n_top, needle) in [
            (0, 21, "n_top"),
            (0, -1, "n_top"),
            (32, 1, "out of range"),
            (-1, 1, "negative"),
        ] {
            expect(
                dv2_logprobs(h, id, n_top, &mut lp, ids.as_mut_ptr(), lps.as_mut_ptr()),
                DV2_ERR_INVALID_ARGUMENT,
                needle,
            );
        }
        expect(
            dv2_logprobs(h, 0, 2, &mut lp, null_mut(), lps.as_mut_ptr()),
            DV2_ERR_NULL_POINTER,
            "top_ids",
        );
        expect(
            dv2_logprobs(h, 0, 2, &mut lp, ids.as_mut_ptr(), null_mut()),
            DV2_ERR_NULL_POINTER,
            "top_logprobs",
        );
        assert_eq!(
            dv2_logprobs(h, next, 0, &mut lp, null_mut(), null_mut()),
            DV2_OK,
            "{}",
            last_error()
        );
        assert_eq!(
            dv2_logprobs(h, next, 20, null_mut(), ids.as_mut_ptr(), lps.as_mut_ptr()),
            DV2_OK
        );
        assert_eq!(
            (ids[0], lps[0]),
            (next, lp),
            "the greedy id is the most likely"
        );
        assert!(lps.windows(2).all(|w| w[0] >= w[1]), "{lps:?}");
        let total: f32 = lps.iter().map(|l| l.exp()).sum();
        assert!(total <= 1.0 + 1e-5 && lp < 0.0, "{total} {lp}");
        // Still usable: a step and its logprobs.
        let mut id = -1;
        assert_eq!(dv2_step(h, &mut id), DV2_OK);
        assert_eq!(
            dv2_logprobs(h, id, 1, &mut lp, ids.as_mut_ptr(), lps.as_mut_ptr()),
            DV2_OK
        );
        assert_eq!(ids[0], id);
        dv2_free(h);
    }
}

/// dv2_state_save_file and dv2_state_load_file: NULL handle, path and count; a path that
/// cannot be written; a missing file; a buffer too small (the count needed, nothing loaded);
/// the file cut at every length and each header and id byte changed: each refused with a
/// message and the request left where it was; then a good load continues the fixture's ids.
#[test]
fn state_files_with_bad_input() {
    let (h, case) = tiny();
    let dir = scratch("state");
    let (path, bad) = (c_path(&dir.join("ok.dv2state")), dir.join("bad.dv2state"));
    let bad_c = c_path(&bad);
    let prompt: Vec<i32> = case.prompt[..case.prefill_len]
        .iter()
        .map(|&i| i as i32)
        .collect();
    let (mut ids, mut n, mut next) = (vec![-7i32; 64], 0usize, 0i32);
    let (mut size, mut memory) = (0usize, Vec::new());
    // SAFETY: valid buffers for the counts given; NULL where a case says.
    unsafe {
        expect(
            dv2_state_save_file(null_mut(), path.as_ptr()),
            DV2_ERR_NULL_POINTER,
            "engine",
        );
        expect(dv2_state_save_file(h, null()), DV2_ERR_NULL_POINTER, "path");
        expect(
            dv2_state_load_file(null_mut(), path.as_ptr(), ids.as_mut_ptr(), 64, &mut n),
            DV2_ERR_NULL_POINTER,
            "engine",
        );
        expect(
            dv2_state_load_file(h, null(), ids.as_mut_ptr(), 64, &mut n),
            DV2_ERR_NULL_POINTER,
            "path",
        );
        expect(
            dv2_state_load_file(h, path.as_ptr(), ids.as_mut_ptr(), 64, null_mut()),
            DV2_ERR_NULL_POINTER,
            "out_n",
        );
        assert_eq!(
            dv2_prefill(h, prompt.as_ptr(), prompt.len(), &mut next),
            DV2_OK
        );
        let nowhere = c_path(&dir.join("no/such/dir/x.dv2state"));
        expect(
            dv2_state_save_file(h, nowhere.as_ptr()),
            DV2_ERR_IO,
            "cannot write",
        );
        assert_eq!(dv2_state_save_file(h, path.as_ptr()), DV2_OK);
        // The same state in memory: its size asked, a buffer a byte short left untouched.
        expect(
            dv2_state_save_data(h, null_mut(), 0, null_mut()),
            DV2_ERR_NULL_POINTER,
            "out_bytes",
        );
        expect(
            dv2_state_save_data(h, null_mut(), 0, &mut size),
            DV2_ERR_BUFFER_TOO_SMALL,
            "capacity 0",
        );
        memory.resize(size, 0xa5u8);
        expect(
            dv2_state_save_data(h, memory.as_mut_ptr(), size - 1, &mut size),
            DV2_ERR_BUFFER_TOO_SMALL,
            "bytes",
        );
        assert!(memory.iter().all(|&b| b == 0xa5), "nothing written");
        expect(
            dv2_state_save_data(h, null_mut(), size, &mut size),
            DV2_ERR_NULL_POINTER,
            "buf",
        );
        assert_eq!(
            dv2_state_save_data(h, memory.as_mut_ptr(), size, &mut size),
            DV2_OK
        );
        expect(
            dv2_state_load_data(h, null(), size, ids.as_mut_ptr(), 64, &mut n),
            DV2_ERR_NULL_POINTER,
            "data",
        );
        expect(
            dv2_state_load_data(h, memory.as_ptr(), size, ids.as_mut_ptr(), 64, null_mut()),
            DV2_ERR_NULL_POINTER,
            "out_n",
        );
        expect(
            dv2_state_load_data(h, memory.as_ptr(), usize::MAX, ids.as_mut_ptr(), 64, &mut n),
            DV2_ERR_INVALID_ARGUMENT,
            "len",
        );
        expect(
            dv2_state_load_file(h, bad_c.as_ptr(), ids.as_mut_ptr(), 64, &mut n),
            DV2_ERR_IO,
            "cannot open",
        );
        expect(
            dv2_state_load_file(h, path.as_ptr(), ids.as_mut_ptr(), 2, &mut n),
            DV2_ERR_BUFFER_TOO_SMALL,
            "capacity 2",
        );
        assert_eq!(n, prompt.len());
        assert!(ids.iter().all(|&id| id == -7), "nothing written");
    }
    let mut position = 0i32;
    let good = std::fs::read(dir.join("ok.dv2state")).unwrap();
    assert_eq!(memory, good, "the state's bytes are its file's");
    let header = decodev2::state::HEADER_BYTES;
    let mut variants: Vec<Vec<u8>> = (0..good.len()).map(|len| good[..len].to_vec()).collect();
    // Every header bit that matters (magic, version, type, fingerprint, shape, count), and the
    // top bit of each id (an id past the vocabulary).
    let flips = (0..header)
        .flat_map(|at| [(at, 0x01u8), (at, 0x80)])
        .chain((0..prompt.len()).map(|i| (header + 4 * i + 3, 0x80)));
    for (at, flip) in flips {
        let mut b = good.clone();
        b[at] ^= flip;
        variants.push(b);
    }
    for (i, bytes) in variants.iter().enumerate() {
        std::fs::write(&bad, bytes).unwrap();
        // SAFETY: valid buffers.
        let status =
            unsafe { dv2_state_load_file(h, bad_c.as_ptr(), ids.as_mut_ptr(), 64, &mut n) };
        assert_ne!(status, DV2_OK, "variant {i} of {} loaded", good.len());
        assert!(!last_error().is_empty(), "variant {i}: no message");
        // SAFETY: `bytes` readable for its length; valid buffers.
        let status = unsafe {
            dv2_state_load_data(h, bytes.as_ptr(), bytes.len(), ids.as_mut_ptr(), 64, &mut n)
        };
        assert_ne!(status, DV2_OK, "variant {i} loaded from memory");
        // SAFETY: a live handle and a writable out-pointer.
        assert_eq!(unsafe { dv2_position(h, &mut position) }, DV2_OK);
        assert_eq!(
            position as usize,
            prompt.len(),
            "variant {i} moved the request"
        );
    }
    // SAFETY: valid buffers.
    unsafe {
        for from_memory in [false, true] {
            assert_eq!(dv2_reset(h), DV2_OK);
            ids.fill(-7);
            let status = if from_memory {
                dv2_state_load_data(h, memory.as_ptr(), size, ids.as_mut_ptr(), 64, &mut n)
            } else {
                dv2_state_load_file(h, path.as_ptr(), ids.as_mut_ptr(), 64, &mut n)
            };
            assert_eq!(status, DV2_OK);
            assert_eq!(&ids[..n], &prompt[..]);
            assert_eq!(dv2_position(h, &mut position), DV2_OK);
            assert_eq!(position as usize, prompt.len());
            let pending = case.greedy[0] as i32;
            assert_eq!(dv2_prefill(h, &pending, 1, &mut next), DV2_OK);
            assert_eq!(next as u32, case.greedy[1], "the loaded request goes on");
        }
    }
    still_usable(h, &case);
    // SAFETY: a live handle.
    unsafe { dv2_free(h) };
    std::fs::remove_dir_all(dir).unwrap();
}

/// dv2_set_speculation, dv2_speculation_stats and dv2_step_draft: a NULL handle, NULL arrays,
/// a draft empty or past DV2_MAX_DRAFT, a negative or out-of-vocabulary draft id, too small an
/// output, sampling in force: each refused with a message, the request where it was and
/// `*out_count` 0; then a draft of the greedy continuation is taken whole with the id after
/// it, and dv2_step_n under speculation gives the fixture's greedy ids.
#[test]
fn speculation_and_drafts_with_bad_input() {
    let (h, case) = tiny();
    let prompt: Vec<i32> = case.prompt[..case.prefill_len]
        .iter()
        .map(|&v| v as i32)
        .collect();
    let greedy: Vec<i32> = case.greedy.iter().map(|&v| v as i32).collect();
    let vocab = decodev2::arch::TINY_LLAMA.vocab as i32;
    let long = [1i32; dv2_limits::DV2_MAX_DRAFT as usize + 1];
    let (mut out, mut count) = ([0i32; 32], 7usize);
    // SAFETY: valid buffers for the counts given, or NULL as each case says.
    unsafe {
        expect(
            dv2_set_speculation(null_mut(), 4),
            DV2_ERR_NULL_POINTER,
            "engine",
        );
        expect(
            dv2_set_speculation(h, -1),
            DV2_ERR_INVALID_ARGUMENT,
            "max_draft -1",
        );
        expect(
            dv2_set_speculation(h, 16),
            DV2_ERR_INVALID_ARGUMENT,
            "max_draft 16",
        );
        expect(
            dv2_speculation_stats(null_mut(), null_mut(), null_mut(), null_mut()),
            DV2_ERR_NULL_POINTER,
            "engine",
        );
        expect(
            dv2_step_draft(h, [1].as_ptr(), 1, out.as_mut_ptr(), 2, &mut count),
            DV2_ERR_INVALID_STATE,
            "prefill",
        );
        let mut next = 0;
        assert_eq!(
            dv2_prefill(h, prompt.as_ptr(), prompt.len(), &mut next),
            DV2_OK
        );
        let at = prompt.len() as i32;
        for (draft, n_out, want, needle) in [
            (&[][..], 4, DV2_ERR_INVALID_ARGUMENT, "a draft of 0 ids"),
            (&long[..], 32, DV2_ERR_INVALID_ARGUMENT, "a draft of 16 ids"),
            (&[3, -2][..], 4, DV2_ERR_INVALID_ARGUMENT, "draft[1] = -2"),
            (&[vocab][..], 4, DV2_ERR_INVALID_ARGUMENT, "draft[0]"),
            (&[1, 2, 3][..], 3, DV2_ERR_BUFFER_TOO_SMALL, "capacity 3"),
        ] {
            count = 7;
            expect(
                dv2_step_draft(
                    h,
                    draft.as_ptr(),
                    draft.len(),
                    out.as_mut_ptr(),
                    n_out,
                    &mut count,
                ),
                want,
                needle,
            );
            assert_eq!(count, 0, "{needle}");
            let mut p = 0;
            assert_eq!(dv2_position(h, &mut p), DV2_OK);
            assert_eq!(p, at, "{needle}: the request moved");
        }
        expect(
            dv2_step_draft(h, null(), 1, out.as_mut_ptr(), 2, &mut count),
            DV2_ERR_NULL_POINTER,
            "draft",
        );
        expect(
            dv2_step_draft(h, [1].as_ptr(), 1, null_mut(), 2, &mut count),
            DV2_ERR_NULL_POINTER,
            "out_ids",
        );
        let mut sampled = dv2_sampling_default();
        sampled.temperature = 0.8;
        assert_eq!(dv2_set_sampling(h, &sampled), DV2_OK);
        expect(
            dv2_step_draft(h, [1].as_ptr(), 1, out.as_mut_ptr(), 2, &mut count),
            DV2_ERR_INVALID_STATE,
            "plain greedy",
        );
        assert_eq!(dv2_set_sampling(h, &dv2_sampling_default()), DV2_OK);
        // The greedy continuation as a draft: every id kept, and the one after it.
        assert_eq!(next, greedy[0]);
        let n = 4.min(greedy.len() - 2);
        assert_eq!(
            dv2_step_draft(
                h,
                greedy[1..=n].as_ptr(),
                n,
                out.as_mut_ptr(),
                out.len(),
                &mut count
            ),
            DV2_OK
        );
        assert_eq!(&out[..count], &greedy[1..=n + 1]);
        let (mut checks, mut drafted, mut accepted) = (0u64, 0u64, 0u64);
        assert_eq!(
            dv2_speculation_stats(h, &mut checks, &mut drafted, &mut accepted),
            DV2_OK
        );
        assert_eq!((checks, drafted, accepted), (1, n as u64, n as u64));
        assert_eq!(
            dv2_speculation_stats(h, null_mut(), null_mut(), null_mut()),
            DV2_OK
        );
        // Speculation on: dv2_step_n's ids are still the greedy ones.
        assert_eq!(dv2_set_speculation(h, 8), DV2_OK);
    }
    still_usable(h, &case);
    // SAFETY: a live handle.
    unsafe { dv2_free(h) };
}
