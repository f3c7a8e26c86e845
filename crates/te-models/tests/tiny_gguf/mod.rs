//! A tiny valid llama GGUF written by the tests (2 layers, hidden 32, a
//! 64-token gpt2 byte-level vocabulary with merges, tensors in F32, F16,
//! Q8_0, Q4_0 and Q4_1), with a record of where each header field lies so
//! that tests can mutate one field precisely.
//!
//! Layout as in `te_formats::gguf`'s doc: header, metadata, tensor infos,
//! padding to 32, tensor data each at the aligned end of the one before.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A metadata value the builder writes.
#[derive(Clone, Debug)]
pub enum Value {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
    StrArray(Vec<String>),
    I32Array(Vec<i32>),
}

impl Value {
    fn type_id(&self) -> u32 {
        match self {
            Value::U32(_) => 4,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::Str(_) => 8,
            Value::StrArray(_) | Value::I32Array(_) => 9,
        }
    }
}

/// One tensor: name, `ne` dims (row length first), GGML type id, bytes.
#[derive(Clone, Debug)]
pub struct Tensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: u32,
    pub data: Vec<u8>,
}

/// Where one header field of the written file lies: byte offset and width.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Field {
    /// What it is (`"tensor_count"`, `"kv llama.block_count value"`,
    /// `"tensor blk.0.attn_q.weight type"`, ...).
    pub what: String,
    pub at: usize,
    pub width: usize,
}

/// A GGUF file under construction.
#[derive(Clone, Debug, Default)]
pub struct Gguf {
    pub kvs: Vec<(String, Value)>,
    pub tensors: Vec<Tensor>,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl Gguf {
    /// Sets (or adds) metadata `key`.
    pub fn set(&mut self, key: &str, v: Value) -> &mut Self {
        match self.kvs.iter_mut().find(|(k, _)| k == key) {
            Some(kv) => kv.1 = v,
            None => self.kvs.push((key.to_string(), v)),
        }
        self
    }

    /// Removes metadata `key`.
    pub fn unset(&mut self, key: &str) -> &mut Self {
        self.kvs.retain(|(k, _)| k != key);
        self
    }

    /// The tensor called `name`.
    pub fn tensor_mut(&mut self, name: &str) -> &mut Tensor {
        self.tensors
            .iter_mut()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("no tensor {name}"))
    }

    /// The file bytes and where each header field is.
    pub fn bytes_and_fields(&self) -> (Vec<u8>, Vec<Field>) {
        let mut out = b"GGUF".to_vec();
        let mut fields = Vec::new();
        let mut field = |out: &Vec<u8>, what: String, width: usize| {
            fields.push(Field {
                what,
                at: out.len(),
                width,
            })
        };
        out.extend(3u32.to_le_bytes());
        field(&out, "tensor_count".into(), 8);
        out.extend((self.tensors.len() as u64).to_le_bytes());
        field(&out, "metadata_kv_count".into(), 8);
        out.extend((self.kvs.len() as u64).to_le_bytes());
        for (key, v) in &self.kvs {
            field(&out, format!("kv {key} key length"), 8);
            put_str(&mut out, key);
            field(&out, format!("kv {key} type"), 4);
            out.extend(v.type_id().to_le_bytes());
            match v {
                Value::U32(x) => {
                    field(&out, format!("kv {key} value"), 4);
                    out.extend(x.to_le_bytes());
                }
                Value::F32(x) => {
                    field(&out, format!("kv {key} value"), 4);
                    out.extend(x.to_le_bytes());
                }
                Value::Bool(b) => {
                    field(&out, format!("kv {key} value"), 1);
                    out.push(*b as u8);
                }
                Value::Str(s) => {
                    field(&out, format!("kv {key} value length"), 8);
                    put_str(&mut out, s);
                }
                Value::StrArray(a) => {
                    field(&out, format!("kv {key} element type"), 4);
                    out.extend(8u32.to_le_bytes());
                    field(&out, format!("kv {key} array length"), 8);
                    out.extend((a.len() as u64).to_le_bytes());
                    for (i, s) in a.iter().enumerate() {
                        field(&out, format!("kv {key} element {i} length"), 8);
                        put_str(&mut out, s);
                    }
                }
                Value::I32Array(a) => {
                    field(&out, format!("kv {key} element type"), 4);
                    out.extend(5u32.to_le_bytes());
                    field(&out, format!("kv {key} array length"), 8);
                    out.extend((a.len() as u64).to_le_bytes());
                    for x in a {
                        out.extend(x.to_le_bytes());
                    }
                }
            }
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            field(&out, format!("tensor {} name length", t.name), 8);
            put_str(&mut out, &t.name);
            field(&out, format!("tensor {} n_dims", t.name), 4);
            out.extend((t.dims.len() as u32).to_le_bytes());
            for (i, d) in t.dims.iter().enumerate() {
                field(&out, format!("tensor {} dim {i}", t.name), 8);
                out.extend(d.to_le_bytes());
            }
            field(&out, format!("tensor {} type", t.name), 4);
            out.extend(t.ty.to_le_bytes());
            field(&out, format!("tensor {} offset", t.name), 8);
            out.extend(offset.to_le_bytes());
            offset = (offset + t.data.len() as u64).div_ceil(32) * 32;
        }
        while !out.len().is_multiple_of(32) {
            out.push(0);
        }
        for t in &self.tensors {
            out.extend(&t.data);
            while !out.len().is_multiple_of(32) {
                out.push(0);
            }
        }
        (out, fields)
    }

    /// The file bytes.
    pub fn bytes(&self) -> Vec<u8> {
        self.bytes_and_fields().0
    }

    /// Writes the file to a fresh temporary path (removed on drop).
    pub fn write(&self, tag: &str) -> TempFile {
        TempFile::new(tag, &self.bytes())
    }
}

/// A temporary file removed on drop.
pub struct TempFile {
    pub path: PathBuf,
}

static NEXT: AtomicUsize = AtomicUsize::new(0);

impl TempFile {
    /// Writes `bytes` to a fresh path ending in `tag`.
    pub fn new(tag: &str, bytes: &[u8]) -> Self {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!(
            "te-tiny-gguf-{}-{n}-{tag}.gguf",
            std::process::id()
        ));
        std::fs::write(&path, bytes).expect("write temp file");
        TempFile { path }
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Deterministic pseudo-random numbers (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn symmetric(&mut self) -> f32 {
        ((self.next() >> 11) as f64 / (1u64 << 52) as f64 - 1.0) as f32
    }
}

/// GGML type ids used here.
pub const F32: u32 = 0;
pub const F16: u32 = 1;
pub const Q4_0: u32 = 2;
pub const Q4_1: u32 = 3;
pub const Q8_0: u32 = 8;
pub const BF16: u32 = 30;

/// `n` elements of type `ty` with small random values (quantized blocks
/// get a scale of 1/64 and random quants).
pub fn random_data(ty: u32, n: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed);
    let scale = half::f16::from_f32(1.0 / 64.0).to_le_bytes();
    let mut out = Vec::new();
    match ty {
        F32 => (0..n).for_each(|_| out.extend(rng.symmetric().to_le_bytes())),
        F16 => (0..n).for_each(|_| out.extend(half::f16::from_f32(rng.symmetric()).to_le_bytes())),
        BF16 => {
            (0..n).for_each(|_| out.extend(half::bf16::from_f32(rng.symmetric()).to_le_bytes()))
        }
        Q8_0 => {
            for _ in 0..n / 32 {
                out.extend(scale);
                (0..32).for_each(|_| out.push(rng.next() as u8));
            }
        }
        Q4_0 => {
            for _ in 0..n / 32 {
                out.extend(scale);
                (0..16).for_each(|_| out.push(rng.next() as u8));
            }
        }
        Q4_1 => {
            for _ in 0..n / 32 {
                out.extend(scale);
                out.extend(half::f16::from_f32(-0.1).to_le_bytes());
                (0..16).for_each(|_| out.push(rng.next() as u8));
            }
        }
        other => panic!("random_data: type {other}"),
    }
    out
}

/// Sizes of [`tiny_llama`].
pub const VOCAB: usize = 64;
pub const HIDDEN: usize = 32;
pub const HEADS: usize = 2;
pub const KV_HEADS: usize = 1;
pub const HEAD_DIM: usize = 16;
pub const FFN: usize = 64;
pub const LAYERS: usize = 2;
/// `<|endoftext|>`.
pub const EOS: u32 = 57;

/// The vocabulary: 52 letters, the GPT-2 space `Ġ` (52), the merged
/// pieces `th`, `the`, `Ġthe`, `ab` (53..=56), `<|endoftext|>` (57,
/// control) and the digits 0..=5.
pub fn vocabulary() -> Vec<String> {
    let mut v: Vec<String> = ('a'..='z').chain('A'..='Z').map(String::from).collect();
    for s in ["Ġ", "th", "the", "Ġthe", "ab", "<|endoftext|>"] {
        v.push(s.into());
    }
    for d in 0..6 {
        v.push(d.to_string());
    }
    assert_eq!(v.len(), VOCAB);
    v
}

/// Merges building the merged pieces of [`vocabulary`].
pub fn merges() -> Vec<String> {
    ["t h", "th e", "Ġ the", "a b"]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

/// The tiny llama: metadata as llama.cpp writes it, tied output.
pub fn tiny_llama() -> Gguf {
    let mut g = Gguf::default();
    let vocab = vocabulary();
    let mut types = vec![1i32; VOCAB];
    types[EOS as usize] = 3;
    g.set("general.architecture", Value::Str("llama".into()))
        .set("llama.block_count", Value::U32(LAYERS as u32))
        .set("llama.context_length", Value::U32(64))
        .set("llama.embedding_length", Value::U32(HIDDEN as u32))
        .set("llama.feed_forward_length", Value::U32(FFN as u32))
        .set("llama.attention.head_count", Value::U32(HEADS as u32))
        .set("llama.attention.head_count_kv", Value::U32(KV_HEADS as u32))
        .set("llama.rope.freq_base", Value::F32(10000.0))
        .set("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5))
        .set("llama.vocab_size", Value::U32(VOCAB as u32))
        .set("llama.rope.dimension_count", Value::U32(HEAD_DIM as u32))
        .set("tokenizer.ggml.model", Value::Str("gpt2".into()))
        .set("tokenizer.ggml.pre", Value::Str("smollm".into()))
        .set("tokenizer.ggml.tokens", Value::StrArray(vocab))
        .set("tokenizer.ggml.token_type", Value::I32Array(types))
        .set("tokenizer.ggml.merges", Value::StrArray(merges()))
        .set("tokenizer.ggml.eos_token_id", Value::U32(EOS))
        .set("tokenizer.ggml.add_bos_token", Value::Bool(false));
    let mut seed = 1;
    let mut tensor = |g: &mut Gguf, name: String, dims: Vec<u64>, ty: u32| {
        let n = dims.iter().product::<u64>() as usize;
        seed += 1;
        g.tensors.push(Tensor {
            data: random_data(ty, n, seed),
            name,
            dims,
            ty,
        });
    };
    let (h, f) = (HIDDEN as u64, FFN as u64);
    let (q, kv) = ((HEADS * HEAD_DIM) as u64, (KV_HEADS * HEAD_DIM) as u64);
    tensor(
        &mut g,
        "token_embd.weight".into(),
        vec![h, VOCAB as u64],
        Q8_0,
    );
    for i in 0..LAYERS {
        let n = |s: &str| format!("blk.{i}.{s}.weight");
        tensor(&mut g, n("attn_norm"), vec![h], F32);
        tensor(&mut g, n("attn_q"), vec![h, q], F16);
        tensor(&mut g, n("attn_k"), vec![h, kv], Q4_1);
        tensor(&mut g, n("attn_v"), vec![h, kv], F32);
        tensor(&mut g, n("attn_output"), vec![q, h], Q8_0);
        tensor(&mut g, n("ffn_norm"), vec![h], F32);
        tensor(&mut g, n("ffn_gate"), vec![h, f], Q4_0);
        tensor(&mut g, n("ffn_up"), vec![h, f], F16);
        tensor(&mut g, n("ffn_down"), vec![f, h], Q8_0);
    }
    tensor(&mut g, "output_norm.weight".into(), vec![h], F32);
    g
}

/// Adds `blk.N.<role>.bias` F32 tensors of the right lengths for `roles`
/// (GGUF names: `attn_q`, `attn_k`, `attn_v`, `attn_output`, `ffn_gate`,
/// `ffn_up`, `ffn_down`) to every layer.
pub fn add_biases(g: &mut Gguf, roles: &[&str]) {
    for i in 0..LAYERS {
        for role in roles {
            let len = match *role {
                "attn_q" => HEADS * HEAD_DIM,
                "attn_k" | "attn_v" => KV_HEADS * HEAD_DIM,
                "attn_output" | "ffn_down" => HIDDEN,
                "ffn_gate" | "ffn_up" => FFN,
                other => panic!("no bias role {other}"),
            };
            g.tensors.push(Tensor {
                name: format!("blk.{i}.{role}.bias"),
                dims: vec![len as u64],
                ty: F32,
                data: random_data(F32, len, 1000 + i as u64),
            });
        }
    }
}
