fn main() {
    let target = decodev2_fuzz::smollm2_text_target().expect("SmolLM2's GGUF (DV2_SMOLLM2_GGUF)");
    afl::fuzz!(|data: &[u8]| decodev2_fuzz::text(&target, data));
}
