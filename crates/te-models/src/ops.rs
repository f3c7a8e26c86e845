//! Dense CPU ops of the model forward that are not attention, RoPE or the
//! KV cache: linear layers (over f32 or GGUF-quantized weights, through
//! the one blocked kernel of [`crate::matmul`]) and RMSNorm (the gated
//! activations are [`crate::activation`]'s). All f32, row-major.

use rayon::prelude::*;

use crate::matmul::{self, Weights};
use crate::quant::{dequantize_blocks, GgmlType};

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
    /// GGUF blocks of type `ty`, `cols / block_len` blocks per row, kept as
    /// stored and decoded inside the matrix kernel ([`crate::matmul`]; the
    /// values are exactly those of a full dequantization).
    Quantized { ty: GgmlType, data: WeightBytes },
}

/// A linear layer: `y = x · Wᵀ (+ b)`.
///
/// `weight: [out_features, in_features]`, row-major (Hugging Face and GGUF
/// order: GGUF `ne[0]` is `in_features`), f32 or GGUF-quantized;
/// `bias: [out_features]` when the model has one (Hugging Face
/// `attention_bias` / `mlp_bias`).
#[derive(Clone, Debug)]
pub struct Linear {
    pub weight: WeightData,
    /// Added to every output row.
    pub bias: Option<Vec<f32>>,
    pub out_features: usize,
    pub in_features: usize,
}

impl Linear {
    /// Wraps a `[out_features, in_features]` weight (no bias); errors name
    /// `tensor` when the data does not hold that many elements.
    pub fn new(
        tensor: &str,
        weight: WeightData,
        out_features: usize,
        in_features: usize,
    ) -> crate::Result<Self> {
        let n = out_features * in_features;
        let ok = match &weight {
            WeightData::F32(w) => w.len() == n,
            WeightData::Quantized { ty, data } => {
                ty.block_layout().is_some_and(|(block_len, _)| {
                    in_features.is_multiple_of(block_len)
                        && ty.bytes_for(n as u64) == Some(data.len() as u64)
                })
            }
        };
        if !ok {
            return Err(crate::ModelError::Tensor {
                tensor: tensor.to_string(),
                reason: format!("data does not hold a [{out_features}, {in_features}] matrix"),
            });
        }
        Ok(Linear {
            weight,
            bias: None,
            out_features,
            in_features,
        })
    }

    /// The layer with bias `bias: [out_features]` (tensor `tensor`, named
    /// in the error when its length is not `out_features`).
    pub fn with_bias(mut self, tensor: &str, bias: Vec<f32>) -> crate::Result<Self> {
        if bias.len() != self.out_features {
            return Err(crate::ModelError::Tensor {
                tensor: tensor.to_string(),
                reason: format!(
                    "has {} values, expected {} (out_features)",
                    bias.len(),
                    self.out_features
                ),
            });
        }
        self.bias = Some(bias);
        Ok(self)
    }

    /// `x: [t, in_features]` -> `y: [t, out_features]`, bias added.
    pub fn forward(&self, x: &[f32], t: usize) -> Vec<f32> {
        let mut y = vec![0.0f32; t * self.out_features];
        self.forward_into(x, t, &mut y, &mut Vec::new());
        y
    }

    /// [`forward`](Self::forward) into `y: [t, out_features]`, with
    /// `scratch` reused across calls (the kernel's decoded weight panels
    /// and accumulators): decode allocates nothing
    /// once `scratch` has grown. Each output row is bit-identical for any
    /// `t` and any position in the batch ([`crate::matmul`]).
    pub fn forward_into(&self, x: &[f32], t: usize, y: &mut [f32], scratch: &mut Vec<f32>) {
        Linear::forward_many_into([self], x, t, [y], scratch)
    }

    /// [`forward_into`](Self::forward_into) of `N` layers that read the
    /// same `x: [t, in_features]` (Q, K and V; gate and up), in one
    /// parallel launch whose tasks cover the rows of every weight (fewer
    /// hand-offs to the thread pool in decode): `ys[i]: [t,
    /// ls[i].out_features]`, each bit-identical to its own
    /// `forward_into`.
    ///
    /// Panics: layers of different `in_features`, or a `y` or `x` of the
    /// wrong length.
    pub fn forward_many_into<const N: usize>(
        ls: [&Linear; N],
        x: &[f32],
        t: usize,
        mut ys: [&mut [f32]; N],
        scratch: &mut Vec<f32>,
    ) {
        let k = ls.first().map_or(0, |l| l.in_features);
        assert!(
            ls.iter().all(|l| l.in_features == k),
            "Linear::forward_many_into: layers of different in_features"
        );
        for (l, y) in ls.iter().zip(&ys) {
            assert_eq!(
                y.len(),
                t * l.out_features,
                "Linear::forward_into: y is not [t, out_features]"
            );
        }
        let products = {
            let mut outs = ys.each_mut().into_iter();
            ls.map(|l| matmul::Product {
                w: match &l.weight {
                    WeightData::F32(w) => Weights::F32(w),
                    WeightData::Quantized { ty, data } => Weights::Quantized { ty: *ty, data },
                },
                n: l.out_features,
                y: outs.next().expect("one output per layer"),
            })
        };
        matmul::matmul_many_into(x, t, k, products, scratch);
        for (l, y) in ls.iter().zip(ys) {
            if let Some(b) = &l.bias {
                for row in y.chunks_exact_mut(l.out_features) {
                    add_inplace(row, b);
                }
            }
        }
    }

    /// Row `r` of the weight (an embedding lookup), as f32 into `out: [in_features]`.
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        let k = self.in_features;
        match &self.weight {
            WeightData::F32(w) => out.copy_from_slice(&w[r * k..(r + 1) * k]),
            WeightData::Quantized { ty, data } => {
                let rb = data.len() / self.out_features;
                dequantize_blocks(*ty, &data[r * rb..(r + 1) * rb], out);
            }
        }
    }

    /// The whole weight as f32 `[out_features, in_features]`.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut w = vec![0.0f32; self.out_features * self.in_features];
        w.par_chunks_mut(self.in_features)
            .enumerate()
            .for_each(|(r, row)| self.row_into(r, row));
        w
    }
}

/// `y = x · wᵀ`: `x: [t, k]`, `w: [n, k]` -> `y: [t, n]`, f32, with the
/// arithmetic of [`crate::matmul`] (16-lane fused multiply-adds, a fixed
/// lane tree), so every row's result is the same for any `t`.
pub fn matmul_transposed(x: &[f32], t: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; t * n];
    matmul_transposed_into(x, t, w, n, k, &mut y, &mut Vec::new());
    y
}

/// [`matmul_transposed`] into `y: [t, n]`, `scratch` reused (see
/// [`Linear::forward_into`]).
fn matmul_transposed_into(
    x: &[f32],
    t: usize,
    w: &[f32],
    n: usize,
    k: usize,
    y: &mut [f32],
    scratch: &mut Vec<f32>,
) {
    assert_eq!(x.len(), t * k, "matmul_transposed: x is not [t, k]");
    assert_eq!(w.len(), n * k, "matmul_transposed: w is not [n, k]");
    matmul::matmul_into(x, t, Weights::F32(w), n, k, y, scratch)
}

/// RMSNorm over rows of `x: [rows, dim]`: `y = x / sqrt(mean(x²) + eps) * w`.
///
/// `w` is the effective multiplier: for Gemma it already holds `1 + w`
/// (added in f32 at load time). Math: Zhang & Sennrich 2019.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut y = x.to_vec();
    rms_norm_inplace(&mut y, w, eps);
    y
}

/// [`rms_norm`] of `x` into `y` (same length).
pub fn rms_norm_into(x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) {
    y.copy_from_slice(x);
    rms_norm_inplace(y, w, eps);
}

/// Below this many values an elementwise or row-wise op runs on the
/// calling thread: handing a few thousand values to the pool costs more
/// than computing them (decode steps run ~7 such ops per layer). The
/// result is the same either way (each value is computed alone).
pub(crate) const SERIAL_MAX: usize = 16 * 1024;

/// In-place [`rms_norm`] over rows of length `w.len()`.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let dim = w.len();
    let norm = |row: &mut [f32]| {
        let ms = sum_squares(row) / dim as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for (v, g) in row.iter_mut().zip(w) {
            *v = *v * inv * g;
        }
    };
    if x.len() <= SERIAL_MAX {
        x.chunks_mut(dim).for_each(norm);
    } else {
        x.par_chunks_mut(dim).for_each(norm);
    }
}

/// `Σ v²` over `row` in 16 lanes (lane `l` sums the squares of the
/// elements `≡ l (mod 16)` in order, each a multiply then an add), then
/// the lanes as [`crate::matmul`]'s fixed tree: independent chains, so it
/// vectorizes, where one running sum waits on every add.
fn sum_squares(row: &[f32]) -> f32 {
    let mut a = [0.0f32; 16];
    let chunks = row.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, v) in a.iter_mut().zip(c) {
            *a += v * v;
        }
    }
    for (a, v) in a.iter_mut().zip(tail) {
        *a += v * v;
    }
    matmul::reduce16(&a)
}

/// `x = x + y`, elementwise.
pub fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod norm_tests {
    use super::*;

    /// By hand: 1² + ... + 20² = 2870 (exact in f32 in any order).
    #[test]
    fn sum_squares_by_hand() {
        let row: Vec<f32> = (1..=20).map(|v| v as f32).collect();
        assert_eq!(sum_squares(&row), 2870.0);
        assert_eq!(sum_squares(&[]), 0.0);
    }

    /// RMSNorm against its float64 formula for row lengths around the
    /// 16 lanes and the models' widths, several rows at once (the pooled
    /// path included).
    #[test]
    fn rms_norm_matches_f64() {
        for dim in [1usize, 15, 16, 17, 64, 256, 640, 2047] {
            let rows = 40_000 / dim + 1;
            let x: Vec<f32> = (0..rows * dim)
                .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 0.01)
                .collect();
            let w: Vec<f32> = (0..dim).map(|i| 0.5 + (i % 7) as f32 * 0.25).collect();
            let y = rms_norm(&x, &w, 1e-6);
            for (r, (xr, yr)) in x.chunks(dim).zip(y.chunks(dim)).enumerate() {
                let ms = xr.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / dim as f64;
                let inv = 1.0 / (ms + 1e-6).sqrt();
                for (c, ((&xv, &yv), &g)) in xr.iter().zip(yr).zip(&w).enumerate() {
                    let want = xv as f64 * inv * g as f64;
                    assert!(
                        (yv as f64 - want).abs() <= 1e-6 * want.abs() + 1e-12,
                        "dim {dim} row {r} col {c}: {yv} vs {want}"
                    );
                }
            }
        }
    }
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
