//! Fuzz-style property tests of model loading (issue 15): random
//! mutations of a small valid GGUF (`tiny_gguf/`) and of a safetensors
//! file whose header this test writes: bit flips, byte overwrites,
//! truncations, hostile values in count, length, dim, type and offset
//! fields, renamed (duplicate) tensors, overlapping data offsets. Loading
//! must never panic, never make an allocation beyond a bound set by the
//! file's size, and never accept a file whose tensor data ranges overlap
//! or leave the file (checked here from the headers, independently of
//! the readers).

mod alloc_counter;
mod tiny;
mod tiny_gguf;

use std::sync::Mutex;

use proptest::prelude::*;
use te_formats::gguf::GgufFile;
use te_models::inspect::inspect;
use te_models::loader::load_parts;
use te_models::source::ModelSource;

#[global_allocator]
static ALLOC: alloc_counter::Counting = alloc_counter::Counting;

/// The largest-allocation record is global: one fuzz case at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// The largest single allocation a load of a `file_len`-byte file may
/// make: 64 bytes per file byte (a metadata array element is 32 bytes in
/// memory and at least 1 in the file; an f32 weight 4 bytes for 1/2 to 4
/// stored), plus 4 MiB for the tokenizer's fixed tables.
fn allocation_bound(file_len: usize) -> usize {
    64 * file_len + (4 << 20)
}

/// One way to damage a file.
#[derive(Clone, Debug)]
enum Mutation {
    /// Flip bit `bit` of the byte at `at` (an index into the file).
    Flip { at: prop::sample::Index, bit: u8 },
    /// Overwrite the byte at `at`.
    Byte { at: prop::sample::Index, value: u8 },
    /// Cut the file at `at`.
    Truncate { at: prop::sample::Index },
    /// Put a hostile value into header field `field` (a count, length,
    /// dim, type or offset).
    Field {
        field: prop::sample::Index,
        value: u64,
    },
    /// Give tensor `a` the name of tensor `b` (names of equal length).
    Rename {
        a: prop::sample::Index,
        b: prop::sample::Index,
    },
    /// Move tensor `a`'s data offset onto tensor `b`'s.
    Overlap {
        a: prop::sample::Index,
        b: prop::sample::Index,
    },
}

fn hostile_value() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(31),
        Just(32),
        Just(1 << 14),
        Just(1 << 20),
        Just(1 << 24),
        Just(u32::MAX as u64),
        Just(u64::MAX),
        Just(1 << 40),
        Just(1 << 62),
        0u64..64,
        any::<u64>(),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        3 => (any::<prop::sample::Index>(), 0u8..8).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        2 => (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(at, value)| Mutation::Byte { at, value }),
        1 => any::<prop::sample::Index>().prop_map(|at| Mutation::Truncate { at }),
        4 => (any::<prop::sample::Index>(), hostile_value()).prop_map(|(field, value)| Mutation::Field { field, value }),
        1 => (any::<prop::sample::Index>(), any::<prop::sample::Index>()).prop_map(|(a, b)| Mutation::Rename { a, b }),
        1 => (any::<prop::sample::Index>(), any::<prop::sample::Index>()).prop_map(|(a, b)| Mutation::Overlap { a, b }),
    ]
}

fn write_le(bytes: &mut [u8], at: usize, width: usize, value: u64) {
    let v = value.to_le_bytes();
    let end = (at + width).min(bytes.len());
    if at < end {
        bytes[at..end].copy_from_slice(&v[..end - at]);
    }
}

// ---------------------------------------------------------------- GGUF

/// Tensor data ranges of an opened GGUF, from its public tensor table:
/// `(name, start, end)` in file bytes (`end = None` for unknown sizes).
fn gguf_ranges(f: &GgufFile) -> Vec<(String, u64, Option<u64>)> {
    f.tensors()
        .iter()
        .map(|t| {
            let start = f.data_start() + t.offset;
            (t.name.clone(), start, t.n_bytes.map(|n| start + n))
        })
        .collect()
}

/// Fails unless every known range lies in the file, is aligned, and no
/// two ranges overlap.
fn assert_disjoint(ranges: &[(String, u64, Option<u64>)], align: u64, len: u64, data_start: u64) {
    let mut known: Vec<(u64, u64, &str)> = Vec::new();
    for (name, s, e) in ranges {
        assert!((s - data_start).is_multiple_of(align), "{name} misaligned");
        assert!(*s <= len, "{name} starts past the end");
        if let Some(e) = e {
            assert!(*e <= len, "{name} ends past the end ({e} > {len})");
            if e > s {
                known.push((*s, *e, name));
            }
        } else {
            known.push((*s, *s + 1, name));
        }
    }
    known.sort();
    for w in known.windows(2) {
        assert!(
            w[0].1 <= w[1].0,
            "{} [{}, {}) overlaps {} [{}, {})",
            w[0].2,
            w[0].0,
            w[0].1,
            w[1].2,
            w[1].0,
            w[1].1
        );
    }
}

fn mutate_gguf(bytes: &mut Vec<u8>, fields: &[tiny_gguf::Field], names: &[String], m: &Mutation) {
    match m {
        Mutation::Flip { at, bit } => {
            let i = at.index(bytes.len());
            bytes[i] ^= 1 << bit;
        }
        Mutation::Byte { at, value } => {
            let i = at.index(bytes.len());
            bytes[i] = *value;
        }
        Mutation::Truncate { at } => {
            let i = at.index(bytes.len());
            bytes.truncate(i);
        }
        Mutation::Field { field, value } => {
            let f = &fields[field.index(fields.len())];
            write_le(bytes, f.at, f.width, *value);
        }
        Mutation::Rename { a, b } => {
            let (a, b) = (&names[a.index(names.len())], &names[b.index(names.len())]);
            if a.len() == b.len() {
                let key = |n: &str| {
                    let mut k = (n.len() as u64).to_le_bytes().to_vec();
                    k.extend(n.as_bytes());
                    k
                };
                let (ka, kb) = (key(a), key(b));
                if let Some(p) = bytes.windows(ka.len()).position(|w| w == ka.as_slice()) {
                    bytes[p..p + kb.len()].copy_from_slice(&kb);
                }
            }
        }
        Mutation::Overlap { a, b } => {
            let offset_of = |n: &str| {
                fields
                    .iter()
                    .find(|f| f.what == format!("tensor {n} offset"))
                    .expect("offset field")
                    .at
            };
            let (a, b) = (&names[a.index(names.len())], &names[b.index(names.len())]);
            let (fa, fb) = (offset_of(a), offset_of(b));
            if fb + 8 <= bytes.len() && fa + 8 <= bytes.len() {
                let v: [u8; 8] = bytes[fb..fb + 8].try_into().unwrap();
                bytes[fa..fa + 8].copy_from_slice(&v);
            }
        }
    }
}

/// Opens, inspects and loads `bytes` as a GGUF model; returns whether the
/// model loaded. Asserts the allocation bound and, for every file the
/// reader opens, the data layout.
fn try_gguf(bytes: &[u8]) -> bool {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let f = tiny_gguf::TempFile::new("fuzz", bytes);
    alloc_counter::reset_largest();
    let opened = GgufFile::open(&f.path);
    let source = ModelSource::Gguf(f.path.clone());
    let _ = inspect(&source);
    let loaded = load_parts(&source);
    let largest = alloc_counter::largest();
    assert!(
        largest <= allocation_bound(bytes.len()),
        "allocated {largest} bytes for a {}-byte file",
        bytes.len()
    );
    if let Ok(g) = &opened {
        assert_disjoint(
            &gguf_ranges(g),
            g.alignment(),
            bytes.len() as u64,
            g.data_start(),
        );
    }
    if let Ok(parts) = &loaded {
        // Loaded implies opened, and the config matches what it read.
        let g = opened.as_ref().expect("a loaded file opens");
        assert_eq!(parts.weights.layers.len(), parts.config.num_hidden_layers);
        assert!(g.tensors().iter().all(|t| t.ggml_type.can_dequantize()));
    }
    loaded.is_ok()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn mutated_gguf_never_panics_overallocates_or_loads_overlaps(
        mutations in prop::collection::vec(mutation(), 1..4),
    ) {
        let g = tiny_gguf::tiny_llama();
        let names: Vec<String> = g.tensors.iter().map(|t| t.name.clone()).collect();
        let (mut bytes, fields) = g.bytes_and_fields();
        for m in &mutations {
            mutate_gguf(&mut bytes, &fields, &names, m);
        }
        try_gguf(&bytes);
    }
}

/// The unmutated file loads (so the property above is not vacuous), and
/// so do mutations in tensor data (bit flips there change values only).
#[test]
fn unmutated_and_data_only_mutations_load() {
    let g = tiny_gguf::tiny_llama();
    let bytes = g.bytes();
    assert!(try_gguf(&bytes), "the tiny llama must load");
    let mut b = bytes.clone();
    let n = b.len();
    b[n - 40] ^= 0x10; // output_norm.weight data
    assert!(try_gguf(&b));
}

/// Hand-picked cases the random ones may miss: every tensor at offset 0,
/// a second tensor inside the first, a huge tensor count, a huge dim.
#[test]
fn hostile_gguf_layouts_are_refused() {
    let g = tiny_gguf::tiny_llama();
    let (bytes, fields) = g.bytes_and_fields();
    let offsets: Vec<&tiny_gguf::Field> = fields
        .iter()
        .filter(|f| f.what.ends_with(" offset"))
        .collect();
    let mut all_zero = bytes.clone();
    for f in &offsets {
        write_le(&mut all_zero, f.at, 8, 0);
    }
    assert!(!try_gguf(&all_zero));
    let mut inside = bytes.clone();
    write_le(&mut inside, offsets[1].at, 8, 32);
    assert!(!try_gguf(&inside));
    let field = |what: &str| fields.iter().find(|f| f.what == what).unwrap();
    for (what, value) in [
        ("tensor_count", 1u64 << 40),
        ("metadata_kv_count", u64::MAX),
        ("tensor token_embd.weight dim 1", 1 << 40),
        ("kv tokenizer.ggml.tokens array length", 1 << 50),
        ("kv tokenizer.ggml.merges element 0 length", u64::MAX),
        // Plausible-looking sizes that the tensors contradict must be
        // refused before anything is sized by them.
        ("kv llama.block_count value", 1 << 14),
        ("kv llama.block_count value", 1 << 24),
        ("kv llama.embedding_length value", 1 << 24),
        ("kv llama.feed_forward_length value", 1 << 24),
        ("kv llama.attention.head_count value", 1 << 24),
    ] {
        let mut b = bytes.clone();
        let f = field(what);
        write_le(&mut b, f.at, f.width, value);
        assert!(!try_gguf(&b), "{what} = {value} loaded");
    }
    // A long context contradicts no tensor: it loads (the RoPE tables it
    // sizes are built later, by `Model::new`), within the bound.
    let mut b = bytes.clone();
    let f = field("kv llama.context_length value");
    write_le(&mut b, f.at, f.width, 1 << 24);
    assert!(try_gguf(&b));
}

// --------------------------------------------------------- safetensors

/// The tiny Llama of `tiny::Spec::llama()` shrunk to one layer: config.json
/// and its tensors (name, shape).
fn st_tensors() -> Vec<(String, Vec<usize>)> {
    let (v, h, f, q, kv) = (16, 8, 16, 8, 4);
    let mut t = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
    let p = |s: &str| format!("model.layers.0.{s}.weight");
    t.push((p("input_layernorm"), vec![h]));
    t.push((p("self_attn.q_proj"), vec![q, h]));
    t.push((p("self_attn.k_proj"), vec![kv, h]));
    t.push((p("self_attn.v_proj"), vec![kv, h]));
    t.push((p("self_attn.o_proj"), vec![h, q]));
    t.push((p("post_attention_layernorm"), vec![h]));
    t.push((p("mlp.gate_proj"), vec![f, h]));
    t.push((p("mlp.up_proj"), vec![f, h]));
    t.push((p("mlp.down_proj"), vec![h, f]));
    t.push(("model.norm.weight".to_string(), vec![h]));
    t
}

const ST_CONFIG: &str = r#"{"model_type": "llama", "vocab_size": 16, "hidden_size": 8,
 "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
 "num_key_value_heads": 1, "head_dim": 4, "max_position_embeddings": 32,
 "tie_word_embeddings": true, "rms_norm_eps": 1e-5}"#;

/// One header entry as this test writes it.
#[derive(Clone, Debug)]
struct Entry {
    name: String,
    dtype: String,
    shape: Vec<u64>,
    offsets: (u64, u64),
}

/// A damage to the safetensors header (entries) or to the file bytes.
#[derive(Clone, Debug)]
enum StMutation {
    Dtype {
        t: prop::sample::Index,
        dtype: &'static str,
    },
    Dim {
        t: prop::sample::Index,
        d: prop::sample::Index,
        value: u64,
    },
    ExtraDim {
        t: prop::sample::Index,
        value: u64,
    },
    Offset {
        t: prop::sample::Index,
        end: bool,
        value: u64,
    },
    /// Tensor `a` takes tensor `b`'s data range.
    Overlap {
        a: prop::sample::Index,
        b: prop::sample::Index,
    },
    /// Tensor `a` takes tensor `b`'s name (a duplicate JSON key).
    Duplicate {
        a: prop::sample::Index,
        b: prop::sample::Index,
    },
    HeaderLength {
        value: u64,
    },
    Bytes(Mutation),
}

fn st_mutation() -> impl Strategy<Value = StMutation> {
    let dtype = prop_oneof![
        Just("F32"),
        Just("F16"),
        Just("BF16"),
        Just("I64"),
        Just("U8"),
        Just("F64"),
        Just("BOOL"),
        Just("Q4"),
        Just(""),
    ];
    let idx = any::<prop::sample::Index>;
    prop_oneof![
        (idx(), dtype).prop_map(|(t, dtype)| StMutation::Dtype { t, dtype }),
        (idx(), idx(), hostile_value()).prop_map(|(t, d, value)| StMutation::Dim { t, d, value }),
        (idx(), hostile_value()).prop_map(|(t, value)| StMutation::ExtraDim { t, value }),
        (idx(), any::<bool>(), hostile_value()).prop_map(|(t, end, value)| StMutation::Offset {
            t,
            end,
            value
        }),
        (idx(), idx()).prop_map(|(a, b)| StMutation::Overlap { a, b }),
        (idx(), idx()).prop_map(|(a, b)| StMutation::Duplicate { a, b }),
        hostile_value().prop_map(|value| StMutation::HeaderLength { value }),
        mutation().prop_map(StMutation::Bytes),
    ]
}

/// Valid header entries (F32, contiguous) and the data length.
fn st_entries() -> (Vec<Entry>, u64) {
    let mut at = 0u64;
    let entries = st_tensors()
        .into_iter()
        .map(|(name, shape)| {
            let n = shape.iter().product::<usize>() as u64 * 4;
            let e = Entry {
                name,
                dtype: "F32".into(),
                shape: shape.iter().map(|&d| d as u64).collect(),
                offsets: (at, at + n),
            };
            at += n;
            e
        })
        .collect();
    (entries, at)
}

/// Header JSON (entries written in order, duplicates kept as duplicate
/// keys), padded with spaces to a multiple of 8.
fn st_header(entries: &[Entry]) -> String {
    let items: Vec<String> = entries
        .iter()
        .map(|e| {
            format!(
                "{}:{{\"dtype\":{},\"shape\":{:?},\"data_offsets\":[{},{}]}}",
                serde_json::to_string(&e.name).unwrap(),
                serde_json::to_string(&e.dtype).unwrap(),
                e.shape,
                e.offsets.0,
                e.offsets.1
            )
        })
        .collect();
    let mut h = format!("{{{}}}", items.join(","));
    while !h.len().is_multiple_of(8) {
        h.push(' ');
    }
    h
}

fn st_file(header: &str, header_len: u64, data_len: u64) -> Vec<u8> {
    let mut b = header_len.to_le_bytes().to_vec();
    b.extend(header.as_bytes());
    // Data: small values, so a load that succeeds is a sane model.
    b.extend((0..data_len / 4).flat_map(|i| (((i % 13) as f32 - 6.0) / 16.0).to_le_bytes()));
    b
}

/// The data ranges a safetensors header declares, parsed here (a JSON
/// object: duplicate keys keep the last, as the reader does), with the
/// file size: every range must lie in the data and none may overlap.
fn assert_st_disjoint(bytes: &[u8]) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data_len = (bytes.len() - 8 - n) as u64;
    let mut ranges: Vec<(u64, u64, String)> = header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| {
            let o = &v["data_offsets"];
            (o[0].as_u64().unwrap(), o[1].as_u64().unwrap(), k.clone())
        })
        .collect();
    ranges.sort();
    for (s, e, name) in &ranges {
        assert!(
            s <= e && *e <= data_len,
            "{name} [{s}, {e}) outside {data_len} bytes"
        );
    }
    for w in ranges.windows(2) {
        assert!(
            w[0].1 <= w[1].0 || w[0].0 == w[0].1,
            "{} overlaps {}",
            w[0].2,
            w[1].2
        );
    }
}

fn try_safetensors(dir: &std::path::Path, bytes: &[u8]) -> bool {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    alloc_counter::reset_largest();
    let loaded = tiny::load_dir(dir);
    let largest = alloc_counter::largest();
    assert!(
        largest <= allocation_bound(bytes.len()),
        "allocated {largest} bytes for a {}-byte file",
        bytes.len()
    );
    if loaded.is_ok() {
        assert_st_disjoint(bytes);
    }
    loaded.is_ok()
}

fn st_dir() -> std::path::PathBuf {
    let dir = tiny::temp_dir("st-fuzz");
    std::fs::write(dir.join("config.json"), ST_CONFIG).unwrap();
    dir
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn mutated_safetensors_never_panics_overallocates_or_loads_overlaps(
        mutations in prop::collection::vec(st_mutation(), 1..4),
    ) {
        let (mut entries, data_len) = st_entries();
        let mut header_len = None;
        let mut byte_mutations = Vec::new();
        let n = entries.len();
        for m in &mutations {
            match m {
                StMutation::Dtype { t, dtype } => entries[t.index(n)].dtype = dtype.to_string(),
                StMutation::Dim { t, d, value } => {
                    let e = &mut entries[t.index(n)];
                    let i = d.index(e.shape.len());
                    e.shape[i] = *value;
                }
                StMutation::ExtraDim { t, value } => {
                    let i = t.index(n);
                    entries[i].shape.push(*value);
                }
                StMutation::Offset { t, end, value } => {
                    let e = &mut entries[t.index(n)];
                    if *end { e.offsets.1 = *value } else { e.offsets.0 = *value }
                }
                StMutation::Overlap { a, b } => {
                    let b = entries[b.index(n)].offsets;
                    let i = a.index(n);
                    entries[i].offsets = b;
                }
                StMutation::Duplicate { a, b } => {
                    let b = entries[b.index(n)].name.clone();
                    let i = a.index(n);
                    entries[i].name = b;
                }
                StMutation::HeaderLength { value } => header_len = Some(*value),
                StMutation::Bytes(m) => byte_mutations.push(m.clone()),
            }
        }
        let header = st_header(&entries);
        let mut bytes = st_file(&header, header_len.unwrap_or(header.len() as u64), data_len);
        for m in &byte_mutations {
            // Only the flips, overwrites and truncations apply to raw bytes.
            mutate_gguf(&mut bytes, &[], &[], &match m {
                Mutation::Field { .. } | Mutation::Rename { .. } | Mutation::Overlap { .. } => continue,
                m => m.clone(),
            });
        }
        let dir = st_dir();
        try_safetensors(&dir, &bytes);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// The unmutated file loads (the property is not vacuous); two tensors on
/// one data range, and a name given twice, do not.
#[test]
fn safetensors_hand_picked_cases() {
    let dir = st_dir();
    let (entries, data_len) = st_entries();
    let header = st_header(&entries);
    assert!(try_safetensors(
        &dir,
        &st_file(&header, header.len() as u64, data_len)
    ));
    let mut overlap = entries.clone();
    overlap[2].offsets = overlap[1].offsets;
    let h = st_header(&overlap);
    assert!(!try_safetensors(
        &dir,
        &st_file(&h, h.len() as u64, data_len)
    ));
    let mut dup = entries.clone();
    dup[3].name = dup[2].name.clone();
    let h = st_header(&dup);
    assert!(!try_safetensors(
        &dir,
        &st_file(&h, h.len() as u64, data_len)
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}
