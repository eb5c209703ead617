//! The one place that reads the environment: every `DV2_*` variable the library takes, in one
//! table ([`VARIABLES`]), and the values read from it ([`Config`]).
//!
//! Two kinds, as the README's table lists them: *switches* turn off a fusion or path that is
//! on by default, so that its worth can be re-measured against its absence (docs/lab.md holds
//! each measurement); *tools* set a resource or a measuring aid. Every variant that lost its
//! measurement was deleted; commit a1b9aaa is the last to hold them all (docs/lab.md, "The
//! variants' record").

use std::path::PathBuf;
use std::sync::OnceLock;

/// One environment variable: its name, its default, what setting it does, and the lab row
/// that measured it (or why it exists).
pub struct Variable {
    pub name: &'static str,
    pub default: &'static str,
    pub effect: &'static str,
    pub lab: &'static str,
}

/// Every variable the library reads. The README's switch table is this table
/// ([`readme_table`]; a test checks that the two agree).
pub const VARIABLES: &[Variable] = &[
    Variable {
        name: "DV2_GRAPH",
        default: "1",
        effect: "`0`: every decode step launched eagerly instead of replaying the captured graph",
        lab: "session 20: medium 0.0545-0.0555 ms/step graph, 0.0728-0.0995 eager",
    },
    Variable {
        name: "DV2_PDL",
        default: "1",
        effect: "`0`: no programmatic dependent launch (each kernel waits for the previous to end)",
        lab: "session 3: medium 0.0795 ms/step, 0.1057 off (80fe342)",
    },
    Variable {
        name: "DV2_FUSE_RMS",
        default: "1",
        effect: "`0`: each RMSNorm as its own kernel instead of folded into the next GEMV's x load",
        lab: "default since 8ab5c0d",
    },
    Variable {
        name: "DV2_FFN_F16",
        default: "1",
        effect: "`0`: the SwiGLU output written as f32 for down instead of f16 (the same bits)",
        lab: "session 12: -0.02..-0.03 ms/token (9bc9457)",
    },
    Variable {
        name: "DV2_QKV_KHALVES",
        default: "1",
        effect: "`0`: q/k/v's GEMV v3 in one part instead of two K halves",
        lab: "session 19, runs 5-10: -0.007..-0.014 ms/token",
    },
    Variable {
        name: "DV2_LOGITS_ARGMAX",
        default: "1",
        effect: "`0`: argmax_logits and commit_step after lm_head instead of inside its kernel",
        lab: "session 16, runs 2 and 6: +0.0017 (argmax) and +0.0007 (commit) ms/token off",
    },
    Variable {
        name: "DV2_LOGITS_W20",
        default: "1",
        effect: "`0`: lm_head and its argmax at K = 5,120 (the 32B shape) by the J = 3 walk \
                 instead of SwiGLU's 20-warp walk",
        lab: "sessions 46-47: 32B lm_head 152 -> 112 us (ncu), 151 -> 107 us (trace); \
              off -0.4..-0.6% at 48, -0.7% at 8k",
    },
    Variable {
        name: "DV2_DOWN_W27",
        default: "1",
        effect: "`0`: down at K = 27,648 (the 32B shape) by the 16-warp K walk instead of \
                 27 warps walking whole rows",
        lab: "session 49: off -1.05/-2.25% at 48 and -1.58/-1.20% at 8k (the two load orders)",
    },
    Variable {
        name: "DV2_LOADS_FIRST",
        default: "1",
        effect: "`0`: the one-CTA-an-SM walks (SwiGLU, down and lm_head at the 32B shape) build \
                 their codebook table before their first weight loads instead of after",
        lab: "session 50: +1.75/+2.03% at 48 and +1.20/+1.00% at 8k (the two load orders)",
    },
    Variable {
        name: "DV2_HOPPER",
        default: "1",
        effect: "`0`: no thread-block clusters and no programmatic dependent launch even on \
                 sm_90+ (the path GPUs before Hopper take, measurable on an H100/H200)",
        lab: "session 21 (issue 37)",
    },
    Variable {
        name: "DV2_ATTN_LONG",
        default: "1",
        effect: "`0`: no long-context decode attention (flash-decoding over the whole GPU, at \
                 every depth; without clusters, its splits merged by attn2_merge): attention v2",
        lab: "sessions 22 (the context sweep), 28 (from depth 1) and 39 (the 32B shape); without \
              clusters session 67 (+3.7% at 48, +5.7% at 2k, +23% at 8k, +81% at 32k)",
    },
    Variable {
        name: "DV2_SAMPLE_SHORTCUTS",
        default: "1",
        effect: "`0`: the sampler finds top-k's and top-p's thresholds by its select passes alone \
                 (no one-CTA finish over top-k's candidates, no top-p draw by rejection)",
        lab: "session 25: 3B, llama.cpp defaults 97.2% of greedy at 48, 94.4% without (a6b4bf5)",
    },
    Variable {
        name: "DV2_PREFILL",
        default: "chunks",
        effect: "`n1`: the prompt fed token by token through the decode step instead of chunks",
        lab: "2026-11-29, chunked tensor-core prefill (issue 6)",
    },
    Variable {
        name: "DV2_PREFILL_SPLIT",
        default: "1",
        effect: "`0`: a prefill chunk's tensor-core attention never splits its slots (it splits \
                 them where its CTAs would leave SMs idle: a short chunk deep in the context, a \
                 chat's next turn after dv2_rewind)",
        lab: "sessions 68-69: 3B, a 32-id turn's first id on an H100 4.56 -> 3.0 ms after 2k, \
              10.5 -> 3.6 after 8k, 34.0 -> 4.7 after 32k",
    },
    Variable {
        name: "DV2_PREFILL_GEMV",
        default: "1",
        effect: "`0`: a prefill chunk of up to 8 ids through the tensor-core GEMM instead of GEMV \
                 v3 over its columns (one MMA serving every column)",
        lab: "session 72: 3B, a chunk of 1 to 8 ids after a rewind on an H100 1-13% sooner \
              (4 ids at depth 48: 1.69 against 1.95 ms); whole prompts within the spread",
    },
    Variable {
        name: "DV2_COLS_X_L2",
        default: "1",
        effect: "`0`: GEMV v3's column kernels stage x in shared memory before their weights, \
                 in as many launches as fit, where each group of 16 outputs has a CTA of its \
                 own (the 3B shape's q/k/v, o and down in a check of up to 8 ids), instead of \
                 reading it from L2 beside the weights in one launch",
        lab: "session 74: 3B, a check of 7 ids on an H100 2.5% sooner at depth 48 (2.044 -> \
              1.992 ms), 2.9% at 8k (2.517 -> 2.443); session 76, x under 64 KiB too: 1 id on \
              an H200 8.7% sooner at 48 (1.882 -> 1.719 ms), 8.0% at 8k; 7 and 15 unchanged",
    },
    Variable {
        name: "DV2_COLS_SPLIT",
        default: "1",
        effect: "`0`: where those kernels read x from L2 and their groups of 16 outputs alone \
                 would fill under half the CTA slots (the 3B shape's o and down), a CTA a group \
                 instead of a cluster of two that split the group's K",
        lab: "session 75: 3B, a check of 7 ids on an H200 7.2% sooner at depth 48 (2.008 -> \
              1.864 ms), 6.4% at 8k (2.460 -> 2.302); down 13.6 -> 8.8 us a launch; 1 and 15 \
              ids unchanged",
    },
    Variable {
        name: "DV2_QKV_ROPE",
        default: "1",
        effect: "`0`: a short chunk's q/k/v column kernel stores its columns plain and \
                 rope_kv_rows then rotates q and k and writes the cache, instead of the kernel \
                 applying RoPE and writing k and v into the cache itself",
        lab: "session 78: 3B on an H100, a check of 1 id 6.9% sooner at depth 48 (1.781 -> \
              1.659 ms), 5.8% at 8k, 4.7% at 32k; 7 ids 6.4%, 0.7%, 3.8%; 15 unchanged",
    },
    Variable {
        name: "DV2_PREFILL_TAIL",
        default: "1",
        effect: "`0`: the prompt's last layer on every token instead of the last token alone",
        lab: "session 6: 48-token first token 5.19 ms, 5.31 off (1c5389d)",
    },
    Variable {
        name: "DV2_LINEAR",
        default: "gemv",
        effect: "`mma`: the decode step's linears through the prefill's tensor-core GEMM at N = 1 \
                 (the seed's ablation)",
        lab: "seed §6",
    },
    Variable {
        name: "DV2_MAPPED_CODES",
        default: "1",
        effect: "`0`: a bitsandbytes directory's 4-bit codes copied out of the file's map at load \
                 instead of uploaded from where they lie",
        lab: "session 35: 32B bitsandbytes warm read 2.3-2.5 s copied, 1.0-1.3 s mapped",
    },
    Variable {
        name: "DV2_STAGED_UPLOAD",
        default: "1",
        effect: "`0`: each weight tensor, and a state file's KV slots, copied between the host \
                 and the device through pageable memory instead of through two page-locked \
                 buffers (filled on every core for the weights)",
        lab: "session 35: 32B bitsandbytes upload 2.5-3.4 s pageable, 1.4-1.6 s staged",
    },
    Variable {
        name: "DV2_PREFILL_CHUNK",
        default: "1024",
        effect: "tool: prompt tokens per prefill chunk (1 to 1024)",
        lab: "2026-11-29, chunked tensor-core prefill (issue 6)",
    },
    Variable {
        name: "DV2_THREADS",
        default: "all cores",
        effect: "tool: worker threads of the CPU backend and the loaders",
        lab: "-",
    },
    Variable {
        name: "DV2_KERNEL_DIR",
        default: "embedded",
        effect: "tool: a folder of kernels/*.cu to compile instead of the embedded copies",
        lab: "-",
    },
    Variable {
        name: "DV2_CACHE_DIR",
        default: "~/.cache/decodev2",
        effect: "tool: where compiled kernels (cubins) are cached; loads that miss it together \
                 compile a unit once (compile.lock). NVRTC 12.9+ keeps its own copy in the driver's \
                 compute cache (`CUDA_CACHE_PATH`; `CUDA_CACHE_DISABLE=1` turns it off)",
        lab: "-",
    },
    Variable {
        name: "DV2_LINEINFO",
        default: "0",
        effect: "tool: `1` compiles the kernels with source line information (profilers)",
        lab: "-",
    },
    Variable {
        name: "DV2_CTA_TIMELINE",
        default: "0",
        effect: "tool: `1` compiles in per-CTA start/wait/end records (tests/gpu/cta-timeline.sh)",
        lab: "session 18",
    },
];

/// The values of [`VARIABLES`] that shape the backends: read from the environment when a
/// backend loads (so one process can load engines under different settings), never written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    pub graph: bool,
    pub pdl: bool,
    /// Hopper's clusters and programmatic dependent launch where the device has them.
    pub hopper: bool,
    pub fuse_rms: bool,
    pub ffn_f16: bool,
    pub qkv_khalves: bool,
    pub logits_argmax: bool,
    pub logits_w20: bool,
    pub down_w27: bool,
    /// The one-CTA-an-SM walks' first weight loads before their table build.
    pub loads_first: bool,
    pub attn_long: bool,
    /// Experiment, off unless `DV2_X_TAIL_MERGE=1` until a device measures it (docs/lab.md,
    /// session 87): attention v2's and the flat long attention's splits merged by their own
    /// last CTAs instead of attn2_merge.
    pub tail_merge: bool,
    pub sample_shortcuts: bool,
    /// The prompt through the decode step, token by token (`DV2_PREFILL=n1`).
    pub prefill_by_steps: bool,
    pub prefill_tail: bool,
    /// A tensor-core prefill attention whose CTAs leave SMs idle splits its slots.
    pub prefill_split: bool,
    /// A prefill chunk of up to GEMV3_COLS ids through GEMV v3's column kernels.
    pub prefill_gemv: bool,
    /// GEMV v3's column kernels read x from L2 instead of staging it, where each group of
    /// outputs has a CTA of its own.
    pub cols_x_l2: bool,
    /// Those kernels split a group's K across a cluster of two CTAs where one CTA a group
    /// leaves half the SMs' slots empty.
    pub cols_split: bool,
    /// A short chunk's q/k/v column kernel applies RoPE and writes the cache itself, with no
    /// rope_kv_rows after it.
    pub qkv_rope: bool,
    /// The decode step's linears through the tensor-core GEMM (`DV2_LINEAR=mma`).
    pub linear_mma: bool,
    /// A bitsandbytes linear's codes left in the file's map until uploaded.
    pub mapped_codes: bool,
    /// The weights uploaded through page-locked staging buffers.
    pub staged_upload: bool,
    /// `DV2_PREFILL_CHUNK` as given (parsed by the prefill, which reports a bad value).
    pub prefill_chunk: Option<String>,
    pub kernel_dir: Option<PathBuf>,
    pub cache_dir: Option<PathBuf>,
    pub lineinfo: bool,
    pub cta_timeline: bool,
}

impl Default for Config {
    /// Every switch at its default, no tool set: what the environment gives when empty.
    fn default() -> Self {
        Self::read(|_| None)
    }
}

impl Config {
    /// The configuration the environment gives now.
    pub fn from_env() -> Self {
        Self::read(|name| std::env::var(name).ok())
    }

    fn read(var: impl Fn(&str) -> Option<String>) -> Self {
        // A switch is on unless set to "0".
        let on = |name: &str| var(name).as_deref() != Some("0");
        let is = |name: &str, value: &str| var(name).as_deref() == Some(value);
        Self {
            graph: on("DV2_GRAPH"),
            pdl: on("DV2_PDL"),
            hopper: on("DV2_HOPPER"),
            fuse_rms: on("DV2_FUSE_RMS"),
            ffn_f16: on("DV2_FFN_F16"),
            qkv_khalves: on("DV2_QKV_KHALVES"),
            logits_argmax: on("DV2_LOGITS_ARGMAX"),
            logits_w20: on("DV2_LOGITS_W20"),
            down_w27: on("DV2_DOWN_W27"),
            loads_first: on("DV2_LOADS_FIRST"),
            attn_long: on("DV2_ATTN_LONG"),
            tail_merge: is("DV2_X_TAIL_MERGE", "1"),
            sample_shortcuts: on("DV2_SAMPLE_SHORTCUTS"),
            prefill_by_steps: is("DV2_PREFILL", "n1"),
            prefill_tail: on("DV2_PREFILL_TAIL"),
            prefill_split: on("DV2_PREFILL_SPLIT"),
            prefill_gemv: on("DV2_PREFILL_GEMV"),
            cols_x_l2: on("DV2_COLS_X_L2"),
            cols_split: on("DV2_COLS_SPLIT"),
            qkv_rope: on("DV2_QKV_ROPE"),
            linear_mma: is("DV2_LINEAR", "mma"),
            mapped_codes: on("DV2_MAPPED_CODES"),
            staged_upload: on("DV2_STAGED_UPLOAD"),
            prefill_chunk: var("DV2_PREFILL_CHUNK"),
            kernel_dir: var("DV2_KERNEL_DIR").map(PathBuf::from),
            cache_dir: var("DV2_CACHE_DIR")
                .map(PathBuf::from)
                .or_else(|| default_cache_dir(&var)),
            lineinfo: is("DV2_LINEINFO", "1"),
            cta_timeline: is("DV2_CTA_TIMELINE", "1"),
        }
    }

    /// The NVRTC `-D` options the configuration sets: the kernels it compiles in or out.
    pub fn nvrtc_defines(&self) -> Vec<String> {
        [
            ("GEMV2_LOGITS", self.logits_argmax),
            ("GEMV3_KHALVES", self.qkv_khalves),
            ("GEMV2_LOADS_FIRST", self.loads_first),
            ("CTA_TIMELINE", self.cta_timeline),
        ]
        .iter()
        .map(|(name, on)| format!("-D{name}={}", i32::from(*on)))
        .collect()
    }
}

/// [`VARIABLES`] as the README's markdown table.
pub fn readme_table() -> String {
    let mut t = String::from(
        "| variable | default | setting it | measured (docs/lab.md) |\n| --- | --- | --- | --- |\n",
    );
    for v in VARIABLES {
        t += &format!(
            "| `{}` | {} | {} | {} |\n",
            v.name, v.default, v.effect, v.lab
        );
    }
    t
}

/// `$XDG_CACHE_HOME/decodev2`, else `~/.cache/decodev2`.
fn default_cache_dir(var: &impl Fn(&str) -> Option<String>) -> Option<PathBuf> {
    let base = var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("decodev2"))
}

/// Worker threads: `DV2_THREADS` if set to a positive number, else the machine's
/// parallelism. Read once per process (the CPU loops size their work by it).
pub fn threads() -> usize {
    static THREADS: OnceLock<usize> = OnceLock::new();
    *THREADS.get_or_init(|| {
        std::env::var("DV2_THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|n| *n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> Config {
        Config::read(|name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn switches_are_on_unless_set_to_zero() {
        let c = Config::default();
        assert!(c.graph && c.pdl && c.fuse_rms && c.ffn_f16 && c.qkv_khalves);
        assert!(c.logits_argmax && c.attn_long && c.prefill_tail);
        assert!(c.prefill_split && c.prefill_gemv && c.cols_x_l2 && c.cols_split && c.qkv_rope);
        assert!(c.logits_w20 && c.down_w27 && c.loads_first && c.mapped_codes && c.staged_upload);
        assert!(!c.prefill_by_steps && !c.linear_mma && !c.lineinfo && !c.cta_timeline);
        let c = with(&[
            ("DV2_FUSE_RMS", "0"),
            ("DV2_PDL", "1"),
            ("DV2_LINEAR", "mma"),
        ]);
        assert!(!c.fuse_rms && c.pdl && c.linear_mma);
    }

    #[test]
    fn every_variable_read_is_in_the_table() {
        // Each name the reader asks for, recorded; the table must list exactly those.
        let asked = std::cell::RefCell::new(Vec::new());
        Config::read(|name| {
            asked.borrow_mut().push(name.to_string());
            None
        });
        let mut asked = asked.into_inner();
        // DV2_X_*: an experiment's knob, measured and then promoted or deleted (docs/lab.md).
        asked.retain(|n| n.starts_with("DV2_") && !n.starts_with("DV2_X_"));
        asked.push("DV2_THREADS".into());
        asked.sort();
        asked.dedup();
        let mut table: Vec<String> = VARIABLES.iter().map(|v| v.name.to_string()).collect();
        table.sort();
        assert_eq!(asked, table);
    }

    #[test]
    fn the_readme_lists_this_table() {
        let readme = include_str!("../README.md");
        assert!(
            readme.contains(&readme_table()),
            "README.md's environment table is stale; it should read:\n{}",
            readme_table()
        );
    }

    #[test]
    fn defines_follow_the_switches() {
        let d = with(&[
            ("DV2_QKV_KHALVES", "0"),
            ("DV2_LOADS_FIRST", "0"),
            ("DV2_CTA_TIMELINE", "1"),
        ])
        .nvrtc_defines();
        assert_eq!(
            d,
            [
                "-DGEMV2_LOGITS=1",
                "-DGEMV3_KHALVES=0",
                "-DGEMV2_LOADS_FIRST=0",
                "-DCTA_TIMELINE=1"
            ]
        );
    }
}
