fn main() {
    let dir = std::env::temp_dir().join(format!("dv2-spm-text-{}", std::process::id()));
    let target = decodev2_fuzz::spm_text_target(&dir).expect("the SentencePiece fixture reads");
    afl::fuzz!(|data: &[u8]| decodev2_fuzz::text(&target, data));
}
