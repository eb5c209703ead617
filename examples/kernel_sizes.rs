//! SASS instructions per kernel of the decode unit, compiled here by NVRTC (no GPU needed):
//! the code each warp fetches. Code that a kernel's warps run once costs its cold fetch
//! every layer (docs/lab.md, session 13: 0.5-1.5 ns per instruction), so this ranks what to
//! trim before a device run measures it. The switches compiled in as NVRTC defines
//! (src/config.rs, `nvrtc_defines`) apply as they do at load.
//!
//!     LD_LIBRARY_PATH=<dir holding libnvrtc> cargo run --release --example kernel_sizes \
//!         [--arch sm_90] [--cubin PATH] [name filters...]
//!
//! `--cubin PATH` also writes the cubin (for `cuobjdump -sass` or `nvdisasm`).
//!
//! Prints each kernel whose name contains one of the filters (all without filters) with its
//! instruction count (16 bytes each on sm_70 and later), largest first.

use decodev2::config::Config;
use decodev2::cuda::kernels::{compile_decode, nvrtc_present};

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut option = |flag: &str| match args.iter().position(|a| a == flag) {
        Some(i) if i + 1 < args.len() => {
            let value = args.remove(i + 1);
            args.remove(i);
            Some(value)
        }
        _ => None,
    };
    let arch = option("--arch").unwrap_or_else(|| "sm_90".to_string());
    let cubin_path = option("--cubin");
    if !nvrtc_present() {
        eprintln!("libnvrtc not found: set LD_LIBRARY_PATH to the directory that holds it");
        std::process::exit(2);
    }
    let cubin = compile_decode(&arch, &Config::from_env()).unwrap_or_else(|e| {
        eprintln!("compiling the decode unit for {arch}: {e}");
        std::process::exit(1);
    });
    if let Some(path) = &cubin_path {
        std::fs::write(path, &cubin).unwrap_or_else(|e| {
            eprintln!("writing {path}: {e}");
            std::process::exit(1);
        });
    }
    let mut kernels = text_sections(&cubin).unwrap_or_else(|e| {
        eprintln!("reading the cubin: {e}");
        std::process::exit(1);
    });
    kernels.retain(|(name, _)| args.is_empty() || args.iter().any(|f| name.contains(f)));
    kernels.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    println!("{:<40} {:>12}", format!("kernel ({arch})"), "instructions");
    for (name, bytes) in &kernels {
        println!("{name:<40} {:>12}", bytes / 16);
    }
}

/// Name and size in bytes of each `.text.<kernel>` section of a little-endian ELF64 file.
fn text_sections(elf: &[u8]) -> Result<Vec<(String, usize)>, String> {
    let field = |at: usize, len: usize| -> Result<u64, String> {
        let bytes = elf.get(at..at + len).ok_or("truncated ELF")?;
        Ok(bytes
            .iter()
            .rev()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    };
    if elf.get(..4) != Some(b"\x7fELF") || elf.get(4) != Some(&2) || elf.get(5) != Some(&1) {
        return Err("not a little-endian ELF64 file".into());
    }
    let (shoff, shentsize) = (field(0x28, 8)? as usize, field(0x3a, 2)? as usize);
    let (shnum, shstrndx) = (field(0x3c, 2)? as usize, field(0x3e, 2)? as usize);
    let header = |i: usize| shoff + i * shentsize;
    // sh_name at 0 (4 bytes), sh_offset at 24 and sh_size at 32 (8 bytes each).
    let strtab = field(header(shstrndx) + 24, 8)? as usize;
    let mut out = Vec::new();
    for i in 0..shnum {
        let name_at = strtab + field(header(i), 4)? as usize;
        let name_len = elf
            .get(name_at..)
            .and_then(|rest| rest.iter().position(|&b| b == 0))
            .ok_or("section name past the end of the file")?;
        let name = String::from_utf8_lossy(&elf[name_at..name_at + name_len]);
        if let Some(kernel) = name.strip_prefix(".text.") {
            out.push((kernel.to_string(), field(header(i) + 32, 8)? as usize));
        }
    }
    Ok(out)
}
