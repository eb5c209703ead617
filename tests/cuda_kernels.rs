//! Every kernel compiles through the library's own NVRTC path on any machine with libnvrtc (no
//! GPU needed): for the H200's sm_90 under the default configuration and with every switch
//! that compiles kernels in or out flipped, and for every architecture the backend takes
//! (sm_80 to sm_120). Without libnvrtc: SKIP (a failure under DV2_REQUIRE_CUDA=1).

use decodev2::config::Config;
use decodev2::cuda::kernels::{compile, compile_decode, nvrtc_present, BENCH};

#[test]
fn decode_kernels_compile_for_sm_90() {
    if !nvrtc_present() {
        assert!(
            std::env::var_os("DV2_REQUIRE_CUDA").is_none(),
            "DV2_REQUIRE_CUDA is set but libnvrtc.so.13 was not found"
        );
        println!("SKIP: libnvrtc.so.13 not found (set LD_LIBRARY_PATH to a CUDA 13 lib dir)");
        return;
    }
    // A private cache dir so this really runs NVRTC rather than reading an old cubin.
    let dir = std::env::temp_dir().join(format!("dv2-kernel-cache-{}", std::process::id()));
    let cfg = Config {
        cache_dir: Some(dir.clone()),
        kernel_dir: None,
        ..Config::default()
    };
    let cubin = compile_decode("sm_90", &cfg).unwrap_or_else(|e| panic!("{e}"));
    assert!(cubin.starts_with(b"\x7fELF"), "a cubin is an ELF image");
    // The second compile is served from the disk cache, byte for byte.
    let cached = std::fs::read_dir(&dir).unwrap().count();
    assert_eq!(cached, 1);
    assert_eq!(compile_decode("sm_90", &cfg).unwrap(), cubin);
    assert!(compile(&BENCH, "sm_90", &cfg)
        .unwrap()
        .starts_with(b"\x7fELF"));
    // The kernels the switches leave out, and the timeline's records compiled in.
    let flipped = Config {
        logits_argmax: false,
        qkv_khalves: false,
        cta_timeline: true,
        ..cfg.clone()
    };
    let other = compile_decode("sm_90", &flipped).unwrap_or_else(|e| panic!("{e}"));
    assert!(other.starts_with(b"\x7fELF") && other != cubin);
    // Ampere, Ada, Blackwell: the kernels without Hopper's clusters and PDL where the
    // architecture lacks them (kernels/common.cuh), the rest as on sm_90.
    for arch in ["sm_80", "sm_86", "sm_89", "sm_100", "sm_120"] {
        let cubin = compile_decode(arch, &cfg).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert!(cubin.starts_with(b"\x7fELF"), "{arch}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
