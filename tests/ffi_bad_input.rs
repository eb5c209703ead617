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
            CStr::from_ptr(dv2_status_name(DV2_FINISHED))
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
