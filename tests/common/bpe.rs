//! A minimal byte-level BPE tokenizer (GPT-2 style) over the vocabulary and merges stored in
//! a GGUF file, for the real-model tests. decodev2 itself takes token ids; frontends tokenize.
//! Pre-tokenization follows the GPT-2 pattern with digits split one by one (llama.cpp's
//! "smollm" pre-tokenizer), for ASCII text.

use std::collections::HashMap;

pub struct Bpe {
    ids: HashMap<String, u32>,
    tokens: Vec<String>,
    ranks: HashMap<(String, String), usize>,
    byte_char: [char; 256],
}

/// GPT-2's reversible map from bytes to printable characters.
fn bytes_to_unicode() -> [char; 256] {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars = [' '; 256];
    let mut extra = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
        }
    }
    for b in 0..256u32 {
        let c = if (b'!' as u32..=b'~' as u32).contains(&b)
            || (0xA1..=0xAC).contains(&b)
            || (0xAE..=0xFF).contains(&b)
        {
            b
        } else {
            extra += 1;
            255 + extra
        };
        chars[b as usize] = char::from_u32(c).unwrap();
    }
    chars
}

/// GPT-2 pre-tokenization for ASCII: contractions, " ?letters", single digits,
/// " ?punctuation", whitespace runs (the last space of a run joins the next word).
fn pre_tokenize(text: &str) -> Vec<String> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    let class = |c: u8| {
        if c.is_ascii_alphabetic() {
            0
        } else if c.is_ascii_digit() {
            1
        } else if c.is_ascii_whitespace() {
            2
        } else {
            3
        }
    };
    while i < b.len() {
        let start = i;
        if b[i] == b'\'' {
            if let Some(suffix) = ["s", "t", "re", "ve", "m", "ll", "d"]
                .iter()
                .find(|s| text[i + 1..].starts_with(**s))
            {
                i += 1 + suffix.len();
                out.push(text[start..i].to_string());
                continue;
            }
        }
        let lead_space = b[i] == b' ' && i + 1 < b.len() && class(b[i + 1]) != 2;
        let j = if lead_space { i + 1 } else { i };
        match class(b[j]) {
            0 => {
                i = j;
                while i < b.len() && class(b[i]) == 0 {
                    i += 1;
                }
            }
            1 => i = j + 1,
            3 => {
                i = j;
                while i < b.len() && class(b[i]) == 3 {
                    i += 1;
                }
            }
            _ => {
                while i < b.len() && class(b[i]) == 2 {
                    i += 1;
                }
                if i < b.len() && i - start > 1 {
                    i -= 1; // leave one space for the next word
                }
            }
        }
        out.push(text[start..i].to_string());
    }
    out
}

impl Bpe {
    pub fn new(tokens: Vec<String>, merges: &[String]) -> Self {
        let ids = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let ranks = merges
            .iter()
            .enumerate()
            .filter_map(|(r, m)| {
                m.split_once(' ')
                    .map(|(a, b)| ((a.to_string(), b.to_string()), r))
            })
            .collect();
        Self {
            ids,
            tokens,
            ranks,
            byte_char: bytes_to_unicode(),
        }
    }

    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        for word in pre_tokenize(text) {
            let mut syms: Vec<String> = word
                .bytes()
                .map(|b| self.byte_char[b as usize].to_string())
                .collect();
            loop {
                let best = (0..syms.len().saturating_sub(1))
                    .filter_map(|i| {
                        self.ranks
                            .get(&(syms[i].clone(), syms[i + 1].clone()))
                            .map(|r| (*r, i))
                    })
                    .min();
                let Some((_, i)) = best else { break };
                let merged = format!("{}{}", syms[i], syms[i + 1]);
                syms.splice(i..i + 2, [merged]);
            }
            out.extend(syms.iter().map(|s| {
                *self
                    .ids
                    .get(s)
                    .unwrap_or_else(|| panic!("symbol {s:?} not in the vocabulary"))
            }));
        }
        out
    }

    pub fn decode(&self, ids: &[u32]) -> String {
        let back: HashMap<char, u8> = self
            .byte_char
            .iter()
            .enumerate()
            .map(|(b, c)| (*c, b as u8))
            .collect();
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|id| self.tokens[*id as usize].chars().collect::<Vec<_>>())
            .filter_map(|c| back.get(&c).copied())
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}
