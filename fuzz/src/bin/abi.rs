fn main() {
    let model =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/gguf/seed-tiny-llama-bpe");
    let target = decodev2_fuzz::AbiTarget::new(&model).expect("the tiny GGUF loads on the CPU");
    // A panic ends the process (AFL's crash): no state of the handle is seen after one.
    let target = std::panic::AssertUnwindSafe(target);
    afl::fuzz!(|data: &[u8]| decodev2_fuzz::abi(&target, data));
}
