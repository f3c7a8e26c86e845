//! A reader for GGUF files (versions 2 and 3), memory-mapped.
//!
//! Layout (llama.cpp `ggml/docs/gguf.md`; all integers little-endian):
//!
//! ```text
//! magic "GGUF" | version: u32 | tensor_count: u64 | metadata_kv_count: u64
//! metadata_kv_count × { key: string, value_type: u32, value }
//! tensor_count × { name: string, n_dims: u32, ne: u64 × n_dims, type: u32, offset: u64 }
//! padding to `general.alignment` (default 32)
//! tensor data: each tensor at data_start + offset (offset a multiple of the alignment)
//! ```
//!
//! A string is `len: u64` then `len` UTF-8 bytes (no terminator). Value types:
//! 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool (1 byte), 8 string,
//! 9 array (`elem_type: u32, len: u64, elems`), 10 u64, 11 i64, 12 f64.
//! `ne[0]` is the contiguous (row) dimension: a `[rows, cols]` matrix in
//! row-major order is stored with `ne = [cols, rows]`.
//!
//! Every count and length is checked against the bytes left in the file
//! before anything is allocated, so truncated or hostile files give
//! [`FormatError::Format`] naming the file, never a panic or a huge allocation.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use te_kernels::quant::{self, GgmlType};

use crate::tensor::{StoredTensor, TensorSource, WeightBytes, WeightData};
use crate::{FormatError, Result};

/// The most dimensions a GGML tensor has.
const MAX_DIMS: u32 = 4;
/// Metadata array elements a file may hold in all (each takes a
/// [`GgufValue`], 32 bytes, in memory, however few bytes it takes in the
/// file): 16 Mi elements, 512 MiB. Real files hold a few per vocabulary
/// entry (262144 entries for Gemma 3: about 1 Mi elements).
const MAX_ARRAY_ELEMENTS: u64 = 16 << 20;

/// Bytes of memory the metadata arrays' elements may take per byte of the
/// file: an element takes a [`GgufValue`] (32 bytes) in memory, so arrays
/// of 1-byte elements would take 32 times their size; 4-byte numbers (a
/// vocabulary's scores and token types) take 8 times theirs, strings
/// (8-byte length, then their bytes) at most 4 times plus their bytes,
/// which are copied once. Real files (weights included, or vocabulary-only
/// ones) stay well under this.
const ARRAY_MEMORY_PER_FILE_BYTE: u64 = 8;

/// Array nesting deeper than this is rejected (real files nest at most 1).
const MAX_ARRAY_DEPTH: u32 = 8;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    /// The value as an unsigned integer, if it is a non-negative integer of
    /// any width (GGUF writers disagree on integer widths).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v as u64),
            GgufValue::U16(v) => Some(v as u64),
            GgufValue::U32(v) => Some(v as u64),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a signed integer, if it is an integer that fits in i64.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::I8(v) => Some(v as i64),
            GgufValue::I16(v) => Some(v as i64),
            GgufValue::I32(v) => Some(v as i64),
            GgufValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// The value as f64, if it is a float or an integer.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v as f64),
            GgufValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// The GGUF name of this value's type (`"u32"`, `"array"`, ...), for errors.
    pub fn type_name(&self) -> &'static str {
        match self {
            GgufValue::U8(_) => "u8",
            GgufValue::I8(_) => "i8",
            GgufValue::U16(_) => "u16",
            GgufValue::I16(_) => "i16",
            GgufValue::U32(_) => "u32",
            GgufValue::I32(_) => "i32",
            GgufValue::F32(_) => "f32",
            GgufValue::Bool(_) => "bool",
            GgufValue::String(_) => "string",
            GgufValue::Array(_) => "array",
            GgufValue::U64(_) => "u64",
            GgufValue::I64(_) => "i64",
            GgufValue::F64(_) => "f64",
        }
    }
}

/// One tensor's entry in the GGUF tensor-info table.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// The GGUF tensor name (`"blk.0.attn_q.weight"`).
    pub name: String,
    /// `ne`: sizes with the contiguous dimension first (`ne[0]` = row length).
    pub dims: Vec<u64>,
    /// The stored type.
    pub ggml_type: GgmlType,
    /// Byte offset of the data from the start of the data section.
    pub offset: u64,
    /// Bytes of data, or `None` for a type whose block layout te-rs does not know.
    pub n_bytes: Option<u64>,
}

impl TensorInfo {
    /// Number of elements (product of `dims`).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// The shape in row-major order, outermost first (`dims` reversed):
    /// a matrix stored with `ne = [cols, rows]` gives `[rows, cols]`.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// An open, memory-mapped GGUF file.
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    /// Shared with the quantized weights loaded from it
    /// ([`WeightBytes`]), which read the map in place.
    mmap: Arc<Mmap>,
    version: u32,
    metadata: Vec<(String, GgufValue)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_start: u64,
}

impl GgufFile {
    /// Opens and parses a GGUF file (versions 2 and 3).
    ///
    /// Errors: [`FormatError::Io`] when the file cannot be read,
    /// [`FormatError::Format`] (naming the file and the problem) for a bad
    /// magic, an unsupported version, truncation, absurd counts or lengths,
    /// duplicate names, or tensor data that lies outside the file, is not
    /// aligned, or does not start where the previous tensor's ends (so
    /// overlapping data, or a tensor relabelled with another type, is
    /// refused).
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref().to_path_buf();
        let io = |error| FormatError::Io {
            path: path.clone(),
            error,
        };
        let file = File::open(&path).map_err(io)?;
        // SAFETY: the map is read-only; as with every mmap-based model
        // loader, the file must not be truncated or rewritten while open.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::parse(path, mmap)
    }

    fn parse(path: PathBuf, mmap: Mmap) -> Result<GgufFile> {
        let mut r = Reader {
            buf: &mmap,
            pos: 0,
            path: &path,
            array_elements: 0,
        };
        let magic = r.bytes(4, "magic")?;
        if magic != b"GGUF" {
            return Err(r.err(format!("not a GGUF file (magic {magic:02x?})")));
        }
        let version = r.u32("version")?;
        if version != 2 && version != 3 {
            return Err(r.err(format!(
                "unsupported GGUF version {version} (supported: 2, 3)"
            )));
        }
        let tensor_count = r.u64("tensor_count")?;
        let kv_count = r.u64("metadata_kv_count")?;
        // Each KV takes at least 8 (key length) + 4 (type) + 1 bytes; each
        // tensor info at least 8 + 4 + 4 + 8 bytes.
        r.check_count(kv_count, 13, "metadata_kv_count")?;
        r.check_count(tensor_count, 24, "tensor_count")?;

        let mut metadata = Vec::with_capacity(kv_count as usize);
        let mut metadata_index = HashMap::with_capacity(kv_count as usize);
        for i in 0..kv_count {
            let key = r.name(&format!("key of metadata entry {i}"))?;
            let ty = r.u32(&format!("type of metadata `{key}`"))?;
            let value = r.value(ty, &format!("value of metadata `{key}`"), 0)?;
            if metadata_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(r.err(format!("duplicate metadata key `{key}`")));
            }
            metadata.push((key, value));
        }

        let alignment = match metadata_index.get("general.alignment") {
            None => 32,
            Some(&i) => match metadata[i].1.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 30 => a,
                _ => {
                    return Err(r.err(format!(
                        "general.alignment must be a power of two, got {:?}",
                        metadata[i].1
                    )))
                }
            },
        };

        let mut tensors = Vec::with_capacity(tensor_count as usize);
        let mut tensor_index = HashMap::with_capacity(tensor_count as usize);
        for i in 0..tensor_count {
            let name = r.name(&format!("name of tensor {i}"))?;
            let n_dims = r.u32(&format!("n_dims of tensor `{name}`"))?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(r.err(format!(
                    "tensor `{name}` has n_dims {n_dims} (must be 1..={MAX_DIMS})"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64(&format!("dims of tensor `{name}`"))?);
            }
            let n_elements = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .filter(|&n| n <= i64::MAX as u64)
                .ok_or_else(|| r.err(format!("tensor `{name}` dims {dims:?} overflow")))?;
            let ggml_type = GgmlType::from_id(r.u32(&format!("type of tensor `{name}`"))?);
            let offset = r.u64(&format!("offset of tensor `{name}`"))?;
            if !offset.is_multiple_of(alignment) {
                return Err(r.err(format!(
                    "tensor `{name}` offset {offset} is not a multiple of the alignment {alignment}"
                )));
            }
            let n_bytes = match ggml_type.block_layout() {
                None => None,
                Some((block_len, _)) => {
                    if !dims[0].is_multiple_of(block_len as u64) {
                        return Err(r.err(format!(
                            "tensor `{name}`: row length {} is not a multiple of the {} block length {block_len}",
                            dims[0],
                            ggml_type.name()
                        )));
                    }
                    Some(
                        ggml_type.bytes_for(n_elements).ok_or_else(|| {
                            r.err(format!("tensor `{name}`: byte size overflows"))
                        })?,
                    )
                }
            };
            if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                return Err(r.err(format!("duplicate tensor name `{name}`")));
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ggml_type,
                offset,
                n_bytes,
            });
        }

        let file_len = mmap.len() as u64;
        let data_start = (r.pos as u64).div_ceil(alignment) * alignment;
        check_data_layout(&tensors, data_start, alignment, file_len).map_err(|e| r.err(e))?;
        Ok(GgufFile {
            path,
            mmap: Arc::new(mmap),
            version,
            metadata,
            metadata_index,
            tensors,
            tensor_index,
            alignment,
            data_start,
        })
    }

    /// The path this file was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The data alignment in bytes (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Byte offset of the tensor data section in the file.
    pub fn data_start(&self) -> u64 {
        self.data_start
    }

    /// All metadata entries in file order.
    pub fn metadata_entries(&self) -> &[(String, GgufValue)] {
        &self.metadata
    }

    /// The metadata value under `key`, if present.
    pub fn metadata(&self, key: &str) -> Option<&GgufValue> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn required(&self, key: &str) -> Result<&GgufValue> {
        self.metadata(key).ok_or_else(|| FormatError::Config {
            field: key.to_string(),
            reason: format!("missing from {}", self.path.display()),
        })
    }

    fn mismatch(key: &str, want: &str, got: &GgufValue) -> FormatError {
        FormatError::Config {
            field: key.to_string(),
            reason: format!("expected {want}, found {}", got.type_name()),
        }
    }

    /// A required non-negative integer (any integer width) that fits in u32.
    /// Errors: [`FormatError::Config`] naming `key` when missing or mistyped.
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        let v = self.required(key)?;
        v.as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .ok_or_else(|| Self::mismatch(key, "an integer in 0..=u32::MAX", v))
    }

    /// A required non-negative integer (any integer width).
    /// Errors: [`FormatError::Config`] naming `key` when missing or mistyped.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        let v = self.required(key)?;
        v.as_u64()
            .ok_or_else(|| Self::mismatch(key, "a non-negative integer", v))
    }

    /// A required float (f32, f64, or an integer, converted to f32).
    /// Errors: [`FormatError::Config`] naming `key` when missing or mistyped.
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        let v = self.required(key)?;
        v.as_f64()
            .map(|x| x as f32)
            .ok_or_else(|| Self::mismatch(key, "a number", v))
    }

    /// A required bool.
    /// Errors: [`FormatError::Config`] naming `key` when missing or mistyped.
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        match self.required(key)? {
            GgufValue::Bool(b) => Ok(*b),
            v => Err(Self::mismatch(key, "bool", v)),
        }
    }

    /// A required string.
    /// Errors: [`FormatError::Config`] naming `key` when missing or mistyped.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        match self.required(key)? {
            GgufValue::String(s) => Ok(s),
            v => Err(Self::mismatch(key, "string", v)),
        }
    }

    fn get_array(&self, key: &str) -> Result<&[GgufValue]> {
        match self.required(key)? {
            GgufValue::Array(a) => Ok(a),
            v => Err(Self::mismatch(key, "array", v)),
        }
    }

    /// A required array of strings (borrowed).
    /// Errors: [`FormatError::Config`] naming `key` when missing or mistyped.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        self.get_array(key)?
            .iter()
            .map(|v| match v {
                GgufValue::String(s) => Ok(s.as_str()),
                v => Err(Self::mismatch(key, "array of string", v)),
            })
            .collect()
    }

    /// A required array of numbers, as f32.
    /// Errors: [`FormatError::Config`] naming `key` when missing or mistyped.
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>> {
        self.get_array(key)?
            .iter()
            .map(|v| {
                v.as_f64()
                    .map(|x| x as f32)
                    .ok_or_else(|| Self::mismatch(key, "array of numbers", v))
            })
            .collect()
    }

    /// A required array of integers that fit in i32.
    /// Errors: [`FormatError::Config`] naming `key` when missing or mistyped.
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>> {
        self.get_array(key)?
            .iter()
            .map(|v| {
                v.as_i64()
                    .and_then(|x| i32::try_from(x).ok())
                    .ok_or_else(|| Self::mismatch(key, "array of i32", v))
            })
            .collect()
    }

    /// All tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The info of tensor `name`, if present.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The stored bytes of a tensor (validated to lie in the file at open).
    ///
    /// Errors: [`FormatError::UnsupportedQuantization`] when the type's block
    /// layout is unknown, so its size is unknown.
    pub fn tensor_bytes(&self, info: &TensorInfo) -> Result<&[u8]> {
        let n = info
            .n_bytes
            .ok_or_else(|| FormatError::UnsupportedQuantization {
                tensor: info.name.clone(),
                type_name: info.ggml_type.name(),
            })?;
        let start = (self.data_start + info.offset) as usize;
        Ok(&self.mmap[start..start + n as usize])
    }

    /// The stored bytes of a tensor as a shared view of the file map (no
    /// copy: the bytes stay in the page cache, resident once however many
    /// readers map them). Errors as [`tensor_bytes`](Self::tensor_bytes).
    ///
    /// The output projection (`output.weight`, or `token_embd.weight` when
    /// there is none: tied), read in full for every generated token, is
    /// the exception when it is at least 64 MiB: it is copied into memory
    /// that asks for 2 MiB pages (the file map's copied pages dropped as it
    /// goes: resident memory unchanged), as 4 KiB pages cost a TLB miss
    /// each.
    pub fn tensor_weight_bytes(&self, info: &TensorInfo) -> Result<WeightBytes> {
        let n = self.tensor_bytes(info)?.len();
        let start = (self.data_start + info.offset) as usize;
        let output = info.name == "output.weight"
            || (info.name == "token_embd.weight" && self.tensor_info("output.weight").is_none());
        if output && n >= 64 << 20 {
            // SAFETY: `self.mmap` is a shared read-only map of the model
            // file (`Mmap::map` in `open`), which te-rs never writes.
            return unsafe { WeightBytes::copied_to_huge_pages(&self.mmap, start..start + n) }
                .map_err(|e| FormatError::Tensor {
                    tensor: info.name.clone(),
                    reason: format!("cannot copy {n} bytes into memory: {e}"),
                });
        }
        Ok(WeightBytes::mapped(
            Arc::clone(&self.mmap),
            start..start + n,
        ))
    }

    /// Dequantizes tensor `name` to f32, row-major with rows of `ne[0]`
    /// elements (shape [`TensorInfo::shape`]).
    ///
    /// Errors: [`FormatError::Tensor`] when there is no such tensor,
    /// [`FormatError::UnsupportedQuantization`] for a type te-rs cannot read.
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>> {
        let info = self.tensor_info(name).ok_or_else(|| FormatError::Tensor {
            tensor: name.to_string(),
            reason: format!("not found in {}", self.path.display()),
        })?;
        let bytes = self.tensor_bytes(info)?;
        let mut out = vec![0f32; info.n_elements() as usize];
        quant::dequantize(name, info.ggml_type, bytes, info.dims[0] as usize, &mut out)?;
        Ok(out)
    }
}

/// Checks where the tensors' data lies, as llama.cpp's reader does: in
/// table order, each tensor starts at the aligned end of the one before
/// (the first at offset 0), and each lies inside the file. So the data
/// ranges are aligned, in bounds and pairwise disjoint, and a tensor whose
/// type or shape was altered (and so its size) is caught by the next
/// tensor's offset. After a tensor of unknown type (unknown size) the next
/// one only has to start after it.
fn check_data_layout(
    tensors: &[TensorInfo],
    data_start: u64,
    alignment: u64,
    file_len: u64,
) -> std::result::Result<(), String> {
    // The previous tensor and the end of its data (its offset when its
    // size is unknown).
    let mut prev: Option<(&TensorInfo, u64)> = None;
    for t in tensors {
        match prev {
            None if t.offset != 0 => {
                return Err(format!(
                    "tensor `{}` data starts at offset {}; the first tensor's must start at 0",
                    t.name, t.offset
                ))
            }
            None => {}
            Some((p, p_end)) => {
                let aligned_end = p_end.div_ceil(alignment) * alignment;
                let ok = match p.n_bytes {
                    Some(_) => t.offset == aligned_end,
                    None => t.offset > p.offset,
                };
                if !ok {
                    let relation = match p.n_bytes {
                        None => "does not start after",
                        Some(_) if t.offset < p_end => "overlaps",
                        Some(_) => "leaves a gap after",
                    };
                    let size = p
                        .n_bytes
                        .map_or("of unknown size".into(), |n| format!("{n} bytes"));
                    return Err(format!(
                        "tensor `{}` data (offset {}) {relation} the previous tensor `{}` \
                         ({} {:?}, offset {}, {size}); each tensor's data must start at the \
                         aligned end of the previous one's ({aligned_end}): a tensor's type or \
                         shape does not match its data",
                        t.name,
                        t.offset,
                        p.name,
                        p.ggml_type.name(),
                        p.shape(),
                        p.offset
                    ));
                }
            }
        }
        let start = data_start.checked_add(t.offset);
        let in_file = match (start, t.n_bytes) {
            (Some(s), None) => s <= file_len,
            (Some(s), Some(n)) => s.checked_add(n).is_some_and(|e| e <= file_len),
            (None, _) => false,
        };
        if !in_file {
            return Err(format!(
                "tensor `{}` data (offset {}, {} bytes, data section at {data_start}) lies past the end of the file ({file_len} bytes): truncated file?",
                t.name,
                t.offset,
                t.n_bytes.map_or("unknown".into(), |n| n.to_string())
            ));
        }
        // In the file, so offset + n_bytes cannot overflow.
        prev = Some((t, t.offset + t.n_bytes.unwrap_or(0)));
    }
    Ok(())
}

/// A bounds-checked little-endian cursor over the file bytes.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
    /// Metadata array elements read so far (see [`MAX_ARRAY_ELEMENTS`]).
    array_elements: u64,
}

impl<'a> Reader<'a> {
    fn err(&self, reason: String) -> FormatError {
        FormatError::Format {
            path: self.path.to_path_buf(),
            reason,
        }
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn bytes(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.err(format!(
                "truncated: {what} needs {n} bytes at offset {} but the file has {} bytes",
                self.pos,
                self.buf.len()
            )));
        }
        let buf: &'a [u8] = self.buf;
        let s = &buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    /// Fails unless `count` items of at least `min_size` bytes fit in the rest of the file.
    fn check_count(&self, count: u64, min_size: u64, what: &str) -> Result<()> {
        if count.saturating_mul(min_size) > self.remaining() as u64 {
            return Err(self.err(format!(
                "{what} = {count} cannot fit in the {} bytes left in the file",
                self.remaining()
            )));
        }
        Ok(())
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self.bytes(N, what)?.try_into().expect("length checked"))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A GGUF string. Invalid UTF-8 is replaced with U+FFFD (llama.cpp
    /// accepts arbitrary bytes; real vocabularies are valid UTF-8).
    /// A metadata key or tensor name: a string of at most 65535 bytes
    /// (the GGUF limit for keys) without control characters, so a corrupt
    /// length cannot pour file bytes into an error message.
    fn name(&mut self, what: &str) -> Result<String> {
        let at = self.pos;
        let len = self.u64(what)?;
        if len > u16::MAX as u64 {
            return Err(self.err(format!(
                "{what} at byte {at}: length {len} exceeds the 65535-byte limit of GGUF names"
            )));
        }
        let name = self.string_of_len(len as usize, what)?;
        if name.chars().any(char::is_control) || name.contains('\u{FFFD}') {
            return Err(self.err(format!(
                "{what} at byte {at} is not a valid name (control characters or invalid UTF-8)"
            )));
        }
        Ok(name)
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        if len > self.remaining() as u64 {
            return Err(self.err(format!(
                "{what}: string length {len} exceeds the {} bytes left in the file",
                self.remaining()
            )));
        }
        self.string_of_len(len as usize, what)
    }

    fn string_of_len(&mut self, len: usize, what: &str) -> Result<String> {
        let bytes = self.bytes(len, what)?;
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    /// One metadata value of type `ty`; `what` names it in errors (made
    /// once per key: an array's elements share it).
    fn value(&mut self, ty: u32, what: &str, depth: u32) -> Result<GgufValue> {
        Ok(match ty {
            0 => GgufValue::U8(u8::from_le_bytes(self.array(what)?)),
            1 => GgufValue::I8(i8::from_le_bytes(self.array(what)?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(what)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(what)?)),
            4 => GgufValue::U32(u32::from_le_bytes(self.array(what)?)),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(what)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return Err(self.err(format!("{what}: bool byte {b} is not 0 or 1"))),
            },
            8 => GgufValue::String(self.string(what)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.err(format!("{what}: arrays nested too deeply")));
                }
                let elem_ty = self.u32(what)?;
                let len = self.u64(what)?;
                // Every element takes at least one byte (bools, u8) and at
                // least 8 (its length) for strings and arrays.
                let min_size = match elem_ty {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8..=12 => 8,
                    t => return Err(self.err(format!("{what}: unknown array element type {t}"))),
                };
                self.check_count(len, min_size, &format!("{what}: array length"))?;
                self.array_elements = self.array_elements.saturating_add(len);
                // Checked before the elements are allocated.
                let per_element = size_of::<GgufValue>() as u64;
                let justified = (self.buf.len() as u64).saturating_mul(ARRAY_MEMORY_PER_FILE_BYTE)
                    / per_element;
                if self.array_elements > MAX_ARRAY_ELEMENTS.min(justified) {
                    return Err(self.err(format!(
                        "{what}: array length {len} takes the file's metadata arrays to {} \
                         elements, more than {MAX_ARRAY_ELEMENTS} in all or than the file's \
                         {} bytes justify ({per_element} bytes of memory each, at most \
                         {ARRAY_MEMORY_PER_FILE_BYTE} bytes per byte of file)",
                        self.array_elements,
                        self.buf.len()
                    )));
                }
                let mut items = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    items.push(self.value(elem_ty, what, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(u64::from_le_bytes(self.array(what)?)),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(what)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(what)?)),
            t => return Err(self.err(format!("{what}: unknown value type {t}"))),
        })
    }
}

impl TensorSource for GgufFile {
    fn stored_tensors(&self) -> Vec<StoredTensor> {
        self.tensors()
            .iter()
            .map(|t| StoredTensor {
                name: t.name.clone(),
                shape: t.shape(),
                dtype: t.ggml_type.name(),
                unreadable: (!t.ggml_type.can_dequantize()).then(|| {
                    format!(
                        "unsupported GGUF tensor type ({}; te-rs reads F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K)",
                        t.ggml_type.name()
                    )
                }),
            })
            .collect()
    }

    fn origin(&self) -> &std::path::Path {
        self.path()
    }

    fn load(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let info = self.tensor_info(name).ok_or_else(|| FormatError::Tensor {
            tensor: name.to_string(),
            reason: format!("missing from {}", self.path().display()),
        })?;
        let shape = info.shape();
        Ok((shape, self.dequantize(name)?))
    }

    fn contains(&self, name: &str) -> bool {
        self.tensor_info(name).is_some()
    }

    fn load_matrix(&self, name: &str) -> Result<(Vec<usize>, WeightData)> {
        let info = self.tensor_info(name).ok_or_else(|| FormatError::Tensor {
            tensor: name.to_string(),
            reason: format!("missing from {}", self.path().display()),
        })?;
        let blocked = info.ggml_type.can_dequantize()
            && info
                .ggml_type
                .block_layout()
                .is_some_and(|(len, _)| len > 1);
        if blocked {
            // Read in place from the file map: no copy of the weights.
            let data = self.tensor_weight_bytes(info)?;
            Ok((
                info.shape(),
                WeightData::Quantized {
                    ty: info.ggml_type,
                    data,
                },
            ))
        } else {
            let (shape, data) = self.load(name)?;
            Ok((shape, WeightData::F32(data)))
        }
    }
}
