//! Sampling the next id from a step's logits: penalties over the request's recent ids, then
//! temperature, top-k, top-p and min-p, then a draw from what is left, renormalized. This is
//! the reference every backend's sampler is held to (the CUDA one, kernels/sample.cu, computes
//! the same function).
//!
//! Each truncation keeps the ids at or above a logit, so ids of equal logits are kept or
//! dropped together: top-k keeps the logits at least the k-th largest (ties at the k-th all
//! stay, as in Hugging Face's), top-p the ids whose more likely ids (strictly) weigh less than
//! top_p of the mass top-k kept, min-p the ids at least min_p as likely as the most likely.
//! The draw is a Gumbel-max: the kept id of the largest z + g, z = (logit - max) / temperature
//! in f32, g Gumbel noise from Philox4x32-10 keyed by the seed and counted by (the slot the id
//! will take, the id), so that the ids of a request depend on its seed alone, never on how the
//! steps are batched, and a device computes the draw in one parallel pass. Temperature 0 is the
//! greedy argmax (after the penalties, which default to none). A [`LogitBias`] is added to the
//! logits before all of it (as llama.cpp's chain and OpenAI's `logit_bias` do).

use crate::error::{Error, Result};

/// The sampling settings of a request (`dv2_sampling`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// 0: greedy. Logits are divided by it before the softmax.
    pub temperature: f32,
    /// Keep the ids whose logit is at least the k-th largest (0: all).
    pub top_k: i32,
    /// Keep the most likely ids until their probabilities sum to at least this (1: all).
    pub top_p: f32,
    /// Keep the ids at least this fraction as likely as the most likely one (0: all).
    pub min_p: f32,
    /// Logits of ids seen in the window: divided by it where positive, multiplied where not
    /// (1: none).
    pub repeat_penalty: f32,
    /// Subtracted once from the logit of an id seen in the window (0: none).
    pub presence_penalty: f32,
    /// Subtracted per occurrence in the window (0: none).
    pub frequency_penalty: f32,
    /// The window: the request's last n ids, prompt included (0: none; -1: all of them).
    pub penalty_last_n: i32,
    pub seed: u64,
}

impl Default for Sampling {
    /// Greedy: temperature 0, no truncation, no penalties.
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            seed: 0,
        }
    }
}

impl Sampling {
    /// Refuses values with no meaning, naming the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, v: String, want: &str| {
            Err(Error::InvalidArgument(format!(
                "sampling {field} = {v} ({want})"
            )))
        };
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad("temperature", self.temperature.to_string(), "finite, >= 0");
        }
        if self.top_k < 0 {
            return bad("top_k", self.top_k.to_string(), ">= 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", self.top_p.to_string(), "in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", self.min_p.to_string(), "in [0, 1]");
        }
        if !(self.repeat_penalty.is_finite() && self.repeat_penalty > 0.0) {
            return bad(
                "repeat_penalty",
                self.repeat_penalty.to_string(),
                "finite, > 0",
            );
        }
        for (field, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !v.is_finite() {
                return bad(field, v.to_string(), "finite");
            }
        }
        if self.penalty_last_n < -1 {
            return bad("penalty_last_n", self.penalty_last_n.to_string(), ">= -1");
        }
        Ok(())
    }

    /// Whether the logits pass through unchanged (no penalty applies).
    pub fn penalties_off(&self) -> bool {
        self.penalty_last_n == 0
            || (self.repeat_penalty == 1.0
                && self.presence_penalty == 0.0
                && self.frequency_penalty == 0.0)
    }

    /// Whether this is the plain greedy argmax of today's decode.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 && self.penalties_off()
    }

    /// ln(min_p) as the f32 both samplers compare z with (-inf where min_p is 0).
    pub fn log_min_p(&self) -> f32 {
        (self.min_p as f64).ln() as f32
    }

    /// The id for the slot `slot` (the position it will take) from `logits` (a logit bias
    /// applied already: [`LogitBias::applied`]); `history`: the request's ids so far.
    pub fn choose(&self, logits: &[f32], history: &[u32], slot: usize) -> u32 {
        let mut logits = logits.to_vec();
        self.penalize(&mut logits, history);
        if self.temperature == 0.0 {
            return crate::oracle::argmax(&logits);
        }
        let max = max_logit(&logits);
        let mut best: Option<(f32, u32)> = None;
        for id in self.kept(&logits) {
            let key = self.z(logits[id as usize], max) + gumbel(self.seed, slot as u64, id);
            // The lower id wins a tie (kept is in id order).
            if best.is_none_or(|(b, _)| key > b) {
                best = Some((key, id));
            }
        }
        best.map_or(0, |b| b.1)
    }

    /// z = (l - max) / temperature, in f32 as the device computes it.
    fn z(&self, l: f32, max: f32) -> f32 {
        (l - max) / self.temperature
    }

    /// The penalties over the window's ids, in place.
    pub fn penalize(&self, logits: &mut [f32], history: &[u32]) {
        if self.penalties_off() {
            return;
        }
        let window = match self.penalty_last_n {
            -1 => history,
            n => &history[history.len().saturating_sub(n as usize)..],
        };
        let mut counts = std::collections::BTreeMap::new();
        for &id in window {
            *counts.entry(id).or_insert(0u32) += 1;
        }
        for (id, count) in counts {
            let Some(l) = logits.get_mut(id as usize) else {
                continue;
            };
            if *l > 0.0 {
                *l /= self.repeat_penalty;
            } else {
                *l *= self.repeat_penalty;
            }
            *l -= count as f32 * self.frequency_penalty + self.presence_penalty;
        }
    }

    /// The ids (in id order) that temperature > 0, top-k, top-p and min-p keep from `logits`
    /// (penalized already); NaN logits are never kept.
    pub fn kept(&self, logits: &[f32]) -> Vec<u32> {
        let max = max_logit(logits);
        let mut ids: Vec<u32> = (0..logits.len() as u32)
            .filter(|&i| !logits[i as usize].is_nan())
            .collect();
        let by_logit = |ids: &[u32]| {
            let mut sorted: Vec<f32> = ids.iter().map(|&i| logits[i as usize]).collect();
            sorted.sort_unstable_by(|a, b| b.total_cmp(a));
            sorted
        };
        if self.top_k > 0 && (self.top_k as usize) < ids.len() {
            let kth = by_logit(&ids)[self.top_k as usize - 1];
            ids.retain(|&i| logits[i as usize] >= kth);
        }
        if self.top_p < 1.0 {
            let weight = |l: f32| (self.z(l, max) as f64).exp();
            let total: f64 = ids.iter().map(|&i| weight(logits[i as usize])).sum();
            // The lowest logit whose strictly larger kept logits weigh under top_p of the mass.
            let (mut above, mut floor) = (0.0, f32::INFINITY);
            let sorted = by_logit(&ids);
            let mut i = 0;
            while i < sorted.len() && above < self.top_p as f64 * total {
                floor = sorted[i];
                while i < sorted.len() && sorted[i] == floor {
                    above += weight(sorted[i]);
                    i += 1;
                }
            }
            ids.retain(|&i| logits[i as usize] >= floor);
        }
        if self.min_p > 0.0 {
            let log_min_p = self.log_min_p();
            ids.retain(|&i| self.z(logits[i as usize], max) >= log_min_p);
        }
        ids
    }

    /// The distribution the draw samples from (temperature > 0) over `logits` (penalized
    /// already): the kept ids, most likely first (the lower id first on a tie), with their
    /// probabilities renormalized over them.
    pub fn truncate(&self, logits: &[f32]) -> Vec<(u32, f64)> {
        let max = max_logit(logits);
        let mut kept: Vec<(u32, f64)> = self
            .kept(logits)
            .into_iter()
            .map(|i| (i, (self.z(logits[i as usize], max) as f64).exp()))
            .collect();
        let total: f64 = kept.iter().map(|k| k.1).sum();
        kept.iter_mut().for_each(|k| k.1 /= total);
        kept.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        kept
    }
}

/// The most ids a [`LogitBias`] holds (the device keeps them in a buffer of this size).
pub const MAX_LOGIT_BIAS: usize = 1024;

/// Values added to the logits of some ids before the penalties and the draw, greedy or not:
/// a large negative one bans an id (-inf: never chosen while another is possible), a positive
/// one favours it. Kept across requests until set again, as the sampling settings are.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LogitBias {
    /// (id, bias), in id order, each id once.
    entries: Vec<(u32, f32)>,
}

impl LogitBias {
    /// The bias of each `ids[i]` by `biases[i]`: refused (naming the entry) where an id is
    /// outside the vocabulary or repeated, a bias is NaN or +inf, or there are more than
    /// [`MAX_LOGIT_BIAS`].
    pub fn new(ids: &[i32], biases: &[f32], vocab: usize) -> Result<Self> {
        let bad = |why: String| Err(Error::InvalidArgument(format!("logit bias: {why}")));
        if ids.len() != biases.len() {
            return bad(format!("{} ids but {} biases", ids.len(), biases.len()));
        }
        if ids.len() > MAX_LOGIT_BIAS {
            return bad(format!("{} ids (at most {MAX_LOGIT_BIAS})", ids.len()));
        }
        let mut entries = Vec::with_capacity(ids.len());
        for (i, (&id, &bias)) in ids.iter().zip(biases).enumerate() {
            if id < 0 || id as usize >= vocab {
                return bad(format!(
                    "entry {i}: id {id} outside the vocabulary of {vocab}"
                ));
            }
            if bias.is_nan() || bias == f32::INFINITY {
                return bad(format!(
                    "entry {i}: bias {bias} for id {id} (finite or -inf)"
                ));
            }
            entries.push((id as u32, bias));
        }
        entries.sort_by_key(|e| e.0);
        if let Some(w) = entries.windows(2).find(|w| w[0].0 == w[1].0) {
            return bad(format!("id {} given twice", w[0].0));
        }
        Ok(Self { entries })
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// (id, bias) in id order.
    pub fn entries(&self) -> &[(u32, f32)] {
        &self.entries
    }

    /// `logits` with the biases added (f32, as the device adds them).
    pub fn applied(&self, logits: &[f32]) -> Vec<f32> {
        let mut out = logits.to_vec();
        for &(id, bias) in &self.entries {
            out[id as usize] += bias;
        }
        out
    }
}

/// The largest logit that is not NaN.
fn max_logit(logits: &[f32]) -> f32 {
    logits
        .iter()
        .filter(|l| !l.is_nan())
        .fold(f32::NEG_INFINITY, |m, &l| m.max(l))
}

/// The most top alternatives [`logprobs`] gives (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Log-probabilities of a forward's distribution, the log-softmax of its raw logits (before
/// penalties, temperature and truncation: what the model says, as OpenAI's `logprobs` give).
#[derive(Clone, Debug, PartialEq)]
pub struct Logprobs {
    /// That of the id asked about.
    pub id: f32,
    /// The `n_top` most likely ids, most likely first (the lower id first on a tie).
    pub top: Vec<(u32, f32)>,
}

/// [`Logprobs`] of `id` and the `n_top` (at most [`MAX_TOP_LOGPROBS`]) most likely ids under
/// `logits`; the normalizer summed in f64.
pub fn logprobs(logits: &[f32], id: u32, n_top: usize) -> Result<Logprobs> {
    if id as usize >= logits.len() {
        return Err(Error::InvalidArgument(format!(
            "id {id} is out of range (vocab {})",
            logits.len()
        )));
    }
    if n_top > MAX_TOP_LOGPROBS {
        return Err(Error::InvalidArgument(format!(
            "n_top = {n_top} (at most {MAX_TOP_LOGPROBS})"
        )));
    }
    if let Some(i) = logits.iter().position(|l| !l.is_finite()) {
        return Err(Error::NonFinite(format!(
            "logit {i} is {}: the last forward's log-probabilities are undefined (reset to \
             start again)",
            logits[i]
        )));
    }
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v)) as f64;
    let log_z = max
        + logits
            .iter()
            .map(|&l| (l as f64 - max).exp())
            .sum::<f64>()
            .ln();
    let logprob = |i: u32| (logits[i as usize] as f64 - log_z) as f32;
    Ok(Logprobs {
        id: logprob(id),
        top: most_likely(logits, n_top)
            .into_iter()
            .map(|i| (i, logprob(i)))
            .collect(),
    })
}

/// The `k` ids of the largest logits (all of them where `k` is past the vocabulary), most
/// likely first, the lower id first on a tie.
fn most_likely(logits: &[f32], k: usize) -> Vec<u32> {
    let by_logit = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    if k > 0 && k < order.len() {
        order.select_nth_unstable_by(k - 1, by_logit);
    }
    order.truncate(k);
    order.sort_unstable_by(by_logit);
    order
}

/// Philox4x32-10 (Salmon et al., SC'11) of `counter` under `key`: four 32-bit words.
pub fn philox4x32(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    const M0: u64 = 0xD251_1F53;
    const M1: u64 = 0xCD9E_8D57;
    const W0: u32 = 0x9E37_79B9;
    const W1: u32 = 0xBB67_AE85;
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = M0 * c[0] as u64;
        let p1 = M1 * c[2] as u64;
        c = [
            (p1 >> 32) as u32 ^ c[1] ^ k[0],
            p1 as u32,
            (p0 >> 32) as u32 ^ c[3] ^ k[1],
            p0 as u32,
        ];
    }
    c
}

/// The Gumbel noise of `id` in the draw for `slot` under `seed`: -ln(E), E = -ln(1 - v)
/// exponential, v uniform in (0, 1) from word id % 4 of Philox(counter (slot, id / 4), key
/// seed). Each operation is one f32 rounding the device repeats (its ln and ln_1p may differ
/// in the last bit).
pub fn gumbel(seed: u64, slot: u64, id: u32) -> f32 {
    let r = philox4x32(
        [slot as u32, (slot >> 32) as u32, id >> 2, 0],
        [seed as u32, (seed >> 32) as u32],
    )[(id & 3) as usize];
    let v = (r as f32 + 0.5) * f32::from_bits(0x2f80_0000); // 2^-32
    -(-(-v).ln_1p()).ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Random123 known-answer vectors for Philox4x32-10.
    #[test]
    fn philox_matches_the_published_vectors() {
        assert_eq!(
            philox4x32([0; 4], [0; 2]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox4x32(
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0]
            ),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn greedy_is_the_argmax_and_validation_names_the_field() {
        let s = Sampling::default();
        assert!(s.is_greedy());
        assert_eq!(s.choose(&[0.1, 2.0, 2.0, -1.0], &[], 7), 1);
        for (bad, field) in [
            (
                Sampling {
                    temperature: f32::NAN,
                    ..s
                },
                "temperature",
            ),
            (
                Sampling {
                    temperature: -1.0,
                    ..s
                },
                "temperature",
            ),
            (Sampling { top_k: -1, ..s }, "top_k"),
            (Sampling { top_p: 0.0, ..s }, "top_p"),
            (Sampling { top_p: 1.5, ..s }, "top_p"),
            (Sampling { min_p: -0.1, ..s }, "min_p"),
            (
                Sampling {
                    repeat_penalty: 0.0,
                    ..s
                },
                "repeat_penalty",
            ),
            (
                Sampling {
                    presence_penalty: f32::INFINITY,
                    ..s
                },
                "presence_penalty",
            ),
            (
                Sampling {
                    penalty_last_n: -2,
                    ..s
                },
                "penalty_last_n",
            ),
        ] {
            let err = bad.validate().unwrap_err();
            assert!(err.to_string().contains(field), "{err}");
        }
    }

    #[test]
    fn a_logit_bias_adds_to_its_ids_and_refuses_what_has_no_meaning() {
        let logits = [0.5f32, 2.0, 1.0, -1.0];
        let bias = LogitBias::new(&[1, 3], &[f32::NEG_INFINITY, 4.0], 4).unwrap();
        assert_eq!(bias.entries(), &[(1, f32::NEG_INFINITY), (3, 4.0)]);
        let biased = bias.applied(&logits);
        assert_eq!(biased, [0.5, f32::NEG_INFINITY, 1.0, 3.0]);
        // Greedy picks the favoured id; a sampled draw never the banned one.
        let s = Sampling::default();
        assert_eq!(s.choose(&biased, &[], 1), 3);
        let hot = Sampling {
            temperature: 2.0,
            ..s
        };
        assert!((0..200).all(|slot| hot.choose(&biased, &[], slot) != 1));
        assert!(LogitBias::new(&[], &[], 4).unwrap().is_empty());
        for (ids, biases, why) in [
            (&[4][..], &[1.0f32][..], "outside the vocabulary"),
            (&[-1], &[1.0], "outside the vocabulary"),
            (&[2, 0, 2], &[1.0, 1.0, -1.0], "id 2 given twice"),
            (&[0], &[f32::NAN], "finite or -inf"),
            (&[0], &[f32::INFINITY], "finite or -inf"),
            (&[0, 1], &[1.0], "2 ids but 1 biases"),
        ] {
            let err = LogitBias::new(ids, biases, 4).unwrap_err().to_string();
            assert!(err.contains(why), "{ids:?} {biases:?}: {err}");
        }
        let many: Vec<i32> = (0..=MAX_LOGIT_BIAS as i32).collect();
        let err = LogitBias::new(&many, &vec![0.0; many.len()], 4096).unwrap_err();
        assert!(err.to_string().contains("at most"), "{err}");
    }

    #[test]
    fn logprobs_are_the_log_softmax_and_the_top_ids_in_order() {
        let logits = [1.0f32, 3.0, 3.0, -2.0, 0.5];
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        let want = |i: usize| (logits[i] as f64 - z.ln()) as f32;
        let lp = logprobs(&logits, 4, 3).unwrap();
        assert_eq!(lp.id, want(4));
        // The tie between ids 1 and 2 goes to the lower id first.
        assert_eq!(lp.top, vec![(1, want(1)), (2, want(2)), (0, want(0))]);
        let total: f64 = (0..5).map(|i| (want(i) as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        assert_eq!(logprobs(&logits, 0, 0).unwrap().top, vec![]);
        assert_eq!(logprobs(&logits, 0, 9).unwrap().top.len(), 5);
        assert!(logprobs(&logits, 5, 1).is_err());
        assert!(logprobs(&logits, 0, MAX_TOP_LOGPROBS + 1).is_err());
        // Logits past f32's range (a forward that returned DV2_ERR_NON_FINITE): an error, not
        // NaN log-probabilities.
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut poisoned = logits;
            poisoned[3] = bad;
            let err = logprobs(&poisoned, 0, 2).unwrap_err();
            assert!(matches!(err, Error::NonFinite(_)), "{err}");
            assert!(err.to_string().contains("logit 3"), "{err}");
        }
    }

    #[test]
    fn penalties_change_logits_as_documented() {
        let s = Sampling {
            repeat_penalty: 2.0,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            penalty_last_n: 3,
            ..Sampling::default()
        };
        let mut logits = [4.0, -4.0, 1.0, 3.0];
        // Window: the last 3 ids, [1, 0, 1]: id 1 twice, id 0 once; id 3 (earlier) not.
        s.penalize(&mut logits, &[3, 1, 0, 1]);
        assert_eq!(
            logits,
            [4.0 / 2.0 - 0.25 - 0.5, -4.0 * 2.0 - 0.5 - 0.5, 1.0, 3.0]
        );
    }
}
