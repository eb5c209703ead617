//! Converts a model once into a Hugging Face directory with bitsandbytes 4-bit (nf4) linears,
//! which decodev2 then loads with no re-quantization and transformers + bitsandbytes read as
//! their own `load_in_4bit` save (src/save.rs).
//!
//!     cargo run --release --example convert_bnb -- IN OUT
//!     cargo run --release --example convert_bnb -- --synthetic PRESET SEED OUT
//!
//! IN is anything `dv2_load` reads (a GGUF file, a Hugging Face directory). The tokenizer files
//! of a Hugging Face directory are copied; a GGUF's tokenizer is not written.

use std::path::Path;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let t = Instant::now();
    let (model, source, out) = match args.as_slice() {
        [flag, preset, seed, out] if flag == "--synthetic" => {
            let spec = decodev2::arch::preset(preset).unwrap_or_else(|e| fail(&e));
            let seed = seed
                .parse()
                .unwrap_or_else(|_| fail(&format!("seed {seed}")));
            let model = decodev2::synth::build(&spec, seed).unwrap_or_else(|e| fail(&e));
            (model, None, out)
        }
        [input, out] => {
            let model = decodev2::load::load(Path::new(input)).unwrap_or_else(|e| fail(&e));
            (model, Some(Path::new(input)), out)
        }
        _ => fail(&"usage: convert_bnb IN OUT | convert_bnb --synthetic PRESET SEED OUT"),
    };
    let read_s = t.elapsed().as_secs_f64();
    let out = Path::new(out);
    decodev2::save::write_bnb_dir(&model, out).unwrap_or_else(|e| fail(&e));
    let mut copied = Vec::new();
    for name in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        if let Some(from) = source.map(|dir| dir.join(name)).filter(|p| p.is_file()) {
            std::fs::copy(&from, out.join(name)).unwrap_or_else(|e| fail(&e));
            copied.push(name);
        }
    }
    println!(
        "read in {read_s:.1} s, wrote {} in {:.1} s{}",
        out.display(),
        t.elapsed().as_secs_f64() - read_s,
        if copied.is_empty() {
            String::new()
        } else {
            format!(" (with {})", copied.join(", "))
        }
    );
}

fn fail(e: &dyn std::fmt::Display) -> ! {
    eprintln!("convert_bnb: {e}");
    std::process::exit(1);
}
