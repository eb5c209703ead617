//! include/decodev2.h must be what cbindgen generates from src/ffi.rs today.
//! Regenerate: DV2_REGEN_HEADER=1 cargo test --test header

use std::path::PathBuf;

#[test]
fn checked_in_header_is_current() {
    if !std::path::Path::new(env!("CARGO")).exists() {
        println!("SKIP: cbindgen needs cargo, which this machine lacks");
        return;
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(root.join("cbindgen.toml")).unwrap();
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(&root)
        .with_config(config)
        .generate()
        .expect("cbindgen")
        .write(&mut generated);
    let generated = String::from_utf8(generated).unwrap();
    let path = root.join("include/decodev2.h");
    if std::env::var_os("DV2_REGEN_HEADER").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "include/decodev2.h is stale: DV2_REGEN_HEADER=1 cargo test --test header"
    );
}
