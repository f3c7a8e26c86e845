//! What a model file holds, before any math: stored tensors
//! ([`TensorSource`], implemented by GGUF files and safetensors
//! directories) and the storage of a weight matrix ([`WeightData`]: f32,
//! or GGUF blocks kept as stored, read in place from the file map through
//! [`WeightBytes`]).

use std::path::Path;

use te_kernels::quant::GgmlType;

use crate::Result;

/// One stored tensor as its file's header declares it (no data read).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredTensor {
    /// The name in the file.
    pub name: String,
    /// Row-major shape, outermost first.
    pub shape: Vec<usize>,
    /// The stored type: a GGUF type name (`Q4_K`, `id 99`) or a
    /// safetensors dtype (`BF16`).
    pub dtype: String,
    /// Why te-rs cannot read this tensor's type, when it cannot.
    pub unreadable: Option<String>,
}

/// Where tensors come from: a GGUF file or a Hugging Face safetensors
/// directory. Every tensor is returned dequantized to f32, row-major, with
/// its shape outermost first (`[out_features, in_features]` for a matrix).
pub trait TensorSource {
    /// Loads `name`; `FormatError::Tensor` naming it when missing or unreadable.
    fn load(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)>;
    /// Whether the source has a tensor called `name`.
    fn contains(&self, name: &str) -> bool;
    /// Loads a weight matrix: f32 by default; a GGUF source keeps
    /// block-quantized tensors as stored.
    fn load_matrix(&self, name: &str) -> Result<(Vec<usize>, WeightData)> {
        let (shape, data) = self.load(name)?;
        Ok((shape, WeightData::F32(data)))
    }
    /// Every stored tensor's header entry, in file order.
    fn stored_tensors(&self) -> Vec<StoredTensor>;
    /// The file or directory the tensors come from (named in errors).
    fn origin(&self) -> &Path;
}

/// The bytes of a quantized weight: owned, or a range of a read-only file
/// map shared with the [`crate::gguf::GgufFile`] it came from, read in
/// place (GGUF weights are then resident once, in the page cache, as
/// stored, instead of mapped and copied).
#[derive(Clone)]
pub struct WeightBytes(BytesRepr);

#[derive(Clone)]
enum BytesRepr {
    Owned(Vec<u8>),
    Mapped {
        map: std::sync::Arc<memmap2::Mmap>,
        range: std::ops::Range<usize>,
    },
}

impl WeightBytes {
    /// `map[range]`, kept alive with the map. Panics when `range` is not
    /// inside the map.
    pub fn mapped(map: std::sync::Arc<memmap2::Mmap>, range: std::ops::Range<usize>) -> Self {
        assert!(
            range.start <= range.end && range.end <= map.len(),
            "WeightBytes: range outside the map"
        );
        WeightBytes(BytesRepr::Mapped { map, range })
    }

    /// `map[range]` copied into anonymous memory that asks for 2 MiB pages
    /// (Linux `MADV_HUGEPAGE`; elsewhere, or where the kernel grants none,
    /// plain pages), for a matrix read in full for every token (the output
    /// projection), whose 4 KiB file-map pages cost a TLB miss each. The
    /// copy goes 2 MiB at a time and each copied part of the map is then
    /// dropped from this process (`MADV_DONTNEED`; the file's pages stay in
    /// the page cache), so resident memory does not grow by the copy.
    ///
    /// Errors: the anonymous map cannot be made (out of memory).
    ///
    /// # Safety
    /// `map` must be a shared, read-only map of a file that nobody writes
    /// while it is mapped (as [`crate::gguf::GgufFile`]'s): dropping its
    /// pages, which the kernel rounds out to whole pages, must leave every
    /// byte reading the same. (On an anonymous or private map it would
    /// zero them under other readers.)
    pub(crate) unsafe fn copied_to_huge_pages(
        map: &std::sync::Arc<memmap2::Mmap>,
        range: std::ops::Range<usize>,
    ) -> std::io::Result<Self> {
        const CHUNK: usize = 2 << 20;
        let mut copy = memmap2::MmapOptions::new()
            .len(range.len().max(1))
            .map_anon()?;
        #[cfg(target_os = "linux")]
        {
            // Only a request: a kernel that grants no huge pages leaves 4 KiB ones.
            let _ = copy.advise(memmap2::Advice::HugePage);
        }
        for (i, dst) in copy[..range.len()].chunks_mut(CHUNK).enumerate() {
            let at = range.start + i * CHUNK;
            dst.copy_from_slice(&map[at..at + dst.len()]);
            #[cfg(unix)]
            // SAFETY: the map is a read-only, shared map of a file nobody
            // writes while it is mapped (the caller's promise): dropping its
            // pages (those of this part, rounded out to whole pages: the
            // next part's first bytes too) only makes the next read of them
            // fault the same bytes in again from the page cache.
            let _ = unsafe {
                map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, at, dst.len())
            };
        }
        let len = range.len();
        Ok(WeightBytes(BytesRepr::Mapped {
            map: std::sync::Arc::new(copy.make_read_only()?),
            range: 0..len,
        }))
    }
}

impl From<Vec<u8>> for WeightBytes {
    fn from(v: Vec<u8>) -> Self {
        WeightBytes(BytesRepr::Owned(v))
    }
}

impl std::ops::Deref for WeightBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.0 {
            BytesRepr::Owned(v) => v,
            BytesRepr::Mapped { map, range } => &map[range.clone()],
        }
    }
}

impl std::fmt::Debug for WeightBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.0 {
            BytesRepr::Owned(_) => "owned",
            BytesRepr::Mapped { .. } => "mapped",
        };
        write!(f, "WeightBytes({} bytes, {kind})", self.len())
    }
}

/// Storage of a `[rows, cols]` weight matrix.
#[derive(Clone, Debug)]
pub enum WeightData {
    /// f32, row-major.
    F32(Vec<f32>),
    /// GGUF blocks of type `ty` (or bf16/f16 values from safetensors, blocks
    /// of one), `cols / block_len` blocks per row, kept as
    /// stored and decoded inside the matrix kernel (te-kernels' `matmul`; the
    /// values are exactly those of a full dequantization).
    Quantized { ty: GgmlType, data: WeightBytes },
}

#[cfg(test)]
mod weight_bytes_tests {
    use super::WeightBytes;

    /// A copy into huge-page memory holds exactly the mapped range (one
    /// that starts and ends inside pages and spans several 2 MiB parts),
    /// and the file map still reads the file's bytes after the copied
    /// parts were dropped from it.
    #[test]
    fn huge_page_copy_equals_the_file() {
        let path = std::env::temp_dir().join(format!("te-huge-copy-{}", std::process::id()));
        let bytes: Vec<u8> = (0..5_000_123u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        std::fs::write(&path, &bytes).expect("write");
        let file = std::fs::File::open(&path).expect("open");
        // SAFETY: this test's own file, not changed while mapped.
        let map = std::sync::Arc::new(unsafe { memmap2::Mmap::map(&file) }.expect("map"));
        let range = 1001..4_900_017;
        // SAFETY: a shared read-only map of this test's own file.
        let copy = unsafe { WeightBytes::copied_to_huge_pages(&map, range.clone()) }.expect("copy");
        assert_eq!(&copy[..], &bytes[range]);
        assert!(
            map[..] == bytes[..],
            "the map changed after its pages were dropped"
        );
        std::fs::remove_file(&path).expect("remove");
    }
}
