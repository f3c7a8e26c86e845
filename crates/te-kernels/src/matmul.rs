//! `y = x · Wᵀ` on the CPU: one blocked kernel for every number of rows,
//! over f32 weights and GGUF block-quantized weights.
//!
//! Shapes: `x: [t, k]` f32 row-major (t token rows), `W: [n, k]` (n weight
//! rows, f32 or GGUF blocks with `k` a multiple of the block length),
//! `y: [t, n]` f32 row-major.
//!
//! # The arithmetic (the contract every path keeps, bit for bit)
//!
//! Weights take exactly the values of [`crate::quant::dequantize_blocks`]
//! (a full dequantization). Each output `y[i, j]` is computed on its own,
//! in sixteen lanes: lane `l` starts at `+0.0` and accumulates
//! `x[i, c] · w[j, c]` for `c ≡ l (mod 16)`, `c` increasing, one fused
//! multiply-add per step (`a = fma(x, w, a)`); in the last group of 16
//! the columns past `k` count as `fma(0, 0, a)`. The lanes are then summed
//! as a fixed tree: `s8[l] = a[l] + a[l + 8]`, `s4[l] = s8[l] + s8[l + 4]`,
//! `s2[l] = s4[l] + s4[l + 2]`, `y = s2[0] + s2[1]`.
//!
//! The AVX-512, AVX2 + FMA and portable paths all compute exactly this, so
//! a row's output is bit-identical whatever `t` is, wherever the row sits
//! in the batch, and whichever path runs (decode, batched decode and
//! prefill agree). Worked example: `k = 40` gives lanes 0..8 three
//! products each (columns l, l + 16, l + 32), lanes 8..16 two products and
//! one `fma(0, 0, a)`.
//!
//! # Blocking
//!
//! The weight rows are split over the rayon pool (a task owns a range of
//! output columns and writes them in place). With AVX-512 and at most 8
//! token rows, quantized weights are decoded in registers 32 at a time,
//! 2 weight rows at once, and multiplied into a 2 weight rows x t token
//! rows tile (decode). Otherwise each task decodes panels of 256 KiB of f32
//! weights (at least 32 rows for long rows, unless `x` fits in 5/8 of the
//! L2; 4 rows, one tile, for at most 16 token rows; f32 weights are read
//! in place) and runs every register
//! tile of `x` against the panel, so each weight block is decoded once per
//! step whatever `t` is (panel rows start on cache lines, and are one line
//! further apart when `k` is a multiple of 1024, so that the tile's rows
//! do not share L1 sets; with AVX-512 the bytes of the task's next panel
//! are prefetched while the last block of token rows is multiplied):
//! AVX-512 tiles of 4 x 6 (24 of its 32 registers), walking `k` in
//! equal blocks of at most 1024 columns with the accumulators saved
//! between blocks (exact); AVX2 tiles of 4 x 3, one 8-lane half of the 16 lanes
//! at a time. With AVX2 and at most 2 token rows, quantized weights are
//! decoded in registers too (32 at a time, 4 weight rows per tile, each
//! 16-lane accumulator as two 8-lane halves; AVX-512 decodes block by
//! block, through a table of the block's values for Q4_0, Q4_1 and Q5_0,
//! converting each quant for the others; Q4_1's scales are converted 16
//! blocks at a time). The register-decoded kernels prefetch the weight rows of the
//! tiles ahead (AVX-512: 4 tiles ahead, into L2; AVX2: the next tile): a
//! model's weights are read from the file map in 4 KiB pages, where the
//! hardware prefetcher alone leaves the short rows (Gemma 3's 640
//! columns) waiting on memory.
//! The rows of `x` are read from cache-line boundaries: an `x` that does
//! not start on one (with `k` a multiple of 16) is copied first.
//! Scratch (the copy, panels, saved accumulators) comes from the caller's
//! reused buffer.
//!
//! A product in [`Precision::Int8`] (Q4_K or Q6_K weights, `k` a multiple
//! of 256) has its own arithmetic, [`crate::int8`]'s: `x` is rounded to 8
//! bits once per call for all such products, and each task multiplies
//! tiles of 4 weight rows with every token row: decoded in registers once
//! for up to 31 token rows (decode and speculative verification's
//! chunks), unpacked once into the task's panel for more
//! (prefill), the rows in passes of at most 512 KiB of rounded
//! activations.

use rayon::prelude::*;

use crate::int8::{self, Q8Block};
use crate::lanes::reduce16;
use crate::quant::{dequantize_blocks, GgmlType};

/// How a product multiplies its activations with quantized weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// The module's arithmetic: f32 activations times each weight's exact
    /// f32 value.
    #[default]
    Exact,
    /// Q4_K and Q6_K weights (rows of a multiple of 256 columns) multiply
    /// activations rounded to 8 bits, with integer dot products (the
    /// arithmetic of [`crate::int8`]); other weights stay exact. Faster
    /// where decoding bounds the product (decode on a CPU whose 512-bit
    /// multiply-adds are two 256-bit halves); the logits move by the
    /// activations' rounding. Still bit-identical in any batch.
    Int8,
}

/// The buffers a product reuses between calls: its decoded weight panels,
/// accumulators and aligned copy of `x` (f32), and `x` rounded to 8 bits
/// ([`Precision::Int8`]). Only grows; a decode step allocates nothing once
/// it has grown.
#[derive(Default)]
pub struct Scratch {
    f32s: Vec<f32>,
    q8: Vec<Q8Block>,
}

/// A weight matrix `[n, k]` as the kernel reads it.
#[derive(Clone, Copy, Debug)]
pub enum Weights<'a> {
    /// f32, row-major.
    F32(&'a [f32]),
    /// GGUF blocks of `ty`, `k / block_len` blocks per row.
    Quantized { ty: GgmlType, data: &'a [u8] },
}

/// The instruction set a product runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    /// AVX-512F with AVX2, F16C and FMA (16-lane registers, masked tail
    /// loads; quantized weights decoded in registers for few token rows).
    Avx512,
    /// AVX2 + FMA (the 16 lanes as two 8-lane halves).
    Avx2,
    /// Plain Rust with `f32::mul_add` (any CPU; slow without hardware FMA).
    Portable,
}

impl Isa {
    /// The fastest path this CPU runs, detected once.
    pub(crate) fn detect() -> Isa {
        static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *ISA.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("f16c")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    return Isa::Avx512;
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    return Isa::Avx2;
                }
            }
            Isa::Portable
        })
    }

    /// Every path this CPU can run (for tests).
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                v.push(Isa::Avx2);
            }
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("f16c")
                && std::arch::is_x86_feature_detected!("fma")
            {
                v.push(Isa::Avx512);
            }
        }
        v
    }
}

/// Bytes of decoded f32 weights per panel (about a quarter of a 1 MiB L2).
const PANEL_BYTES: usize = 256 * 1024;

/// Floats per 64-byte cache line. The kernels' 16-float loads of `x` rows
/// and of decoded panels start on a line: a load that straddles two lines
/// costs two, and the AVX-512 tile ran at 138 against 175 GFLOP/s on one
/// core with its rows 12 bytes off the line (L1-resident, same minutes).
const LINE: usize = 16;

/// Whether every row of `x: [t, k]` starts on a cache line, or cannot be
/// made to (`k` not a multiple of [`LINE`]), so that a copy would not help.
fn x_aligned(x: &[f32], k: usize) -> bool {
    (x.as_ptr() as usize).is_multiple_of(4 * LINE) || !k.is_multiple_of(LINE)
}

/// Weight rows of the register tile.
const MR: usize = 4;

// The int8 tiles take the same weight rows ([`QuantRows::tile`]).
const _: () = assert!(int8::MR == MR);

/// The fewest weight rows a decoded panel holds when `x` does not stay
/// in L2 ([`panel_rows`]). Each panel reads all of `x` once, so rows of
/// Qwen2.5-Coder 1.5B's down projection (`k` = 8960: 7 rows in
/// [`PANEL_BYTES`], rounded down to 4) streamed its 128 token rows (4.6
/// MB, past L2) from memory for every 4 weight rows: 130 GFLOP/s at `t` =
/// 128 against 200-213 with 32-row panels (1.1 MiB, within this
/// processor's 2 MiB L2), same minutes.
const MIN_PROWS: usize = 32;

/// Up to this many token rows, a panel is one register tile of weight
/// rows ([`MR`]; 24 KiB at `k` = 1536, in L1 while the tile reads it):
/// with few rows each weight is used a few times only, and the tile then
/// waits on L2 for the panel it has just decoded. Qwen2.5-Coder 1.5B's
/// gate and up projections at 8 rows (a verification of 7 drafted
/// tokens, before [`FUSED_MAX_ROWS`] took those rows): 2.75-2.82 ms
/// against 3.12-3.25 with 40-row panels; from 32 rows on, the same within
/// noise.
const FEW_ROWS: usize = 16;

/// The share of L2 (numerator, denominator) that `x: [t, k]` may fill
/// for panels of [`PANEL_BYTES`] alone to be used, however few rows that
/// is ([`panel_rows`]). Measured on a 2 MiB L2 (an Emerald Rapids Xeon,
/// 2 threads, the two panel sizes alternating in one process): Qwen2.5-
/// Coder 1.5B's down projection (`k` = 8960, 4-row panels against 32-row
/// ones) 10-16% faster at 17-32 token rows (`x` 0.6-1.15 MB), the same
/// at 40 (1.43 MB), 2-10% slower at 48 (1.72 MB).
const X_IN_L2: (usize, usize) = (5, 8);

/// Bytes of the L2 cache of the CPU the products run on (Linux: cpu0's
/// unified level-2 cache in sysfs), read once; `None` where unknown.
fn l2_bytes() -> Option<usize> {
    static L2: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *L2.get_or_init(|| {
        let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
        dir.flatten().find_map(|index| {
            let read = |f: &str| std::fs::read_to_string(index.path().join(f)).ok();
            if read("level")?.trim() != "2" || read("type")?.trim() != "Unified" {
                return None;
            }
            let kib: usize = read("size")?.trim().strip_suffix('K')?.parse().ok()?;
            Some(kib * 1024)
        })
    })
}

/// Parallel tasks per pool thread (balance on a machine shared with
/// other work).
const TASKS_PER_THREAD: usize = 4;

/// Panel rows for row length `k`, `t` token rows and an L2 of `l2` bytes
/// ([`l2_bytes`]): [`MR`] for at most [`FEW_ROWS`] token rows; else a
/// multiple of [`MR`] in [`PANEL_BYTES`] (at least [`MR`]), raised to
/// [`MIN_PROWS`] unless `x` fits in [`X_IN_L2`] of the L2 (then `x`
/// stays there while every panel reads it, and larger panels only crowd
/// it out).
fn panel_rows(k: usize, t: usize, l2: Option<usize>) -> usize {
    if t <= FEW_ROWS {
        return MR;
    }
    let rows = (PANEL_BYTES / (4 * k.max(1)) / MR * MR).max(MR);
    let (num, den) = X_IN_L2;
    if l2.is_some_and(|l2| 4 * t * k <= l2 / den * num) {
        rows
    } else {
        rows.max(MIN_PROWS)
    }
}

/// Row stride (floats) of a decoded panel of rows of `k` weights: `k`
/// rounded up to whole cache lines ([`LINE`]), plus one line when rows
/// would be a multiple of 4 KiB apart
/// (`k` a multiple of 1024). The register tile walks 4 weight rows and up
/// to 6 rows of `x` at once; with such strides every row's column `c`
/// falls in the same sets of a 32 KiB, 8-way L1 (4 KiB a way), and the ten
/// streams evict each other: a copy of the tile at Gemma 3's down
/// projection (`k` = 2048, one thread, panel in L2) ran 80-87 GFLOP/s
/// against 100-114 with the panel's rows 64 bytes further apart (same
/// minutes; the FMA peak 113-117). The padding is never read.
fn panel_stride(k: usize) -> usize {
    let line = k.next_multiple_of(LINE);
    if k.is_multiple_of(1024) {
        line + LINE
    } else {
        line
    }
}

/// The output `y: [t, n]` shared by the parallel tasks; each task writes
/// only the columns of its own weight rows, so writes never overlap.
#[derive(Clone, Copy)]
struct Out {
    ptr: *mut f32,
    /// Row stride (n).
    n: usize,
}

// SAFETY: tasks write disjoint columns (see `Out::set`), and the slice
// outlives the parallel loop that uses the pointer.
unsafe impl Send for Out {}
// SAFETY: as above.
unsafe impl Sync for Out {}

impl Out {
    /// `(pointer to y[i, j], row stride n)`, for a kernel that stores a
    /// tile of outputs itself (`i < t`, `j < n`; the same rules as
    /// [`Out::set`] for what it may write).
    #[cfg(target_arch = "x86_64")]
    fn at(self, i: usize, j: usize) -> (*mut f32, usize) {
        (self.ptr.wrapping_add(i * self.n + j), self.n)
    }

    /// `y[i, j] = v`.
    ///
    /// # Safety
    /// `i < t` and `j < n` of the `[t, n]` output, and no other task
    /// writes column `j` during the product.
    #[inline(always)]
    unsafe fn set(self, i: usize, j: usize, v: f32) {
        // SAFETY: in bounds and unshared, as the caller guarantees.
        unsafe { *self.ptr.add(i * self.n + j) = v }
    }
}

/// The token rows every task of a product multiplies: `x: [t, k]` f32,
/// row-major.
#[derive(Clone, Copy)]
struct Input<'a> {
    /// `[t, k]` f32 activations.
    x: &'a [f32],
    /// Token rows.
    t: usize,
    /// Columns per row (the weights' row length).
    k: usize,
    /// `x` rounded to 8 bits, `k / 256` blocks per row, when a product of
    /// the call is [`Precision::Int8`] (else empty).
    q8: &'a [Q8Block],
}

/// A task's weight rows in GGUF blocks, as the register-decoded kernels
/// read them: `rows` rows of `k` weights of `ty`, `row_bytes` bytes each,
/// back to back in `data` (`[rows * row_bytes]` bytes).
#[derive(Clone, Copy)]
struct QuantRows<'a> {
    ty: GgmlType,
    data: &'a [u8],
    row_bytes: usize,
    rows: usize,
}

impl<'a> QuantRows<'a> {
    /// The `M` weight rows of the tile starting at row `m0`, and how
    /// many of them are real: rows past the edge repeat the first one
    /// (computed, never stored).
    fn tile<const M: usize>(&self, m0: usize) -> (usize, [&'a [u8]; M]) {
        let mr = M.min(self.rows - m0);
        let (data, row_bytes) = (self.data, self.row_bytes);
        let rows = std::array::from_fn(|m| {
            let j = m0 + if m < mr { m } else { 0 };
            &data[j * row_bytes..(j + 1) * row_bytes]
        });
        (mr, rows)
    }
}

/// The f32 weight rows of one panel: `rows` rows of `k` floats in `w`,
/// `ldw` floats apart (`ldw >= k`; decoded weights padded to
/// [`panel_stride`], or f32 weights read in place with `ldw = k`).
#[derive(Clone, Copy)]
struct Panel<'a> {
    w: &'a [f32],
    ldw: usize,
    rows: usize,
}

/// Where a task writes: columns `j0 ..` of the product's output `y`, one
/// per weight row it owns (no other task writes them).
#[derive(Clone, Copy)]
struct Cols {
    y: Out,
    j0: usize,
}

/// One parallel task of a product: weight rows `j0 .. j0 + rows` of `w`,
/// written to the same columns of `out`, with the layout of its scratch
/// panel.
#[derive(Clone, Copy)]
struct Task<'a> {
    w: Weights<'a>,
    out: Out,
    j0: usize,
    rows: usize,
    /// Weight rows per decoded panel (a multiple of [`MR`]).
    prows: usize,
    /// Floats of k-blocked accumulator state at the end of the scratch
    /// panel (0 when `k` is one block).
    state_len: usize,
    /// The weights multiply `x` rounded to 8 bits ([`Precision::Int8`],
    /// a type of [`int8::supported`]).
    int8: bool,
}

/// Up to this many token rows, quantized weights are decoded in
/// registers instead of into a panel (AVX-512). Past that, 4-row panels
/// were as fast or faster (Q4_K `[8960, 1536]`, 2 threads: registers
/// 0.108 against the panels' 0.106 ns a weight at 10 token rows, 0.134
/// against 0.122 at 12): the compiler keeps later groups' decoded values
/// live and spills the accumulators to the stack, with intrinsics or with
/// the multiply-adds written in assembly.
#[cfg(target_arch = "x86_64")]
const FUSED_MAX_ROWS: usize = 8;

/// Weight rows of the register-decoded tile (AVX-512): each group of 32
/// weights of both rows is decoded once and multiplied with every token
/// row, so `x` is loaded once per group for both. Against the earlier
/// tiles of 4 weight rows up to 6 token rows (each row's group decoded
/// and multiplied in turn, `x` loaded for each; 4-row panels for 7 and
/// 8), the `[8960, 1536]` products of Qwen2.5-Coder 1.5B's shape, 2
/// threads, both in one process, best of 45 (Emerald Rapids Xeon): Q4_K
/// 8-21% faster at 1 to 8 token rows (0.052 -> 0.048 ns a weight at 1,
/// 0.088 -> 0.075 at 4); Q6_K 0-10%; Q4_0, Q4_1 and Q8_0 the same at 1
/// to 4 rows, 35-54% faster at 6 (the 4 x 6 tile spilled its
/// accumulators) and 8-25% at 7 and 8; Q5_0 the same to 6 rows, 16-24%
/// faster at 7 and 8. Bit-identical outputs.
#[cfg(target_arch = "x86_64")]
const FUSED_MR: usize = 2;

/// Whether `ty` has an AVX-512 group decoder for the fused kernels.
#[cfg(target_arch = "x86_64")]
fn fused_type(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(ty, Q4_0 | Q4_1 | Q5_0 | Q8_0 | Q4_K | Q6_K)
}

/// `y[i, j0 + j] = x_i · w_j` for the `w.rows` weight rows of GGUF blocks
/// and every row of `x: [t, k]` (`t <=` [`FUSED_MAX_ROWS`]), decoded in
/// registers, [`FUSED_MR`] weight rows at a time. Needs AVX-512 and a type
/// of [`fused_type`]; the task must own columns `j0 .. j0 + w.rows` of `y`.
#[cfg(target_arch = "x86_64")]
fn fused_product(input: Input<'_>, w: QuantRows<'_>, Cols { y, j0 }: Cols) {
    let Input { x, t, k, .. } = input;
    let QuantRows { ty, rows, .. } = w;
    debug_assert!(t <= FUSED_MAX_ROWS && x.len() == t * k);
    for m0 in (0..rows).step_by(FUSED_MR) {
        let (mr, wr) = w.tile::<FUSED_MR>(m0);
        let mut out = [[0.0f32; FUSED_MAX_ROWS]; FUSED_MR];
        macro_rules! go {
            ($nr:literal) => {{
                let xp: [*const f32; $nr] = std::array::from_fn(|r| x[r * k..].as_ptr());
                // SAFETY: the caller checked AVX-512 (Isa::Avx512, whose
                // detection includes AVX2, F16C and FMA via avx512f) and
                // `ty`; each x pointer starts a row of k floats, each w row
                // holds k weights of `ty`.
                let o = unsafe {
                    match ty {
                        GgmlType::Q4_0 => avx512::fused_q4_0::<$nr>(&xp, &wr, k),
                        GgmlType::Q4_1 => avx512::fused_q4_1::<$nr>(&xp, &wr, k),
                        GgmlType::Q5_0 => avx512::fused_q5_0::<$nr>(&xp, &wr, k),
                        GgmlType::Q8_0 => avx512::fused_q8_0::<$nr>(&xp, &wr, k),
                        GgmlType::Q4_K => avx512::fused_q4_k::<$nr>(&xp, &wr, k),
                        GgmlType::Q6_K => avx512::fused_q6_k::<$nr>(&xp, &wr, k),
                        _ => unreachable!("fused_type"),
                    }
                };
                for m in 0..FUSED_MR {
                    out[m][..$nr].copy_from_slice(&o[m]);
                }
            }};
        }
        match t {
            1 => go!(1),
            2 => go!(2),
            3 => go!(3),
            4 => go!(4),
            5 => go!(5),
            6 => go!(6),
            7 => go!(7),
            8 => go!(8),
            _ => unreachable!("at most FUSED_MAX_ROWS token rows"),
        }
        for (m, o) in out.iter().enumerate().take(mr) {
            for (i, &v) in o[..t].iter().enumerate() {
                // SAFETY: i < t; column j0 + m0 + m is this task's.
                unsafe { y.set(i, j0 + m0 + m, v) };
            }
        }
    }
}

/// `y[i, j0 + j] = x_i · w_j` with 8-bit activations (`input.q8`, the
/// arithmetic of [`crate::int8`]) for the `w.rows` weight rows of a type of
/// [`int8::supported`] and every token row, 4 weight rows at a time; on
/// the AVX-512 BW + VNNI kernels with [`Isa::Avx512`] when the CPU has
/// them, else on the AVX2 ones with [`Isa::Avx512`] or [`Isa::Avx2`]
/// when it has AVX2, FMA and F16C, else portable (the same bits). The
/// task must own columns `j0 .. j0 + w.rows` of `y`; `panel` is its
/// scratch panel (the unpacked weight tile).
fn int8_product(
    isa: Isa,
    input: Input<'_>,
    w: QuantRows<'_>,
    Cols { y, j0 }: Cols,
    panel: &mut [f32],
) {
    let Input { t, k, q8, .. } = input;
    let QuantRows { ty, rows, .. } = w;
    debug_assert_eq!(q8.len(), t * k / int8::QK);
    #[cfg(target_arch = "x86_64")]
    let kernels = match isa {
        Isa::Avx512 if int8::simd() => int8::Kernels::Avx512,
        Isa::Avx512 | Isa::Avx2 if int8::avx2() => int8::Kernels::Avx2,
        _ => int8::Kernels::Portable,
    };
    #[cfg(not(target_arch = "x86_64"))]
    let kernels = int8::Kernels::Portable;
    let _ = isa;
    // The unpacked weight tile lives in the task's panel (a panel of
    // decoded f32 weights holds at least 4 rows of k floats: more bytes).
    let kb = k / int8::QK;
    let buf = &mut bytemuck::cast_slice_mut::<f32, u8>(panel)[..int8::unpacked_bytes(kb)];
    // Token rows in passes of at most ~512 KiB of rounded activations, so
    // that the rows every weight tile reads stay in L2 (Qwen2.5-Coder
    // 1.5B's down projection at 128 rows holds 1.4 MB of them).
    let pass = (INT8_PASS_BYTES / (kb * std::mem::size_of::<Q8Block>())).max(1);
    for r0 in (0..t).step_by(pass) {
        let x = &q8[r0 * kb..(r0 + pass).min(t) * kb];
        for m0 in (0..rows).step_by(MR) {
            let (mr, wr) = w.tile::<MR>(m0);
            int8::tile(ty, wr, x, kb, kernels, buf, |i, v| {
                for (m, &v) in v.iter().enumerate().take(mr) {
                    // SAFETY: r0 + i < t; column j0 + m0 + m is this task's.
                    unsafe { y.set(r0 + i, j0 + m0 + m, v) };
                }
            });
        }
    }
}

/// Bytes of 8-bit activations one pass of [`int8_product`] multiplies
/// with every weight tile (half of a 1 MiB L2; all of Zen 1's 512 KiB,
/// not tuned there).
const INT8_PASS_BYTES: usize = 512 * 1024;

/// Up to this many token rows, AVX2 decodes quantized weights in
/// registers (4 weight rows x 2 token rows x two 8-lane halves fill its
/// 16 registers with accumulators).
#[cfg(target_arch = "x86_64")]
const FUSED_MAX_ROWS_AVX2: usize = 2;

/// [`fused_product`] with AVX2 + FMA: the weights decoded in registers by
/// `crate::quant::avx2` (a type it has a decoder for, and F16C), `t <=`
/// [`FUSED_MAX_ROWS_AVX2`]; the task must own columns `j0 .. j0 + w.rows`.
#[cfg(target_arch = "x86_64")]
fn fused_product_avx2(input: Input<'_>, w: QuantRows<'_>, Cols { y, j0 }: Cols) {
    let Input { x, t, k, .. } = input;
    let QuantRows { ty, rows, .. } = w;
    debug_assert!(t <= FUSED_MAX_ROWS_AVX2 && x.len() == t * k);
    let (block_len, block_bytes) = ty.block_layout().expect("a block type");
    for m0 in (0..rows).step_by(MR) {
        let (mr, wr) = w.tile::<MR>(m0);
        let mut out = [[0.0f32; FUSED_MAX_ROWS_AVX2]; MR];
        macro_rules! go {
            ($nr:literal) => {{
                let xp: [*const f32; $nr] = std::array::from_fn(|r| x[r * k..].as_ptr());
                // SAFETY: the caller checked AVX2 + FMA (Isa::Avx2) and
                // that `ty` has an AVX2 decoder (which checks F16C and
                // FMA); each x
                // pointer starts a row of k floats, each w row holds k
                // weights of `ty` in blocks of `block_len` / `block_bytes`.
                let o = unsafe { avx2::fused::<$nr>(ty, &xp, &wr, k, block_len, block_bytes) };
                for m in 0..MR {
                    out[m][..$nr].copy_from_slice(&o[m]);
                }
            }};
        }
        match t {
            1 => go!(1),
            2 => go!(2),
            _ => unreachable!("at most FUSED_MAX_ROWS_AVX2 token rows"),
        }
        for (m, o) in out.iter().enumerate().take(mr) {
            for (i, &v) in o[..t].iter().enumerate() {
                // SAFETY: i < t; column j0 + m0 + m is this task's.
                unsafe { y.set(i, j0 + m0 + m, v) };
            }
        }
    }
}

/// `y = x · wᵀ` (see the module doc for the exact arithmetic): `x: [t, k]`,
/// `w: [n, k]`, `y: [t, n]`. `scratch` is grown as needed and reused: per
/// task, a decoded panel (quantized weights) and the k-blocked kernel's
/// accumulators.
pub fn matmul_into(
    x: &[f32],
    t: usize,
    w: Weights<'_>,
    n: usize,
    k: usize,
    y: &mut [f32],
    scratch: &mut Scratch,
) {
    let product = Product {
        w,
        n,
        y,
        precision: Precision::Exact,
    };
    matmul_many_into_isa(Isa::detect(), x, t, k, [product], scratch)
}

/// One of the products [`matmul_many_into`] runs on a shared `x: [t, k]`:
/// `y: [t, n] = x · wᵀ`, `w: [n, k]`.
pub struct Product<'a, 'y> {
    pub w: Weights<'a>,
    pub n: usize,
    pub y: &'y mut [f32],
    pub precision: Precision,
}

/// [`matmul_into`] for several weight matrices applied to the same `x`
/// (a layer's Q, K and V, or its gate and up projections) in one parallel
/// launch: the tasks cover the rows of every matrix, so the pool's
/// threads are handed work once instead of `N` times (in decode a launch
/// takes about as long as handing it over). Each output is computed
/// exactly as [`matmul_into`] computes it.
pub fn matmul_many_into<const N: usize>(
    x: &[f32],
    t: usize,
    k: usize,
    products: [Product<'_, '_>; N],
    scratch: &mut Scratch,
) {
    matmul_many_into_isa(Isa::detect(), x, t, k, products, scratch)
}

/// [`matmul_many_into`] on the given instruction set (which the CPU must
/// run).
pub(crate) fn matmul_many_into_isa<const N: usize>(
    isa: Isa,
    x: &[f32],
    t: usize,
    k: usize,
    products: [Product<'_, '_>; N],
    scratch: &mut Scratch,
) {
    assert_eq!(x.len(), t * k, "matmul: x is not [t, k]");
    for p in &products {
        assert_eq!(p.y.len(), t * p.n, "matmul: y is not [t, n]");
        if let Weights::F32(w) = p.w {
            assert_eq!(w.len(), p.n * k, "matmul: w is not [n, k]");
        }
    }
    let total: usize = products.iter().map(|p| p.n).sum();
    if t == 0 || total == 0 {
        return;
    }
    if k == 0 {
        // Empty rows: every output is the lane tree of sixteen +0.0 lanes.
        for p in products {
            p.y.fill(0.0);
        }
        return;
    }
    let threads = rayon::current_num_threads().max(1);
    let rows_per_task = total.div_ceil(threads * TASKS_PER_THREAD).div_ceil(MR) * MR;
    // Product i's tasks are first_task[i] .. first_task[i + 1].
    let mut first_task = [0usize; N];
    let mut tasks = 0;
    for (first, p) in first_task.iter_mut().zip(&products) {
        *first = tasks;
        tasks += p.n.div_ceil(rows_per_task);
    }
    let prows = panel_rows(k, t, l2_bytes()).min(rows_per_task);
    // Per task: the decoded panel (quantized weights; f32 weights are read
    // in place), then the k-blocked kernel's accumulator state.
    // (Empty when k is one block: the kernel then keeps its accumulators
    // in registers from start to end.)
    let state_len = if k > k_block(k) {
        STATE_ROWS * prows.div_ceil(MR) * MR * 16
    } else {
        0
    };
    let quantized = products
        .iter()
        .any(|p| matches!(p.w, Weights::Quantized { .. }));
    // (At least one line, so every task gets its chunk below; whole lines,
    // so every panel and state starts 64-byte aligned.)
    let panel_len = if quantized {
        prows * panel_stride(k) + state_len
    } else {
        state_len
    }
    .max(1)
    .next_multiple_of(LINE);
    let x_len = if x_aligned(x, k) { 0 } else { t * k };
    // Int8 products read x rounded to 8 bits, once for all of them.
    let int8_of = |p: &Product<'_, '_>| {
        p.precision == Precision::Int8
            && matches!(p.w, Weights::Quantized { ty, .. } if int8::supported(ty, k))
    };
    let q8: &[Q8Block] = if products.iter().any(int8_of) {
        int8::quantize_rows(x, k, &mut scratch.q8);
        &scratch.q8[..t * k / int8::QK]
    } else {
        &[]
    };
    let scratch = &mut scratch.f32s;
    // scratch: [alignment slack][x copy: x_len][panels: tasks * panel_len]
    let need = x_len + tasks * panel_len;
    if scratch.len() < need + LINE - 1 {
        scratch.resize(need + LINE - 1, 0.0);
    }
    let skip = scratch.as_ptr().align_offset(4 * LINE);
    let (x_copy, panels) = scratch[skip..skip + need].split_at_mut(x_len);
    let x = if x_len == 0 {
        x
    } else {
        x_copy.copy_from_slice(x);
        &*x_copy
    };
    // The outputs are written only through these pointers from here on.
    let ws = products.map(|p| {
        let int8 = int8_of(&p);
        let out = Out {
            ptr: p.y.as_mut_ptr(),
            n: p.n,
        };
        (p.w, out, int8)
    });
    panels
        .par_chunks_mut(panel_len)
        .enumerate()
        .for_each(|(ti, panel)| {
            let i = first_task.iter().rposition(|&f| f <= ti).unwrap_or(0);
            let (w, out, int8) = ws[i];
            // This task's weight rows, i.e. columns j0 .. j0 + rows of y.
            let j0 = (ti - first_task[i]) * rows_per_task;
            let task = Task {
                w,
                out,
                j0,
                rows: rows_per_task.min(out.n - j0),
                prows,
                state_len,
                int8,
            };
            product_task(isa, Input { x, t, k, q8 }, task, panel);
        });
}

/// Rows `j0 .. j0 + rows` of one product (columns of its `y: [t, out.n]`),
/// with the task's scratch `panel` (`prows * panel_stride(k)` decoded weights when
/// quantized, then `state_len` accumulators).
fn product_task(isa: Isa, input: Input<'_>, task: Task<'_>, panel: &mut [f32]) {
    let Input { t, k, .. } = input;
    let Task {
        w,
        out,
        j0,
        rows,
        prows,
        state_len,
        int8,
    } = task;
    let row_bytes = match w {
        Weights::F32(_) => 0,
        Weights::Quantized { data, .. } => data.len() / out.n,
    };
    if let (true, Weights::Quantized { ty, data }) = (int8, w) {
        let w = QuantRows {
            ty,
            data: &data[j0 * row_bytes..(j0 + rows) * row_bytes],
            row_bytes,
            rows,
        };
        int8_product(isa, input, w, Cols { y: out, j0 }, panel);
        return;
    }
    // Few token rows: decode in registers (AVX-512 group decoders).
    #[cfg(target_arch = "x86_64")]
    if let Weights::Quantized { ty, data } = w {
        let cols = Cols { y: out, j0 };
        let w = QuantRows {
            ty,
            data: &data[j0 * row_bytes..(j0 + rows) * row_bytes],
            row_bytes,
            rows,
        };
        if isa == Isa::Avx512 && t <= FUSED_MAX_ROWS && fused_type(ty) {
            fused_product(input, w, cols);
            return;
        }
        if isa == Isa::Avx2 && t <= FUSED_MAX_ROWS_AVX2 && crate::quant::avx2::available(ty) {
            fused_product_avx2(input, w, cols);
            return;
        }
    }
    for p0 in (0..rows).step_by(prows) {
        let pr = prows.min(rows - p0);
        let (r0, r1) = (j0 + p0, j0 + p0 + pr);
        let (decoded, state) = panel.split_at_mut(panel.len() - state_len);
        // The panel's rows and their stride; for quantized weights, the
        // bytes of this task's next panel (fetched while this one runs).
        let (wp, ldw, next): (&[f32], usize, &[u8]) = match w {
            Weights::F32(w) => (&w[r0 * k..r1 * k], k, &[]),
            Weights::Quantized { ty, data } => {
                let ld = panel_stride(k);
                for (r, row) in data[r0 * row_bytes..r1 * row_bytes]
                    .chunks_exact(row_bytes)
                    .enumerate()
                {
                    dequantize_blocks(ty, row, &mut decoded[r * ld..r * ld + k]);
                }
                let next_end = (r1 + prows).min(j0 + rows);
                (
                    &decoded[..pr * ld],
                    ld,
                    &data[r1 * row_bytes..next_end * row_bytes],
                )
            }
        };
        let panel = Panel {
            w: wp,
            ldw,
            rows: pr,
        };
        let cols = Cols { y: out, j0: r0 };
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx512 {
            panel_product_avx512(input, panel, state, cols, next);
            continue;
        }
        // (Only the AVX-512 kernel prefetches; elsewhere `next` is unused.)
        let _ = next;
        panel_product(isa, input, panel, cols);
    }
}

/// Most columns per k-block of the AVX-512 panel kernel ([`k_block`]): a
/// 6-row tile of `x` (24 KiB at most) and a 4-row tile of the panel
/// (16 KiB) then fit in L1 together while the kernel walks them. With
/// blocks of 2048 (four, then 768), Qwen2.5-Coder 1.5B's down projection
/// (`k` = 8960) ran 251 GFLOP/s at 128 token rows, 281 with six of 1504
/// (the tiles of 2048 columns filled L1 alone); its `k` = 1536 products
/// and Gemma 3's pp512 are the same within noise either way, and 512
/// (saving and reloading the accumulators four times as often) is slower.
const KC: usize = 1024;

/// The k-block width for rows of `k` columns: `k` in the fewest blocks
/// of at most [`KC`] (`k` itself when it is one), of equal widths
/// rounded up to 16 columns (8960: six of 1504 but the last, not eight
/// of 1024 and one of 768).
fn k_block(k: usize) -> usize {
    let blocks = k.div_ceil(KC);
    k.div_ceil(blocks).next_multiple_of(16)
}

/// Token rows per block of the AVX-512 panel kernel (a multiple of its 6
/// rows per tile); their accumulators live in the task's state buffer
/// between k-blocks.
const STATE_ROWS: usize = 48;

/// [`panel_product`] with AVX-512, blocked over `k` as well: for each block
/// of [`STATE_ROWS`] token rows, the columns are walked in blocks of
/// [`k_block`], each tile's 16-lane accumulators saved to `state` between
/// blocks and reloaded (exact), so every accumulator still sees its
/// columns in order and the arithmetic is the module's. `panel.w`:
/// `panel.rows` rows of `k` floats, `panel.ldw` apart; `state`: at least
/// `STATE_ROWS * rows.div_ceil(MR) * MR * 16` floats when `k > KC` (unused
/// otherwise).
/// `next` (the quantized bytes of the task's next panel, or empty) is
/// prefetched into the caches a little after each tile, so that decoding
/// it does not wait on memory: at 32 token rows Gemma 3's output product
/// spent a fifth of its time decoding, most of it waiting for the
/// weights.
#[cfg(target_arch = "x86_64")]
fn panel_product_avx512(
    input: Input<'_>,
    panel: Panel<'_>,
    state: &mut [f32],
    Cols { y, j0 }: Cols,
    next: &[u8],
) {
    let Input { x, t, k, .. } = input;
    let Panel { w, ldw, rows } = panel;
    const NR: usize = 6;
    let tiles_m = rows.div_ceil(MR);
    assert!(
        k <= k_block(k) || state.len() >= STATE_ROWS * tiles_m * MR * 16,
        "panel_product_avx512: short state"
    );
    assert!(
        ldw >= k && (rows == 0 || w.len() >= (rows - 1) * ldw + k) && x.len() >= t * k,
        "panel_product_avx512: short input"
    );
    // The cache lines of `next` (from the line of its first byte), a few
    // after each tile of the last block of token rows (with many rows,
    // lines fetched earlier would leave L2 again while the other blocks'
    // rows of `x` stream through it).
    let skew = next.as_ptr() as usize % 64;
    let lines = if next.is_empty() {
        0
    } else {
        (skew + next.len()).div_ceil(64)
    };
    let first_line = next.as_ptr().wrapping_sub(skew);
    let last_block = (t - 1) / STATE_ROWS * STATE_ROWS;
    let kc = k_block(k);
    let tiles = (t - last_block).div_ceil(NR) * k.div_ceil(kc) * tiles_m;
    let per_tile = lines.div_ceil(tiles);
    let mut line = 0;
    for b0 in (0..t).step_by(STATE_ROWS) {
        let bt = STATE_ROWS.min(t - b0);
        for c0 in (0..k).step_by(kc) {
            let c1 = (c0 + kc).min(k);
            // The block's rows in as few tiles as fit, of even sizes
            // (32 rows: 5, 5, 6, 5, 5, 6, not five of 6 and one of 2).
            let tiles_i = bt.div_ceil(NR);
            for ti in 0..tiles_i {
                let i0 = b0 + ti * bt / tiles_i;
                let nr = b0 + (ti + 1) * bt / tiles_i - i0;
                for m0 in (0..rows).step_by(MR) {
                    let mr = MR.min(rows - m0);
                    // Tile rows past the edge repeat the first one
                    // (computed, never stored).
                    let wp: [*const f32; MR] = std::array::from_fn(|m| {
                        w[(m0 + if m < mr { m } else { 0 }) * ldw..].as_ptr()
                    });
                    let slot = (ti * tiles_m + m0 / MR) * MR * NR * 16;
                    // (One block: the kernel never touches its state.)
                    let st = if k > kc {
                        state[slot..slot + MR * NR * 16].as_mut_ptr()
                    } else {
                        std::ptr::null_mut()
                    };
                    // After the last block: y[i0 .., j0 + m0 ..], mr columns.
                    let last = (c1 == k).then(|| (y.at(i0, j0 + m0), mr));
                    macro_rules! go {
                        ($nr:literal) => {{
                            let xp: [*const f32; $nr] =
                                std::array::from_fn(|r| x[(i0 + r) * k..].as_ptr());
                            // SAFETY: the CPU has AVX-512F (Isa::Avx512);
                            // every x and w pointer starts k readable floats
                            // (asserted above); `st` has MR * NR * 16 floats
                            // (null only for one block: first and last);
                            // rows i0 .. i0 + nr < t and columns j0 + m0 ..
                            // j0 + m0 + mr of y are this task's.
                            unsafe { avx512::tile_block::<$nr>(&xp, &wp, c0..c1, k, st, last) }
                        }};
                    }
                    match nr {
                        1 => go!(1),
                        2 => go!(2),
                        3 => go!(3),
                        4 => go!(4),
                        5 => go!(5),
                        6 => go!(6),
                        _ => unreachable!("at most 6 token rows per tile"),
                    }
                    let fetch = if b0 == last_block { per_tile } else { 0 };
                    for _ in 0..fetch.min(lines - line) {
                        let at = first_line.wrapping_add(64 * line);
                        // SAFETY: a prefetch is a hint that never faults.
                        unsafe {
                            use std::arch::x86_64::*;
                            _mm_prefetch::<_MM_HINT_T1>(at.cast());
                        }
                        line += 1;
                    }
                }
            }
        }
    }
}

/// `y[i, j0 + j] = x_i · w_j` for the `rows` weight rows of one panel
/// (`w`, row stride `ldw`) and every row of `x: [t, k]`; the task must own
/// columns `j0 .. j0 + rows` of `y`.
fn panel_product(isa: Isa, input: Input<'_>, panel: Panel<'_>, Cols { y, j0 }: Cols) {
    let Input { x, t, k, .. } = input;
    let Panel { w, ldw, rows } = panel;
    let nr_max = match isa {
        Isa::Avx512 => unreachable!("AVX-512 panels run in panel_product_avx512"),
        Isa::Avx2 => 3,
        Isa::Portable => 4,
    };
    for i0 in (0..t).step_by(nr_max) {
        let nr = nr_max.min(t - i0);
        for m0 in (0..rows).step_by(MR) {
            let mr = MR.min(rows - m0);
            // Pointers to the tile's rows; rows past the edge repeat the
            // first one (computed, never stored).
            let xr: [usize; 6] = std::array::from_fn(|r| (i0 + if r < nr { r } else { 0 }) * k);
            let wr: [usize; MR] = std::array::from_fn(|m| (m0 + if m < mr { m } else { 0 }) * ldw);
            let mut out = [[0.0f32; 6]; MR];
            tile(isa, x, &xr[..nr], w, &wr, k, &mut out);
            for (m, o) in out.iter().enumerate().take(mr) {
                for (r, &v) in o[..nr].iter().enumerate() {
                    // SAFETY: i0 + r < t; column j0 + m0 + m is this task's.
                    unsafe { y.set(i0 + r, j0 + m0 + m, v) };
                }
            }
        }
    }
}

/// One register tile: `out[m][r] = x[xr[r]..][..k] · w[wr[m]..][..k]` for
/// `r < xr.len()` (at most 6), dispatched to the instruction set and to a
/// kernel specialized for the tile's number of token rows.
fn tile(
    isa: Isa,
    x: &[f32],
    xr: &[usize],
    w: &[f32],
    wr: &[usize; MR],
    k: usize,
    out: &mut [[f32; 6]; MR],
) {
    // Every offset is a whole row inside its slice.
    debug_assert!(xr.iter().all(|&o| o + k <= x.len()));
    debug_assert!(wr.iter().all(|&o| o + k <= w.len()));
    match isa {
        Isa::Avx512 => unreachable!("AVX-512 panels run in panel_product_avx512"),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            macro_rules! go {
                ($nr:literal) => {{
                    let xp: [*const f32; $nr] = std::array::from_fn(|r| x[xr[r]..].as_ptr());
                    let wp: [*const f32; MR] = std::array::from_fn(|m| w[wr[m]..].as_ptr());
                    // SAFETY: the CPU has AVX2 and FMA (Isa::detect /
                    // available); each pointer starts a row of k readable floats.
                    let o = unsafe { avx2::tile::<$nr>(&xp, &wp, k) };
                    for m in 0..MR {
                        out[m][..$nr].copy_from_slice(&o[m]);
                    }
                }};
            }
            match xr.len() {
                1 => go!(1),
                2 => go!(2),
                3 => go!(3),
                _ => unreachable!("at most 3 token rows per AVX2 tile"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 => unreachable!("x86_64 only"),
        Isa::Portable => {
            for (m, &wo) in wr.iter().enumerate() {
                for (r, &xo) in xr.iter().enumerate() {
                    out[m][r] = dot_portable(&x[xo..xo + k], &w[wo..wo + k]);
                }
            }
        }
    }
}

/// The module's arithmetic for one pair of rows, in plain Rust: the
/// reference every SIMD path equals bit for bit.
pub(crate) fn dot_portable(x: &[f32], w: &[f32]) -> f32 {
    let mut a = [0.0f32; 16];
    for c0 in (0..x.len()).step_by(16) {
        for (l, a) in a.iter_mut().enumerate() {
            let (xv, wv) = match (x.get(c0 + l), w.get(c0 + l)) {
                (Some(&xv), Some(&wv)) => (xv, wv),
                _ => (0.0, 0.0),
            };
            *a = xv.mul_add(wv, *a);
        }
    }
    reduce16(&a)
}

#[cfg(target_arch = "x86_64")]
// Index loops over the register tile read as the math does (acc[m][r]).
#[allow(clippy::needless_range_loop)]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{FUSED_MR, MR};

    /// How many weight rows ahead the register-decoded kernels prefetch
    /// weights, into L2 (`_MM_HINT_T1`). Measured on Gemma 3's 262144 x 640
    /// Q8_0 output product read from a file map (with tiles of 4 rows): 4
    /// rows ahead into L1 (T0) ~10 ms, 4 rows into L2 ~7.3 ms, 8-16 rows
    /// into L2 ~5.3 ms (prefetches into L1 queue behind its few miss
    /// buffers); the 4-bit types, bound by decoding, are unchanged.
    const PREFETCH_ROWS: usize = 16;

    /// Columns `cols = c0..c1` of a tile's products (`c0` a multiple of
    /// 16; the last group masked when `c1 == k` is not), continuing the
    /// 16-lane accumulators saved at `state[(m · NR + r) · 16 ..][..16]`
    /// (zeros for the first block, `c0 == 0`). Then, with `last =
    /// Some(((y, n), mr))`, the lane tree of each accumulator goes to
    /// `y[r · n + m]` for `m < mr` (the tile's rows past `mr` are
    /// dropped); otherwise the accumulators are saved back to `state`.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; every pointer must start `k`
    /// readable floats; `state` must hold `MR · NR · 16` floats (it is
    /// not accessed, and may be null, when `c0 == 0` and `last`); with
    /// `last`, `y[r · n .. r · n + mr]` must be writable for `r < NR`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tile_block<const NR: usize>(
        x: &[*const f32; NR],
        w: &[*const f32; MR],
        cols: std::ops::Range<usize>,
        k: usize,
        state: *mut f32,
        last: Option<((*mut f32, usize), usize)>,
    ) {
        let std::ops::Range { start: c0, end: c1 } = cols;
        let first = c0 == 0;
        let mut acc = [[_mm512_setzero_ps(); NR]; MR];
        if !first {
            for m in 0..MR {
                for r in 0..NR {
                    // SAFETY: inside the MR · NR · 16 floats of `state`.
                    acc[m][r] = unsafe { _mm512_loadu_ps(state.add((m * NR + r) * 16)) };
                }
            }
        }
        let full = if c1 == k {
            c0 + (c1 - c0) / 16 * 16
        } else {
            c1
        };
        let mut c = c0;
        while c < full {
            let mut xv = [_mm512_setzero_ps(); NR];
            for r in 0..NR {
                // SAFETY: c + 16 <= k for every row.
                xv[r] = unsafe { _mm512_loadu_ps(x[r].add(c)) };
            }
            for m in 0..MR {
                // SAFETY: as above.
                let wv = unsafe { _mm512_loadu_ps(w[m].add(c)) };
                for r in 0..NR {
                    acc[m][r] = _mm512_fmadd_ps(xv[r], wv, acc[m][r]);
                }
            }
            c += 16;
        }
        if c < c1 {
            let mask: __mmask16 = ((1u32 << (c1 - c)) - 1) as u16;
            let mut xv = [_mm512_setzero_ps(); NR];
            for r in 0..NR {
                // SAFETY: masked loads read only columns < k.
                xv[r] = unsafe { _mm512_maskz_loadu_ps(mask, x[r].add(c)) };
            }
            for m in 0..MR {
                // SAFETY: as above.
                let wv = unsafe { _mm512_maskz_loadu_ps(mask, w[m].add(c)) };
                for r in 0..NR {
                    acc[m][r] = _mm512_fmadd_ps(xv[r], wv, acc[m][r]);
                }
            }
        }
        if let Some(((y, n), mr)) = last {
            let mask: __mmask16 = (1u16 << mr) - 1;
            for r in 0..NR {
                let s = reduce4([acc[0][r], acc[1][r], acc[2][r], acc[3][r]]);
                // SAFETY: lanes m < mr of y[r · n ..], writable as the
                // caller guarantees (the masked lanes are not accessed).
                unsafe { _mm512_mask_storeu_ps(y.add(r * n), mask, s) };
            }
            return;
        }
        for m in 0..MR {
            for r in 0..NR {
                // SAFETY: inside the MR · NR · 16 floats of `state`.
                unsafe { _mm512_storeu_ps(state.add((m * NR + r) * 16), acc[m][r]) };
            }
        }
    }

    /// The lane tree of four accumulators at once: lane `m` of the result
    /// (`m < 4`) is [`reduce`]`(a[m])`, the same additions in the same
    /// order (lanes 4..16 are left over). 128-bit block `b` of a register
    /// is lanes `4b .. 4b + 4`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn reduce4(a: [__m512; 4]) -> __m512 {
        // s8 = lanes 0..8 + lanes 8..16, i.e. blocks (0, 1) + (2, 3):
        // [s8(a0), s8(a1)] and [s8(a2), s8(a3)].
        let s8_01 = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a[0], a[1]),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a[0], a[1]),
        );
        let s8_23 = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a[2], a[3]),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a[2], a[3]),
        );
        // s4 = s8 lanes 0..4 + lanes 4..8: block m is s4(a_m).
        let s4 = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(s8_01, s8_23),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(s8_01, s8_23),
        );
        // s2 = s4 lanes 0..2 + lanes 2..4, then y = s2[0] + s2[1], in
        // each block; y(a_m) ends in lane 4m.
        let s2 = _mm512_add_ps(s4, _mm512_shuffle_ps::<0b11_10_11_10>(s4, s4));
        let y = _mm512_add_ps(s2, _mm512_shuffle_ps::<0b01_01_01_01>(s2, s2));
        let lanes = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
        _mm512_permutexvar_ps(lanes, y)
    }

    /// A kernel like [`tile`] for [`FUSED_MR`] weight rows in GGUF blocks,
    /// decoded in registers 32 values at a time by `crate::quant::avx512`'s
    /// decoders (`$block` once per block of `$bytes` bytes, from the
    /// block's bytes or, for `run(s)`, from the scales `s` collects for 16
    /// blocks at a time, see `shared!`; `$group` for each of its groups
    /// `$sub`): each group of every weight row, then
    /// each token row's 32 columns multiplied into all of them. The same
    /// values and the same lanes as decoding a panel first, without
    /// storing it (decode, `t` small).
    macro_rules! fused {
        ($name:ident, $kind:ident $(($scales:path))? $block:path, $group:path, $bytes:literal, [$($sub:literal),+]) => {
            /// # Safety
            /// The CPU must support AVX-512F, AVX2, F16C and FMA; every `x`
            /// pointer must start `k` readable floats; each `w` row holds
            /// `k` weights of the decoders' type (`k` a multiple of 32).
            #[target_feature(enable = "avx512f,avx2,f16c,fma")]
            pub(super) unsafe fn $name<const NR: usize>(
                x: &[*const f32; NR],
                w: &[&[u8]; FUSED_MR],
                k: usize,
            ) -> [[f32; NR]; FUSED_MR] {
                const GROUPS: usize = [$($sub),+].len();
                let blocks = k / (32 * GROUPS);
                let mut acc = [[_mm512_setzero_ps(); NR]; FUSED_MR];
                shared!(init $kind $(($scales))?, runs);
                // Block by block, each weight row's groups in order (so
                // every accumulator still sees its columns in increasing
                // order).
                for blk in 0..blocks {
                    shared!(refresh $kind $(($scales))?, runs, w, blk, blocks, $bytes);
                    let mut b: [&[u8]; FUSED_MR] = [&[]; FUSED_MR];
                    for m in 0..FUSED_MR {
                        b[m] = &w[m][$bytes * blk..$bytes * (blk + 1)];
                        // The same block of the row PREFETCH_ROWS rows on
                        // (rows of one task are adjacent in memory), into
                        // L2: the hardware prefetcher alone loses the short
                        // rows at every 4 KiB page of a file map. A prefetch
                        // never faults, so a pointer past the weights is
                        // harmless.
                        let ahead = b[m].as_ptr().wrapping_add(PREFETCH_ROWS * w[m].len());
                        let mut line = 0;
                        while line < $bytes {
                            _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(line).cast());
                            line += 64;
                        }
                    }
                    let mut shared = [shared!($kind $(($scales))? $block, b[0], &runs[0], blk % q::RUN_BLOCKS); FUSED_MR];
                    for m in 1..FUSED_MR {
                        shared[m] = shared!($kind $(($scales))? $block, b[m], &runs[m], blk % q::RUN_BLOCKS);
                    }
                    // Written out (not a loop) so each group's place in
                    // its block is a constant in the decoder.
                    $({
                        let c = 32 * (GROUPS * blk + $sub);
                        // (Assigned in a loop: an array built by a closure
                        // kept the decoded groups on the stack.)
                        let mut v = [[_mm512_setzero_ps(); 2]; FUSED_MR];
                        for m in 0..FUSED_MR {
                            v[m] = $group(b[m], $sub, &shared[m]);
                        }
                        for r in 0..NR {
                            // SAFETY: c + 32 <= k for every row.
                            let (x0, x1) = unsafe {
                                (
                                    _mm512_loadu_ps(x[r].add(c)),
                                    _mm512_loadu_ps(x[r].add(c + 16)),
                                )
                            };
                            for m in 0..FUSED_MR {
                                acc[m][r] = _mm512_fmadd_ps(x0, v[m][0], acc[m][r]);
                                acc[m][r] = _mm512_fmadd_ps(x1, v[m][1], acc[m][r]);
                            }
                        }
                    })+
                }
                let mut out = [[0.0f32; NR]; FUSED_MR];
                for m in 0..FUSED_MR {
                    for r in 0..NR {
                        out[m][r] = reduce(acc[m][r]);
                    }
                }
                out
            }
        };
    }
    /// What a [`fused`] kernel's block shares: `block f` decodes it from
    /// the block's bytes (`f(b)`); `run (s) f` from the scales of its run
    /// of 16 blocks, collected by `s` at the start of the run (Q4_1,
    /// [`q::Q4_1Run`]), as `f(&runs[m], j)` for block `j` of the run.
    macro_rules! shared {
        (init block, $runs:ident) => {};
        (init run($s:path), $runs:ident) => {
            let mut $runs = [Default::default(); FUSED_MR];
        };
        (refresh block, $($_:tt)*) => {};
        (refresh run($s:path), $runs:ident, $w:ident, $blk:ident, $blocks:ident, $bytes:literal) => {
            if $blk % q::RUN_BLOCKS == 0 {
                for m in 0..FUSED_MR {
                    $runs[m] = $s(&$w[m][$bytes * $blk..], q::RUN_BLOCKS.min($blocks - $blk));
                }
            }
        };
        (block $f:path, $b:expr, $run:expr, $j:expr) => {
            $f($b)
        };
        // SAFETY (of the call): j = blk % RUN_BLOCKS, inside the run.
        (run($s:path) $f:path, $b:expr, $run:expr, $j:expr) => {
            unsafe { $f($run, $j) }
        };
    }
    use crate::quant::avx512 as q;
    fused!(fused_q4_0, block q::q4_0_block, q::q4_0, 18, [0]);
    fused!(fused_q4_1, run(q::q4_1_run) q::q4_1_in_run, q::q4_1, 20, [0]);
    fused!(fused_q5_0, block q::q5_0_block, q::q5_0, 22, [0]);
    fused!(fused_q8_0, block q::q8_0_block, q::q8_0, 34, [0]);
    fused!(
        fused_q4_k,
        block q::q4_k_block,
        q::q4_k,
        144,
        [0, 1, 2, 3, 4, 5, 6, 7]
    );
    fused!(
        fused_q6_k,
        block q::q6_k_block,
        q::q6_k,
        210,
        [0, 1, 2, 3, 4, 5, 6, 7]
    );

    /// The lane tree: `s8 = lanes 0..8 + lanes 8..16`, then halves again.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn reduce(a: __m512) -> f32 {
        let lo = _mm512_castps512_ps256(a);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
        super::avx2::reduce8(_mm256_add_ps(lo, hi))
    }
}

#[cfg(target_arch = "x86_64")]
// Index loops over the register tile read as the math does (acc[m][r]).
#[allow(clippy::needless_range_loop)]
mod avx2 {
    use std::arch::x86_64::*;

    use super::MR;

    /// `out[m][r] = x_r · w_m` over `k` columns, in the module's 16 lanes:
    /// lanes 0..8 over all of `k` first, then lanes 8..16.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; every pointer must start `k`
    /// readable floats.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile<const NR: usize>(
        x: &[*const f32; NR],
        w: &[*const f32; MR],
        k: usize,
    ) -> [[f32; NR]; MR] {
        let k16 = k / 16 * 16;
        let mut halves = [[[_mm256_setzero_ps(); NR]; MR]; 2];
        for (h, half) in halves.iter_mut().enumerate() {
            let mut acc = [[_mm256_setzero_ps(); NR]; MR];
            let mut c = 8 * h;
            while c < k16 {
                let mut xv = [_mm256_setzero_ps(); NR];
                for r in 0..NR {
                    // SAFETY: c + 8 <= k16 <= k.
                    xv[r] = unsafe { _mm256_loadu_ps(x[r].add(c)) };
                }
                for m in 0..MR {
                    // SAFETY: as above.
                    let wv = unsafe { _mm256_loadu_ps(w[m].add(c)) };
                    for r in 0..NR {
                        acc[m][r] = _mm256_fmadd_ps(xv[r], wv, acc[m][r]);
                    }
                }
                c += 16;
            }
            if k16 < k {
                // Lanes 8h..8h+8 of the last group: columns k16 + 8h + l < k.
                let valid = (k - k16) as i32 - 8 * h as i32;
                let mask = _mm256_cmpgt_epi32(
                    _mm256_set1_epi32(valid),
                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                );
                let c = k16 + 8 * h;
                let mut xv = [_mm256_setzero_ps(); NR];
                for r in 0..NR {
                    // SAFETY: masked loads read only columns < k.
                    xv[r] = unsafe { _mm256_maskload_ps(x[r].add(c), mask) };
                }
                for m in 0..MR {
                    // SAFETY: as above.
                    let wv = unsafe { _mm256_maskload_ps(w[m].add(c), mask) };
                    for r in 0..NR {
                        acc[m][r] = _mm256_fmadd_ps(xv[r], wv, acc[m][r]);
                    }
                }
            }
            *half = acc;
        }
        let [lo, hi] = halves;
        let mut out = [[0.0f32; NR]; MR];
        for m in 0..MR {
            for r in 0..NR {
                out[m][r] = reduce8(_mm256_add_ps(lo[m][r], hi[m][r]));
            }
        }
        out
    }

    /// `out[m][r] = x_r · w_m` for weight rows of GGUF blocks of `ty`,
    /// decoded in registers 32 values at a time
    /// (`crate::quant::avx2::for_each_group`): lanes 0..8 of the module's
    /// 16 in one accumulator, lanes 8..16 in another, so each group of 32
    /// columns `c..c + 32` adds columns `c..c + 8` and `c + 16..c + 24` to
    /// the first and the others to the second, in column order (the same
    /// values and lanes as decoding a panel first).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C and `ty` have an AVX2
    /// decoder; every `x` pointer must start `k` readable floats; each `w`
    /// row holds `k` weights of `ty` (blocks of `block_len` values in
    /// `block_bytes` bytes).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn fused<const NR: usize>(
        ty: crate::quant::GgmlType,
        x: &[*const f32; NR],
        w: &[&[u8]; MR],
        k: usize,
        block_len: usize,
        block_bytes: usize,
    ) -> [[f32; NR]; MR] {
        let mut lo = [[_mm256_setzero_ps(); NR]; MR];
        let mut hi = [[_mm256_setzero_ps(); NR]; MR];
        for blk in 0..k / block_len {
            let at = blk * block_bytes;
            for m in 0..MR {
                // The same block of the row MR rows on, into L1 (the
                // AVX-512 kernels prefetch further, into L2: not measured
                // for this kernel; a prefetch never faults).
                for line in (0..block_bytes).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(
                        w[m].as_ptr()
                            .wrapping_add(MR * w[m].len() + at + line)
                            .cast(),
                    );
                }
                let (lo, hi) = (&mut lo[m], &mut hi[m]);
                let c0 = blk * block_len;
                let block = &w[m][at..at + block_bytes];
                let group = |e: usize, v: [__m256; 4]| {
                    for r in 0..NR {
                        // SAFETY: c0 + e + 32 <= k for every row.
                        let xv = [0, 8, 16, 24]
                            .map(|o| unsafe { _mm256_loadu_ps(x[r].add(c0 + e + o)) });
                        lo[r] = _mm256_fmadd_ps(xv[0], v[0], lo[r]);
                        hi[r] = _mm256_fmadd_ps(xv[1], v[1], hi[r]);
                        lo[r] = _mm256_fmadd_ps(xv[2], v[2], lo[r]);
                        hi[r] = _mm256_fmadd_ps(xv[3], v[3], hi[r]);
                    }
                };
                // SAFETY: the caller guarantees AVX2, F16C and `ty`.
                unsafe { crate::quant::avx2::for_each_group(ty, block, group) };
            }
        }
        let mut out = [[0.0f32; NR]; MR];
        for m in 0..MR {
            for r in 0..NR {
                out[m][r] = reduce8(_mm256_add_ps(lo[m][r], hi[m][r]));
            }
        }
        out
    }

    /// The lane tree from `s8`: `s4 = s8[0..4] + s8[4..8]`, `s2 = s4[0..2]
    /// + s4[2..4]`, `s2[0] + s2[1]`.
    #[inline]
    #[target_feature(enable = "avx")]
    pub(super) fn reduce8(s8: __m256) -> f32 {
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)))
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};
    use proptest::prelude::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    /// Every type a [`Weights::Quantized`] may hold, with the byte offsets
    /// of its f16 fields in a block.
    const TYPES: [(GgmlType, &[usize]); 13] = [
        (GgmlType::F32, &[]),
        (GgmlType::F16, &[]),
        (GgmlType::BF16, &[]),
        (GgmlType::Q4_0, &[0]),
        (GgmlType::Q4_1, &[0, 2]),
        (GgmlType::Q5_0, &[0]),
        (GgmlType::Q5_1, &[0, 2]),
        (GgmlType::Q8_0, &[0]),
        (GgmlType::Q2_K, &[80, 82]),
        (GgmlType::Q3_K, &[108]),
        (GgmlType::Q4_K, &[0, 2]),
        (GgmlType::Q5_K, &[0, 2]),
        (GgmlType::Q6_K, &[208]),
    ];

    /// `n` rows of `k` random weights of type `ty` (finite values: f16
    /// fields are random finite halves, subnormals and zeros included).
    fn random_weights(
        ty: GgmlType,
        f16_at: &[usize],
        n: usize,
        k: usize,
        rng: &mut StdRng,
    ) -> Vec<u8> {
        let value = |rng: &mut StdRng| rng.gen_range(-2.0f32..2.0);
        match ty {
            GgmlType::F32 => (0..n * k).flat_map(|_| value(rng).to_le_bytes()).collect(),
            GgmlType::F16 => (0..n * k)
                .flat_map(|_| f16::from_f32(value(rng)).to_le_bytes())
                .collect(),
            GgmlType::BF16 => (0..n * k)
                .flat_map(|_| bf16::from_f32(value(rng)).to_le_bytes())
                .collect(),
            _ => {
                let (block_len, block_bytes) = ty.block_layout().expect("layout");
                let blocks = n * k / block_len;
                let mut data: Vec<u8> = (0..blocks * block_bytes).map(|_| rng.gen()).collect();
                for block in data.chunks_exact_mut(block_bytes) {
                    for &at in f16_at {
                        let mut h = f16::from_bits(rng.gen());
                        if !h.is_finite() {
                            h = f16::from_bits(h.to_bits() & !0x4000);
                        }
                        block[at..at + 2].copy_from_slice(&h.to_le_bytes());
                    }
                }
                data
            }
        }
    }

    fn run(isa: Isa, x: &[f32], t: usize, w: Weights<'_>, n: usize, k: usize) -> Vec<f32> {
        let mut y = vec![f32::NAN; t * n];
        // Poisoned scratch, as large as the kernel can use (so it never
        // grows it with zeros): every value the kernel reads from it (not
        // the panels' padding) is written first.
        let tasks = (rayon::current_num_threads().max(1) * TASKS_PER_THREAD).min(n.div_ceil(MR));
        let prows = panel_rows(k, t, l2_bytes()).min(n.div_ceil(MR) * MR);
        let panel =
            (prows * panel_stride(k) + STATE_ROWS * (prows + MR) * 16 + 1).next_multiple_of(LINE);
        let mut scratch = Scratch {
            f32s: vec![f32::NAN; t * k + tasks * panel + LINE - 1],
            q8: Vec::new(),
        };
        let product = Product {
            w,
            n,
            y: &mut y,
            precision: Precision::Exact,
        };
        matmul_many_into_isa(isa, x, t, k, [product], &mut scratch);
        y
    }

    /// `(Σ x·w, Σ |x·w|)` in float64: the reference a row's output must be
    /// within rounding of.
    fn f64_dot(x: &[f32], w: &[f32]) -> (f64, f64) {
        x.iter().zip(w).fold((0.0, 0.0), |(s, m), (&a, &b)| {
            let p = a as f64 * b as f64;
            (s + p, m + p.abs())
        })
    }

    /// Where a row sits: row `p` of a batch of `t` token rows.
    #[derive(Clone, Copy)]
    struct Slot {
        t: usize,
        p: usize,
    }

    /// Row `p`'s outputs when `row` is row `p` of a batch of `t` (the other
    /// rows random): `[n]` of the product's `[t, n]`. The batch starts a
    /// random number of floats past its buffer's start, so its rows are
    /// read in place when they start on a cache line, copied otherwise.
    fn row_in_batch(
        isa: Isa,
        row: &[f32],
        Slot { t, p }: Slot,
        w: Weights<'_>,
        n: usize,
        k: usize,
        rng: &mut StdRng,
    ) -> Vec<f32> {
        let skip = rng.gen_range(0..LINE);
        let mut buf: Vec<f32> = (0..skip + t * k)
            .map(|_| rng.gen_range(-1.0f32..1.0))
            .collect();
        let x = &mut buf[skip..];
        x[p * k..(p + 1) * k].copy_from_slice(row);
        run(isa, x, t, w, n, k)[p * n..(p + 1) * n].to_vec()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(12))]

        /// A row's output is bit-identical alone and at any position of a
        /// batch of 2, 5, 7, 8, 9, 33, 100 or 512 rows (the register-decoded
        /// tiles of AVX2 and AVX-512 and the panel kernels), on every instruction set
        /// this CPU runs, for every weight type; every instruction set
        /// equals the portable path bit for bit; and the result is within
        /// rounding of a float64 dot product of the dequantized weights.
        #[test]
        fn rows_bit_identical_for_every_t(
            seed: u64,
            type_index in 0usize..TYPES.len(),
            n in 1usize..=21,
            blocks in 1usize..=2,
            f32_k in 1usize..=70,
        ) {
            let mut rng = StdRng::seed_from_u64(seed);
            let (ty, f16_at) = TYPES[type_index];
            let (block_len, _) = ty.block_layout().expect("layout");
            let k = if block_len == 1 { f32_k } else { blocks * block_len };
            let data = random_weights(ty, f16_at, n, k, &mut rng);
            let mut wf = vec![f32::NAN; n * k];
            crate::quant::dequantize("w", ty, &data, k, &mut wf).expect("dequantize");
            let weights = [Weights::Quantized { ty, data: &data }, Weights::F32(&wf)];
            let row: Vec<f32> = (0..k).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
            let want = run(Isa::Portable, &row, 1, weights[0], n, k);
            // Float64 reference of the dequantized weights.
            for (j, &g) in want.iter().enumerate() {
                let (exact, mag) = f64_dot(&row, &wf[j * k..(j + 1) * k]);
                prop_assert!(
                    (g as f64 - exact).abs() <= 1e-6 * mag + 1e-30,
                    "{:?} column {}: {} vs f64 {}", ty, j, g, exact
                );
            }
            for isa in Isa::available() {
                for w in weights {
                    for t in [1usize, 2, 5, 7, 8, 9, 33, 100, 512] {
                        let at = [0, t / 2, t - 1, rng.gen_range(0..t)];
                        for p in at {
                            let y = row_in_batch(isa, &row, Slot { t, p }, w, n, k, &mut rng);
                            for (j, (&g, &e)) in y.iter().zip(&want).enumerate() {
                                prop_assert_eq!(
                                    g.to_bits(), e.to_bits(),
                                    "{:?} {:?} t {} row {} column {}: {} vs {}", isa, ty, t, p, j, g, e
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// Q4_1 rows of 1 to 40 blocks, whose one-row and few-row kernels
    /// collect the blocks' scales 16 at a time (whole runs, a short run
    /// after them, the last run ending at the end of the weights, read
    /// with masked loads), equal the portable path bit for bit at 1 to 9
    /// token rows, on every instruction set this CPU runs. (The property
    /// test above draws rows of 1 or 2 blocks.)
    #[test]
    fn q4_1_runs_of_blocks_are_bit_identical() {
        let mut rng = StdRng::seed_from_u64(41);
        for blocks in [1, 2, 15, 16, 17, 18, 31, 32, 33, 40] {
            let (n, k) = (5, 32 * blocks);
            let data = random_weights(GgmlType::Q4_1, &[0, 2], n, k, &mut rng);
            let w = Weights::Quantized {
                ty: GgmlType::Q4_1,
                data: &data,
            };
            for t in 1..=9 {
                let x: Vec<f32> = (0..t * k).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
                let want = run(Isa::Portable, &x, t, w, n, k);
                for isa in Isa::available() {
                    let got = run(isa, &x, t, w, n, k);
                    for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            e.to_bits(),
                            "{isa:?} {blocks} blocks, t {t}, output {i}: {g} vs {e}"
                        );
                    }
                }
            }
        }
    }

    /// Long rows: rows past one k-block of the AVX-512 panel kernel (96
    /// columns past [`KC`] of Q8_0, and 100 past it of f32, whose last
    /// group is masked: the accumulators are saved and reloaded between
    /// blocks), rows whose decoded panels are padded ([`panel_stride`]:
    /// `k` a multiple of 1024, as Gemma 3's down and attention output
    /// projections), and both with several panels per task (the next one
    /// prefetched) equal the decode path's and each other's bit for bit in
    /// every batch and on every instruction set, within rounding of a
    /// float64 dot product.
    #[test]
    fn long_rows_are_bit_identical() {
        if !Isa::available().contains(&Isa::Avx512) {
            println!("note: no AVX-512 here: the k-blocked panel kernel is not exercised");
        }
        let mut rng = StdRng::seed_from_u64(7);
        // Two blocks, and three (a middle block reloads and saves); then
        // padded panels of two blocks and of one; then padded panels of
        // three blocks, several per task.
        for (ty, f16_at, k, n) in [
            (GgmlType::Q8_0, &[0][..], KC + 96, 9),
            (GgmlType::F32, &[], KC + 100, 9),
            (GgmlType::Q8_0, &[0], 2 * KC + 64, 9),
            (GgmlType::F32, &[], 2 * KC + 100, 9),
            (GgmlType::Q5_0, &[0], 2048, 9),
            (GgmlType::Q4_K, &[0, 2], 1024, 9),
            (GgmlType::Q8_0, &[0], 3072, 0),
        ] {
            let pad = if k % 1024 == 0 { LINE } else { 0 };
            assert_eq!(panel_stride(k), k.next_multiple_of(LINE) + pad);
            // n = 0: enough rows for two panels in every task (of
            // many token rows; with few, panels are one tile).
            let tasks = rayon::current_num_threads().max(1) * TASKS_PER_THREAD;
            let n = if n == 0 {
                tasks * (panel_rows(k, FEW_ROWS + 1, None) + MR)
            } else {
                n
            };
            let data = random_weights(ty, f16_at, n, k, &mut rng);
            let mut wf = vec![f32::NAN; n * k];
            crate::quant::dequantize("w", ty, &data, k, &mut wf).expect("dequantize");
            let w = match ty {
                GgmlType::F32 => Weights::F32(&wf),
                _ => Weights::Quantized { ty, data: &data },
            };
            let row: Vec<f32> = (0..k).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
            let want = run(Isa::Portable, &row, 1, w, n, k);
            for (j, &g) in want.iter().enumerate() {
                let (exact, mag) = f64_dot(&row, &wf[j * k..(j + 1) * k]);
                assert!(
                    (g as f64 - exact).abs() <= 1e-6 * mag + 1e-30,
                    "{ty:?} column {j}: {g} vs f64 {exact}"
                );
            }
            for isa in Isa::available() {
                // 7, 33, 47: tiles of uneven sizes; 50: a second row block.
                for t in [1usize, 7, 33, 47, 50] {
                    for p in [0, t / 2, t - 1] {
                        let y = row_in_batch(isa, &row, Slot { t, p }, w, n, k, &mut rng);
                        for (j, (&g, &e)) in y.iter().zip(&want).enumerate() {
                            assert_eq!(
                                g.to_bits(),
                                e.to_bits(),
                                "{ty:?} {isa:?} t {t} row {p} column {j}: {g} vs {e}"
                            );
                        }
                    }
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// Three products of different weight types and sizes on one `x`
        /// in one launch ([`matmul_many_into_isa`], as a layer's Q, K and
        /// V run) give each product's outputs bit for bit as it gives
        /// alone, for decode and batched `t`, on every instruction set.
        #[test]
        fn products_in_one_launch_equal_each_alone(
            seed: u64,
            types in proptest::array::uniform3(0usize..TYPES.len()),
            ns in proptest::array::uniform3(1usize..=37),
            t in prop_oneof![Just(1usize), Just(2), 1usize..=40],
            f32_first: bool,
        ) {
            let mut rng = StdRng::seed_from_u64(seed);
            // One k every block type divides: 256 (Q4_K, Q6_K).
            let k = 256;
            let data: Vec<Vec<u8>> = (0..3)
                .map(|i| random_weights(TYPES[types[i]].0, TYPES[types[i]].1, ns[i], k, &mut rng))
                .collect();
            // Product 0 optionally as f32 weights read in place.
            let mut wf = vec![f32::NAN; ns[0] * k];
            crate::quant::dequantize("w", TYPES[types[0]].0, &data[0], k, &mut wf).expect("dequantize");
            let ws: Vec<Weights<'_>> = (0..3)
                .map(|i| match (i, f32_first) {
                    (0, true) => Weights::F32(&wf),
                    _ => Weights::Quantized { ty: TYPES[types[i]].0, data: &data[i] },
                })
                .collect();
            let x: Vec<f32> = (0..t * k).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
            for isa in Isa::available() {
                let mut ys: Vec<Vec<f32>> = ns.iter().map(|&n| vec![f32::NAN; t * n]).collect();
                let [y0, y1, y2] = &mut ys[..] else { unreachable!() };
                let products = [
                    Product { w: ws[0], n: ns[0], y: y0, precision: Precision::Exact },
                    Product { w: ws[1], n: ns[1], y: y1, precision: Precision::Exact },
                    Product { w: ws[2], n: ns[2], y: y2, precision: Precision::Exact },
                ];
                let mut scratch = Scratch {
                    f32s: vec![f32::NAN; 3],
                    q8: Vec::new(),
                };
                matmul_many_into_isa(isa, &x, t, k, products, &mut scratch);
                for i in 0..3 {
                    let alone = run(isa, &x, t, ws[i], ns[i], k);
                    let same = ys[i].iter().zip(&alone).all(|(a, b)| a.to_bits() == b.to_bits());
                    prop_assert!(same, "{:?} product {} ({:?}) t {}", isa, i, TYPES[types[i]].0, t);
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// Int8 products: every output is the reference arithmetic of
        /// [`int8::dot_portable`] on its own row rounded alone (itself
        /// checked against float64 in `int8`), whatever `t`, the row's
        /// place in the batch and the instruction set; an exact product
        /// (Q4_0, not int8-capable) or an f32 one in the same launch gives
        /// what it gives alone.
        #[test]
        fn int8_rows_equal_the_reference_in_any_batch(
            seed: u64,
            q6: bool,
            n in 1usize..=37,
            blocks in 1usize..=3,
            t in prop_oneof![Just(1usize), Just(2), 1usize..=20],
        ) {
            let mut rng = StdRng::seed_from_u64(seed);
            let k = 256 * blocks;
            let (ty, f16_at): (GgmlType, &[usize]) =
                if q6 { (GgmlType::Q6_K, &[208]) } else { (GgmlType::Q4_K, &[0, 2]) };
            let data = random_weights(ty, f16_at, n, k, &mut rng);
            let other = random_weights(GgmlType::Q4_0, &[0], 5, k, &mut rng);
            let x: Vec<f32> = (0..t * k).map(|_| rng.gen_range(-3.0f32..3.0)).collect();
            let row_bytes = data.len() / n;
            for isa in Isa::available() {
                let (mut y, mut y_other) = (vec![f32::NAN; t * n], vec![f32::NAN; t * 5]);
                let products = [
                    Product { w: Weights::Quantized { ty, data: &data }, n, y: &mut y, precision: Precision::Int8 },
                    Product { w: Weights::Quantized { ty: GgmlType::Q4_0, data: &other }, n: 5, y: &mut y_other, precision: Precision::Int8 },
                ];
                matmul_many_into_isa(isa, &x, t, k, products, &mut Scratch::default());
                for i in 0..t {
                    let mut q = Vec::new();
                    int8::quantize_rows(&x[i * k..(i + 1) * k], k, &mut q);
                    for j in 0..n {
                        let want = int8::dot_portable(ty, &data[j * row_bytes..(j + 1) * row_bytes], &q);
                        let got = y[i * n + j];
                        prop_assert_eq!(got.to_bits(), want.to_bits(), "{:?} {:?} t {} row {} column {}: {} vs {}", ty, isa, t, i, j, got, want);
                    }
                }
                let alone = run(isa, &x, t, Weights::Quantized { ty: GgmlType::Q4_0, data: &other }, 5, k);
                prop_assert!(y_other.iter().zip(&alone).all(|(a, b)| a.to_bits() == b.to_bits()), "{:?}: the exact product changed", isa);
            }
        }
    }

    /// The lane tree and the zero-padded tail, by hand: 40 columns put
    /// three products in lanes 0..8 and two in lanes 8..16.
    #[test]
    fn panel_rows_by_hand() {
        let l2 = Some(2 << 20);
        // At most 16 token rows: one tile, whatever k.
        assert_eq!(panel_rows(8960, 16, l2), MR);
        // k = 8960: 256 KiB holds 7 rows, rounded down to 4. x of 32 rows
        // (1146880 bytes) fits 5/8 of 2 MiB (1310720); of 48 rows
        // (1720320) it does not, and neither does any with L2 unknown.
        assert_eq!(panel_rows(8960, 32, l2), 4);
        assert_eq!(panel_rows(8960, 36, l2), 4);
        assert_eq!(panel_rows(8960, 37, l2), MIN_PROWS);
        assert_eq!(panel_rows(8960, 48, l2), MIN_PROWS);
        assert_eq!(panel_rows(8960, 32, None), MIN_PROWS);
        // k = 1536: 256 KiB holds 42 rows, 40 in whole tiles, above 32.
        assert_eq!(panel_rows(1536, 32, l2), 40);
        assert_eq!(panel_rows(1536, 512, None), 40);
    }

    #[test]
    fn portable_dot_by_hand() {
        let x: Vec<f32> = (0..40).map(|c| c as f32).collect();
        let w = vec![1.0f32; 40];
        let want: f32 = (0..40).map(|c| c as f32).sum();
        assert_eq!(dot_portable(&x, &w), want);
        for isa in Isa::available() {
            let y = run(isa, &x, 1, Weights::F32(&w), 1, 40);
            assert_eq!(y[0], want, "{isa:?}");
        }
    }
}
