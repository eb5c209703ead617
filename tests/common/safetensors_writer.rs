//! Writes small Hugging Face model directories (config.json + safetensors) for the loader
//! tests.

use std::path::Path;

pub struct HfWriter {
    pub config: serde_json::Value,
    /// (name, shape, values); stored as `dtype`.
    pub tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
    pub dtype: &'static str,
}

impl HfWriter {
    /// A one-layer model: hidden 64, 4/2 heads of 16, intermediate 128, vocab 32. Qwen2 adds
    /// q/k/v biases and ties the embeddings.
    pub fn tiny(arch: &str) -> Self {
        let qwen = arch == "Qwen2ForCausalLM";
        let config = serde_json::json!({
            "architectures": [arch],
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32,
            "max_position_embeddings": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": qwen, "hidden_act": "silu",
        });
        let value = |seed: usize, i: usize| {
            (((i * 7919 + seed * 104729) % 1000) as f32 / 1000.0 - 0.5) * 0.2
        };
        let t = |name: &str, shape: Vec<usize>, seed: usize| {
            let n = shape.iter().product();
            (
                name.to_string(),
                shape,
                (0..n).map(|i| value(seed, i)).collect::<Vec<f32>>(),
            )
        };
        let p = "model.layers.0.";
        let mut tensors = vec![
            t("model.embed_tokens.weight", vec![32, 64], 1),
            t("model.norm.weight", vec![64], 2),
            t(&format!("{p}input_layernorm.weight"), vec![64], 3),
            t(&format!("{p}self_attn.q_proj.weight"), vec![64, 64], 4),
            t(&format!("{p}self_attn.k_proj.weight"), vec![32, 64], 5),
            t(&format!("{p}self_attn.v_proj.weight"), vec![32, 64], 6),
            t(&format!("{p}self_attn.o_proj.weight"), vec![64, 64], 7),
            t(&format!("{p}post_attention_layernorm.weight"), vec![64], 8),
            t(&format!("{p}mlp.gate_proj.weight"), vec![128, 64], 9),
            t(&format!("{p}mlp.up_proj.weight"), vec![128, 64], 10),
            t(&format!("{p}mlp.down_proj.weight"), vec![64, 128], 11),
        ];
        if qwen {
            tensors.push(t(&format!("{p}self_attn.q_proj.bias"), vec![64], 12));
            tensors.push(t(&format!("{p}self_attn.k_proj.bias"), vec![32], 13));
            tensors.push(t(&format!("{p}self_attn.v_proj.bias"), vec![32], 14));
        } else {
            tensors.push(t("lm_head.weight", vec![32, 64], 15));
        }
        Self {
            config,
            tensors,
            dtype: "F32",
        }
    }

    fn encode(&self, v: f32) -> Vec<u8> {
        match self.dtype {
            "BF16" => half::bf16::from_f32(v).to_le_bytes().to_vec(),
            "F16" => half::f16::from_f32(v).to_le_bytes().to_vec(),
            _ => v.to_le_bytes().to_vec(),
        }
    }

    /// One safetensors file holding `tensors`.
    pub fn safetensors(&self, tensors: &[&(String, Vec<usize>, Vec<f32>)]) -> Vec<u8> {
        let mut header = serde_json::Map::new();
        let mut data = Vec::new();
        for (name, shape, values) in tensors {
            let start = data.len();
            for v in values {
                data.extend(self.encode(*v));
            }
            header.insert(name.clone(), serde_json::json!({"dtype": self.dtype, "shape": shape, "data_offsets": [start, data.len()]}));
        }
        let mut head = serde_json::to_vec(&header).unwrap();
        head.resize(head.len().next_multiple_of(8), b' ');
        let mut out = (head.len() as u64).to_le_bytes().to_vec();
        out.extend(head);
        out.extend(data);
        out
    }

    /// Writes config.json and the tensors, in one file or in `shards` files with an index.
    pub fn write(&self, dir: &Path, shards: usize) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(
            dir.join("config.json"),
            serde_json::to_vec_pretty(&self.config).unwrap(),
        )
        .unwrap();
        if shards <= 1 {
            let all: Vec<_> = self.tensors.iter().collect();
            std::fs::write(dir.join("model.safetensors"), self.safetensors(&all)).unwrap();
            return;
        }
        let mut map = serde_json::Map::new();
        for s in 0..shards {
            let name = format!("model-{:05}-of-{shards:05}.safetensors", s + 1);
            let part: Vec<_> = self.tensors.iter().skip(s).step_by(shards).collect();
            for t in &part {
                map.insert(t.0.clone(), serde_json::json!(name));
            }
            std::fs::write(dir.join(&name), self.safetensors(&part)).unwrap();
        }
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            serde_json::to_vec(&serde_json::json!({"weight_map": map})).unwrap(),
        )
        .unwrap();
    }

    pub fn tensor_mut(&mut self, name: &str) -> &mut (String, Vec<usize>, Vec<f32>) {
        self.tensors
            .iter_mut()
            .find(|t| t.0 == name)
            .expect("tensor")
    }
}
