//! Session 63: the CPU oracle's time, and a hash of every logit's bits, for medium_llama
//! teacher-forced over N positions and the Qwen2.5-3B shape over 4 tokens. To run it, copy it
//! to examples/oracle_time.rs, then `cargo run --release --example oracle_time -- N` (a second
//! argument: medium_llama only).
use decodev2::arch::{MEDIUM_LLAMA, QWEN25_3B};
use decodev2::oracle::{step_logits, KvCache};
use decodev2::synth;
use std::time::Instant;
fn hash(l: &[Vec<f32>]) -> u64 {
    l.iter().flatten().fold(0xcbf29ce484222325u64, |h, v| {
        (h ^ v.to_bits() as u64).wrapping_mul(0x100000001b3)
    })
}
fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().unwrap())
        .unwrap_or(2000);
    let mut spec = MEDIUM_LLAMA;
    spec.max_seq = n;
    let model = synth::build(&spec, 1).unwrap();
    let ids = synth::prompt(spec.vocab, n, 101);
    let t = Instant::now();
    let l = step_logits(&model, &mut KvCache::new(&spec, n).unwrap(), &ids, 0).unwrap();
    let s: f64 = l.iter().flatten().map(|v| *v as f64).sum();
    println!(
        "medium {n}: {:.2} s  checksum {s:.6} hash {:016x}",
        t.elapsed().as_secs_f64(),
        hash(&l)
    );
    if std::env::args().nth(2).is_some() {
        return;
    }
    let mut spec = QWEN25_3B;
    spec.max_seq = 8;
    let t = Instant::now();
    let model = synth::build(&spec, 1).unwrap();
    println!("3b build {:.2} s", t.elapsed().as_secs_f64());
    let ids = synth::prompt(spec.vocab, 4, 101);
    let t = Instant::now();
    let l = step_logits(&model, &mut KvCache::new(&spec, 8).unwrap(), &ids, 0).unwrap();
    let s: f64 = l.iter().flatten().map(|v| *v as f64).sum();
    println!(
        "3b 4 tokens: {:.2} s  checksum {s:.6} hash {:016x}",
        t.elapsed().as_secs_f64(),
        hash(&l)
    );
}
