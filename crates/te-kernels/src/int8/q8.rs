//! The activations of [`super`]: rows of `x` rounded to 8 bits in blocks
//! of [`QK`] columns (the module doc there gives the arithmetic).

/// Columns per activation block.
pub const QK: usize = 256;

/// 256 activations of one row rounded to 8 bits (see the module doc):
/// `qs` the integers, `bsums16` / `bsums32` their sums over 16 and 32
/// consecutive columns, `d` the scale (`x ≈ d·q`).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub struct Q8Block {
    pub qs: [i8; QK],
    pub bsums16: [i16; 16],
    pub bsums32: [i16; 8],
    pub d: f32,
}

impl Default for Q8Block {
    fn default() -> Self {
        Q8Block {
            qs: [0; QK],
            bsums16: [0; 16],
            bsums32: [0; 8],
            d: 0.0,
        }
    }
}

/// Rounds each row of `x: [t, k]` (f32, row-major, `k` a multiple of
/// [`QK`]) to 8 bits: `out` gets `t · k / QK` blocks, row after row.
pub fn quantize_rows(x: &[f32], k: usize, out: &mut Vec<Q8Block>) {
    assert!(
        k.is_multiple_of(QK) && x.len().is_multiple_of(QK),
        "quantize_rows: rows of {k} columns are not whole blocks of {QK}"
    );
    out.resize(x.len() / QK, Q8Block::default());
    for (xb, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let (d, id) = if amax > 0.0 {
            (amax / 127.0, 127.0 / amax)
        } else {
            (0.0, 0.0)
        };
        for (q, v) in b.qs.iter_mut().zip(xb) {
            *q = round_ties_even(v * id).clamp(-127.0, 127.0) as i8;
        }
        for (s, q) in b.bsums16.iter_mut().zip(b.qs.chunks_exact(16)) {
            *s = q.iter().map(|&v| v as i16).sum();
        }
        for (s, p) in b.bsums32.iter_mut().zip(b.bsums16.chunks_exact(2)) {
            *s = p[0] + p[1];
        }
        b.d = d;
    }
}

/// `v` rounded to the nearest integer, ties to even, for |v| < 2^22: the
/// value of `f32::round_ties_even` (+0.0 for −0.0) without its library
/// call. Adding 1.5 · 2^23 leaves no fraction bits and rounds to nearest
/// even; taking it off again is exact. Activations are at most 127.
#[inline(always)]
pub(super) fn round_ties_even(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (v + MAGIC) - MAGIC
}
