fn main() {
    let dir = std::env::temp_dir().join(format!("dv2-fuzz-hf-tokenizer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    afl::fuzz!(|data: &[u8]| decodev2_fuzz::hf_tokenizer(&dir, data));
}
