//! What a host sees on a machine whose CUDA driver is older than the library needs (issue 37):
//! a stand-in libcuda.so (and .so.1) that reports CUDA 11.8 (cuDriverGetVersion, the only entry point
//! the check calls) is put first on the library path of a child process. There, the CUDA
//! backend is refused with `BackendUnavailable` naming both versions (through the C ABI:
//! DV2_ERR_BACKEND_UNAVAILABLE), and `auto` runs the model on the CPU.

use std::process::Command;

use decodev2::engine::{BackendKind, Engine, EngineOptions};
use decodev2::Error;

const CHILD: &str = "DV2_OLD_DRIVER_CHILD";

const FAKE_DRIVER: &str = r#"
int cuDriverGetVersion(int *version) { *version = 11080; return 0; }
int cuInit(unsigned flags) { (void)flags; return 0; }
"#;

#[test]
fn a_driver_too_old_is_a_clear_refusal() {
    if std::env::var_os(CHILD).is_some() {
        child();
        return;
    }
    let dir = std::env::temp_dir().join(format!("dv2-old-driver-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("fake.c"), FAKE_DRIVER).unwrap();
    let built = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(dir.join("libcuda.so.1"))
        .arg(dir.join("fake.c"))
        .status();
    if !built.is_ok_and(|s| s.success()) {
        println!("SKIP: no C compiler here to build the stand-in driver");
        return;
    }
    // The loader tries libcuda.so before libcuda.so.1: a machine with a driver has both.
    std::fs::copy(dir.join("libcuda.so.1"), dir.join("libcuda.so")).unwrap();
    let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_driver_too_old_is_a_clear_refusal",
            "--nocapture",
        ])
        .env(CHILD, "1")
        .env("LD_LIBRARY_PATH", format!("{}:{path}", dir.display()))
        .env_remove("DV2_REQUIRE_CUDA")
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    println!("{text}");
    assert!(out.status.success() && text.contains("refused: "), "{text}");
}

/// In the child, with the stand-in driver first on the library path.
fn child() {
    let cuda = EngineOptions {
        backend: BackendKind::Cuda,
        ..EngineOptions::default()
    };
    match Engine::load_synthetic("tiny_llama", 0, &cuda) {
        Err(Error::BackendUnavailable(m)) => {
            assert!(
                m.contains("CUDA 11.8") && m.contains("12.0 or later"),
                "{m}"
            );
            println!("refused: {m}");
        }
        other => panic!(
            "a CUDA 11.8 driver gave {:?}",
            other.map(|e| e.backend_name())
        ),
    }
    let auto = Engine::load_synthetic("tiny_llama", 0, &EngineOptions::default()).unwrap();
    assert_eq!(auto.backend_name(), "cpu");
    use decodev2::ffi::*;
    let mut opts = dv2_options_default();
    opts.backend = dv2_backend::DV2_BACKEND_CUDA as i32;
    let mut h = std::ptr::null_mut();
    // SAFETY: valid strings and out-pointer.
    let status = unsafe { dv2_load_synthetic(c"tiny_llama".as_ptr(), 0, &opts, &mut h) };
    assert_eq!(status, dv2_status::DV2_ERR_BACKEND_UNAVAILABLE);
    assert!(h.is_null());
}
