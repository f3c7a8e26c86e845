//! The GGUF reader on small files written by the test: values read back,
//! and truncated or hostile files rejected with a `Format` error naming the
//! file (never a panic or a huge allocation).

use std::path::PathBuf;

use proptest::prelude::*;
use te_formats::gguf::{GgufFile, GgufValue};
use te_formats::FormatError;
use te_kernels::quant::GgmlType;

/// A little-endian GGUF writer following the layout in `gguf.rs`'s doc.
#[derive(Default)]
struct Writer {
    kvs: Vec<u8>,
    n_kv: u64,
    infos: Vec<u8>,
    n_tensors: u64,
    data: Vec<u8>,
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl Writer {
    fn kv(&mut self, key: &str, ty: u32, value: &[u8]) -> &mut Self {
        string(&mut self.kvs, key);
        self.kvs.extend(ty.to_le_bytes());
        self.kvs.extend(value);
        self.n_kv += 1;
        self
    }

    fn kv_str(&mut self, key: &str, v: &str) -> &mut Self {
        let mut b = Vec::new();
        string(&mut b, v);
        self.kv(key, 8, &b)
    }

    /// A tensor whose data is appended at the next 32-byte boundary.
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, data: &[u8]) -> &mut Self {
        while !self.data.len().is_multiple_of(32) {
            self.data.push(0);
        }
        string(&mut self.infos, name);
        self.infos.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            self.infos.extend(d.to_le_bytes());
        }
        self.infos.extend(ty.to_le_bytes());
        self.infos.extend((self.data.len() as u64).to_le_bytes());
        self.data.extend(data);
        self.n_tensors += 1;
        self
    }

    fn bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(self.n_tensors.to_le_bytes());
        out.extend(self.n_kv.to_le_bytes());
        out.extend(&self.kvs);
        out.extend(&self.infos);
        while !out.len().is_multiple_of(32) {
            out.push(0);
        }
        out.extend(&self.data);
        out
    }
}

fn temp_file(tag: &str, bytes: &[u8]) -> PathBuf {
    let path = std::env::temp_dir().join(format!("te-gguf-{}-{tag}.gguf", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    path
}

/// Opens `bytes` as a file; returns the result with the file removed.
fn open_bytes(tag: &str, bytes: &[u8]) -> Result<GgufFile, FormatError> {
    let path = temp_file(tag, bytes);
    let result = GgufFile::open(&path);
    std::fs::remove_file(&path).unwrap();
    result
}

/// Expects a `Format` error naming the file whose reason contains `needle`.
fn expect_format_error(tag: &str, bytes: &[u8], needle: &str) {
    match open_bytes(tag, bytes) {
        Err(FormatError::Format { path, reason }) => {
            assert!(path.to_string_lossy().contains(tag), "{path:?}");
            assert!(reason.contains(needle), "`{reason}` lacks `{needle}`");
        }
        other => panic!("{tag}: expected a Format error, got {other:?}"),
    }
}

fn sample() -> Writer {
    let mut w = Writer::default();
    w.kv_str("general.architecture", "llama")
        .kv("llama.block_count", 4, &30u32.to_le_bytes())
        .kv("llama.rope.freq_base", 6, &100000f32.to_le_bytes())
        .kv("tokenizer.ggml.add_bos_token", 7, &[0]);
    // Array of strings ["a", "bc"].
    let mut arr = 8u32.to_le_bytes().to_vec();
    arr.extend(2u64.to_le_bytes());
    string(&mut arr, "a");
    string(&mut arr, "bc");
    w.kv("tokenizer.ggml.tokens", 9, &arr);
    // Array of i32 [1, -3].
    let mut arr = 5u32.to_le_bytes().to_vec();
    arr.extend(2u64.to_le_bytes());
    arr.extend(1i32.to_le_bytes());
    arr.extend((-3i32).to_le_bytes());
    w.kv("tokenizer.ggml.token_type", 9, &arr);
    // F32 [2, 3] matrix (ne = [3, 2]) holding 0..6.
    let f: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
    w.tensor("norm.weight", &[3, 2], 0, &f);
    // One Q8_0 row: d = 0.25, q = 0..32.
    let mut q = half::f16::from_f32(0.25).to_le_bytes().to_vec();
    q.extend(0..32u8);
    w.tensor("token_embd.weight", &[32, 1], 8, &q);
    w
}

#[test]
fn reads_metadata_and_tensors() {
    let bytes = sample().bytes();
    let f = open_bytes("good", &bytes).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(f.get_u32("llama.block_count").unwrap(), 30);
    assert_eq!(f.get_f32("llama.rope.freq_base").unwrap(), 100000.0);
    assert!(!f.get_bool("tokenizer.ggml.add_bos_token").unwrap());
    assert_eq!(
        f.get_str_array("tokenizer.ggml.tokens").unwrap(),
        ["a", "bc"]
    );
    assert_eq!(
        f.get_i32_array("tokenizer.ggml.token_type").unwrap(),
        [1, -3]
    );
    assert_eq!(f.metadata("llama.block_count"), Some(&GgufValue::U32(30)));
    assert_eq!(f.tensors().len(), 2);
    let norm = f.tensor_info("norm.weight").unwrap();
    assert_eq!(
        (norm.dims.as_slice(), norm.shape()),
        (&[3u64, 2][..], vec![2, 3])
    );
    assert_eq!(norm.ggml_type, GgmlType::F32);
    assert_eq!(
        f.dequantize("norm.weight").unwrap(),
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    );
    let embd = f.dequantize("token_embd.weight").unwrap();
    let want: Vec<f32> = (0..32).map(|i| 0.25 * i as f32).collect();
    assert_eq!(embd, want);
}

#[test]
fn typed_getters_name_the_key() {
    let f = open_bytes("typed", &sample().bytes()).unwrap();
    for err in [
        f.get_u32("general.architecture").unwrap_err(),
        f.get_str("llama.block_count").unwrap_err(),
        f.get_f32_array("general.architecture").unwrap_err(),
        f.get_u32("llama.missing").unwrap_err(),
    ] {
        assert!(matches!(err, FormatError::Config { .. }), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("general.architecture") || msg.contains("llama."),
            "{msg}"
        );
    }
    // -3 does not fit a u32 array, but the getter for i32 works.
    assert!(f.get_str_array("tokenizer.ggml.token_type").is_err());
    let err = f.dequantize("output.weight").unwrap_err();
    assert!(matches!(err, FormatError::Tensor { .. }) && err.to_string().contains("output.weight"));
}

#[test]
fn every_truncation_is_a_format_error() {
    let bytes = sample().bytes();
    for len in 0..bytes.len() {
        match open_bytes("trunc", &bytes[..len]) {
            Err(FormatError::Format { .. }) => {}
            other => panic!("truncated to {len} bytes: expected a Format error, got {other:?}"),
        }
    }
}

/// Header bytes: magic, version, tensor_count, kv_count.
fn header(version: u32, n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(version.to_le_bytes());
    b.extend(n_tensors.to_le_bytes());
    b.extend(n_kv.to_le_bytes());
    b
}

#[test]
fn absurd_counts_and_lengths_are_rejected_cheaply() {
    expect_format_error("magic", b"GGML\x03\0\0\0", "not a GGUF file");
    expect_format_error("version", &header(4, 0, 0), "version 4");
    expect_format_error("ntensors", &header(3, 1 << 60, 0), "tensor_count");
    expect_format_error("nkv", &header(3, 0, 1 << 62), "metadata_kv_count");

    let mut b = header(3, 0, 1);
    b.extend((1u64 << 50).to_le_bytes());
    b.extend([0u8; 64]);
    expect_format_error("keylen", &b, "65535-byte limit");

    let mut b = header(3, 0, 1);
    string(&mut b, "k");
    b.extend(9u32.to_le_bytes()); // array
    b.extend(8u32.to_le_bytes()); // of strings
    b.extend((1u64 << 58).to_le_bytes());
    b.extend([0u8; 64]);
    expect_format_error("arrlen", &b, "array length");

    let mut b = header(3, 0, 1);
    string(&mut b, "k");
    b.extend(77u32.to_le_bytes());
    b.extend([0u8; 8]);
    expect_format_error("vtype", &b, "unknown value type 77");

    let mut b = header(3, 1, 0);
    string(&mut b, "t");
    b.extend(1000u32.to_le_bytes());
    b.extend([0u8; 64]);
    expect_format_error("ndims", &b, "n_dims 1000");

    // Dims whose product overflows.
    let mut b = header(3, 1, 0);
    string(&mut b, "t");
    b.extend(2u32.to_le_bytes());
    b.extend((1u64 << 40).to_le_bytes());
    b.extend((1u64 << 40).to_le_bytes());
    b.extend(0u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    expect_format_error("overflow", &b, "overflow");

    // A tensor whose data lies past the end of the file.
    let mut w = Writer::default();
    w.tensor("big", &[1 << 20], 0, &[0u8; 64]);
    expect_format_error("pastend", &w.bytes(), "past the end");

    // A data offset that is not a multiple of the alignment (32).
    let mut b = header(3, 1, 0);
    string(&mut b, "a");
    b.extend(1u32.to_le_bytes());
    b.extend(8u64.to_le_bytes());
    b.extend(0u32.to_le_bytes());
    b.extend(4u64.to_le_bytes());
    b.extend([0u8; 96]);
    expect_format_error("misaligned", &b, "alignment");

    let mut w = Writer::default();
    w.tensor("a", &[8], 0, &[0u8; 32])
        .tensor("a", &[8], 0, &[0u8; 32]);
    expect_format_error("dup", &w.bytes(), "duplicate tensor name");

    // Q4_0 rows must be a whole number of 32-element blocks.
    let mut w = Writer::default();
    w.tensor("q", &[16], 2, &[0u8; 18]);
    expect_format_error("block", &w.bytes(), "block length");
}

#[test]
fn unknown_tensor_types_open_but_cannot_be_read() {
    let mut w = sample();
    w.tensor("iq", &[256], 99, &[0u8; 64]);
    let f = open_bytes("unknown-type", &w.bytes()).unwrap();
    let info = f.tensor_info("iq").unwrap();
    assert_eq!(info.ggml_type, GgmlType::Other(99));
    let err = f.dequantize("iq").unwrap_err();
    assert!(
        matches!(err, FormatError::UnsupportedQuantization { .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("iq") && err.to_string().contains("id 99"),
        "{err}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    /// Random byte corruption never panics: it opens or gives a Format error.
    #[test]
    fn corrupted_files_never_panic(flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)) {
        let mut bytes = sample().bytes();
        for (at, value) in flips {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        match open_bytes("fuzz", &bytes) {
            Ok(f) => {
                for t in f.tensors() {
                    let _ = f.dequantize(&t.name);
                }
            }
            Err(FormatError::Format { .. }) => {}
            Err(e) => prop_assert!(false, "unexpected error {e}"),
        }
    }
}

#[test]
fn metadata_arrays_are_bounded_in_memory_by_the_file() {
    // An array of `n` elements of type `ty`, `size` bytes each.
    let array = |ty: u32, n: u64, size: usize| {
        let mut v = ty.to_le_bytes().to_vec();
        v.extend(n.to_le_bytes());
        v.extend(std::iter::repeat_n(7u8, n as usize * size));
        v
    };
    // 1 Mi one-byte elements: a 1 MiB file whose values would take 32 MiB
    // (32 bytes each), over 8 bytes of memory per byte of file.
    let n = 1u64 << 20;
    let mut w = Writer::default();
    w.kv("a.bytes", 9, &array(0, n, 1));
    expect_format_error(
        "byte-array",
        &w.bytes(),
        "`a.bytes`: array length 1048576 takes the file's metadata arrays to 1048576 elements",
    );
    // The bound is on the whole file's arrays: the first (4 MiB of values
    // from a 640 KiB file) passes, the second takes them over.
    let mut w = Writer::default();
    w.kv("a.bytes", 9, &array(0, n / 8, 1));
    w.kv("b.bytes", 9, &array(1, n / 2, 1));
    expect_format_error("two-arrays", &w.bytes(), "`b.bytes`: array length 524288");
    // 4-byte numbers (a vocabulary's scores) take 8 bytes per byte: fine.
    let mut w = Writer::default();
    w.kv("a.floats", 9, &array(6, n, 4));
    let f = open_bytes("float-array", &w.bytes()).expect("4-byte elements are justified");
    assert_eq!(f.get_f32_array("a.floats").unwrap().len(), n as usize);
}
