//! Rotary position embedding (RoPE, Su et al. 2021, "RoFormer"), applied to
//! a Q or K tensor in bshd, sbhd or thd format on the CPU.
//!
//! Math (docs/ARCHITECTURE.md, "RoPE"): `inv_freq[i] = base^(-2i/d2)` for `i < d2/2`
//! (optionally rescaled, see [`RopeScaling`]), angle `θ = pos * inv_freq[i]`,
//! and each pair `(a, b)` becomes `(a cos θ - b sin θ, b cos θ + a sin θ)`.
//! Half-split pairs `x[i]` with `x[i + d2/2]`; interleaved pairs `x[2i]` with
//! `x[2i + 1]`. Elements `d2..d` pass through unchanged.

use rayon::prelude::*;

use crate::cu_seqlens::check_cu_seqlens;
use crate::shared_mut::SharedMut;
use crate::{Element, KernelError, QkvFormat};

const OP: &str = "rope";

/// Rescaling of the inverse frequencies (Hugging Face `rope_scaling`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain `base^(-2i/d2)`.
    None,
    /// `rope_type = "linear"`: every inverse frequency divided by `factor`
    /// (positions interpolated by `factor`).
    Linear { factor: f64 },
    /// `rope_type = "llama3"` (Llama 3.1): wavelengths `2π / inv_freq` shorter
    /// than `original_max_position_embeddings / high_freq_factor` are kept,
    /// longer than `original_max_position_embeddings / low_freq_factor` are
    /// divided by `factor`, and in between blended linearly in
    /// `smooth = (original_max_position_embeddings / wavelen - low_freq_factor)
    /// / (high_freq_factor - low_freq_factor)`:
    /// `inv_freq' = (1 - smooth) * inv_freq / factor + smooth * inv_freq`.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// `rope_type = "yarn"` (Peng et al. 2023, "YaRN", as Hugging Face's
    /// `_compute_yarn_parameters` and llama.cpp's `rope_yarn` compute it):
    /// with `dim = d2`, `corr(r) = dim * ln(original_max_position_embeddings
    /// / (2π r)) / (2 ln base)`, `low = max(floor(corr(beta_fast)), 0)` and
    /// `high = min(ceil(corr(beta_slow)), dim - 1)` (no floor/ceil when
    /// `truncate` is false), `ramp_i = clamp((i - low) / (high - low), 0,
    /// 1)` (`high += 0.001` when equal) and `e_i = 1 - ramp_i`:
    /// `inv_freq' = inv_freq / factor * (1 - e_i) + inv_freq * e_i`.
    /// `cos` and `sin` are multiplied by `attention_factor` (Hugging Face
    /// `attention_scaling`; default `0.1 ln(factor) + 1`), which scales the
    /// attention logits by its square.
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: f64,
        truncate: bool,
    },
}

impl RopeScaling {
    /// YaRN's default attention factor for `factor`: `0.1 ln(factor) + 1`
    /// (1 for `factor <= 1`), Hugging Face's `get_mscale`.
    pub fn yarn_mscale(factor: f64, mscale: f64) -> f64 {
        if factor <= 1.0 {
            1.0
        } else {
            0.1 * mscale * factor.ln() + 1.0
        }
    }

    /// The factor `cos` and `sin` are multiplied by (1 except YaRN).
    pub fn attention_factor(&self) -> f64 {
        match *self {
            RopeScaling::Yarn {
                attention_factor, ..
            } => attention_factor,
            _ => 1.0,
        }
    }
}

/// What a [`RopeTable`] is built from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeFreqs {
    /// `rope_theta`, e.g. 10000 (Llama 2, Gemma local layers) or 1e6.
    pub base: f64,
    /// Rotary dim `d2`: even, `2 <= d2 <= head_dim`.
    pub rotary_dim: usize,
    /// Positions `0..max_positions` the table covers.
    pub max_positions: usize,
    pub scaling: RopeScaling,
}

impl RopeFreqs {
    /// The `d2 / 2` inverse frequencies, in f64, after scaling.
    pub fn inv_freqs(&self) -> Vec<f64> {
        let d2 = self.rotary_dim as f64;
        let yarn_range = match self.scaling {
            RopeScaling::Yarn {
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                let corr = |rotations: f64| {
                    d2 * (original_max_position_embeddings as f64
                        / (rotations * 2.0 * std::f64::consts::PI))
                        .ln()
                        / (2.0 * self.base.ln())
                };
                let (low, high) = if truncate {
                    (corr(beta_fast).floor(), corr(beta_slow).ceil())
                } else {
                    (corr(beta_fast), corr(beta_slow))
                };
                let (low, high) = (low.max(0.0), high.min(d2 - 1.0));
                (low, if low == high { high + 0.001 } else { high })
            }
            _ => (0.0, 0.0),
        };
        (0..self.rotary_dim / 2)
            .map(|i| {
                let f = self.base.powf(-2.0 * i as f64 / d2);
                match self.scaling {
                    RopeScaling::None => f,
                    RopeScaling::Linear { factor } => f / factor,
                    RopeScaling::Llama3 {
                        factor,
                        low_freq_factor,
                        high_freq_factor,
                        original_max_position_embeddings,
                    } => {
                        let old = original_max_position_embeddings as f64;
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < old / high_freq_factor {
                            f
                        } else if wavelen > old / low_freq_factor {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    }
                    RopeScaling::Yarn { factor, .. } => {
                        let (low, high) = yarn_range;
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolate = 1.0 - ramp;
                        f / factor * (1.0 - extrapolate) + f * extrapolate
                    }
                }
            })
            .collect()
    }
}

/// Precomputed `cos θ` and `sin θ`, `[max_positions, d2 / 2]` f32 each,
/// computed in f64 (exact integer positions) and rounded once. Build one per
/// distinct base and share it across layers (e.g. Gemma 3: one for the local
/// base 10000, one for the global base 1e6).
#[derive(Clone, Debug)]
pub struct RopeTable {
    rotary_dim: usize,
    max_positions: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// Builds the table.
    ///
    /// Errors: `rotary_dim` odd or zero, `max_positions` zero, `base <= 1`,
    /// a scaling factor `<= 0`, or llama3 `high_freq_factor <= low_freq_factor`.
    pub fn new(freqs: &RopeFreqs) -> Result<Self, KernelError> {
        let bad = |arg, reason: String| KernelError::InvalidArgument {
            op: OP,
            arg,
            reason,
        };
        if freqs.rotary_dim == 0 || !freqs.rotary_dim.is_multiple_of(2) {
            return Err(bad(
                "rotary_dim",
                format!("{} is not a positive even number", freqs.rotary_dim),
            ));
        }
        if freqs.max_positions == 0 {
            return Err(bad("max_positions", "must be positive".into()));
        }
        if !greater(freqs.base, 1.0) {
            return Err(bad("base", format!("{} must be > 1", freqs.base)));
        }
        match freqs.scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => {
                if !greater(factor, 0.0) {
                    return Err(bad("scaling.factor", format!("{factor} must be > 0")));
                }
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                if !greater(factor, 0.0) || !greater(low_freq_factor, 0.0) {
                    return Err(bad(
                        "scaling",
                        "llama3 factor and low_freq_factor must be > 0".into(),
                    ));
                }
                if !greater(high_freq_factor, low_freq_factor) {
                    return Err(bad(
                        "scaling.high_freq_factor",
                        "must exceed low_freq_factor".into(),
                    ));
                }
                if original_max_position_embeddings == 0 {
                    return Err(bad(
                        "scaling.original_max_position_embeddings",
                        "must be positive".into(),
                    ));
                }
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                ..
            } => {
                if !greater(factor, 0.0) || !greater(attention_factor, 0.0) {
                    return Err(bad(
                        "scaling",
                        "yarn factor and attention_factor must be > 0".into(),
                    ));
                }
                if !greater(beta_fast, 0.0) || !greater(beta_slow, 0.0) {
                    return Err(bad(
                        "scaling",
                        "yarn beta_fast and beta_slow must be > 0".into(),
                    ));
                }
                if original_max_position_embeddings == 0 {
                    return Err(bad(
                        "scaling.original_max_position_embeddings",
                        "must be positive".into(),
                    ));
                }
            }
        }
        Self::from_inv_freqs(
            &freqs.inv_freqs(),
            freqs.max_positions,
            freqs.scaling.attention_factor(),
        )
    }

    /// A table of the inverse frequencies `inv: [d2 / 2]` (f64, `d2 = 2 *
    /// inv.len()`), with `cos` and `sin` multiplied by `attention_factor`
    /// (1 but for YaRN): for frequencies [`RopeFreqs`] cannot state, such
    /// as GGUF `rope_freqs.weight` divisors applied to
    /// [`RopeFreqs::inv_freqs`].
    ///
    /// Errors: `inv` empty or holding a value that is not finite and
    /// positive, `max_positions` zero, `attention_factor` not finite and
    /// positive.
    pub fn from_inv_freqs(
        inv: &[f64],
        max_positions: usize,
        attention_factor: f64,
    ) -> Result<Self, KernelError> {
        let bad = |arg, reason: String| KernelError::InvalidArgument {
            op: OP,
            arg,
            reason,
        };
        if inv.is_empty() || inv.iter().any(|f| !(f.is_finite() && *f > 0.0)) {
            return Err(bad(
                "inv_freqs",
                "must be finite positive numbers, at least one".into(),
            ));
        }
        if max_positions == 0 {
            return Err(bad("max_positions", "must be positive".into()));
        }
        if !(attention_factor.is_finite() && attention_factor > 0.0) {
            return Err(bad(
                "attention_factor",
                format!("{attention_factor} must be > 0"),
            ));
        }
        let m = attention_factor;
        let half = inv.len();
        let n = max_positions * half;
        let (mut cos, mut sin) = (vec![0f32; n], vec![0f32; n]);
        // Angles in f64 by blocks of positions: exact `sin_cos` at each
        // block's first position p0 and for the offsets k < BLOCK, then the
        // angle-addition formulas for p0 + k. The f64 results are within a
        // few ulp of `sin_cos((p0 + k) θ)`, far below the f32 rounding, and
        // need a sixteenth of the `sin_cos` calls (a 32k-position table
        // took a noticeable part of model start-up).
        const BLOCK: usize = 16;
        let offsets: Vec<(f64, f64)> = (0..BLOCK)
            .flat_map(|k| inv.iter().map(move |&f| (k as f64 * f).sin_cos()))
            .collect();
        cos.par_chunks_mut(BLOCK * half)
            .zip(sin.par_chunks_mut(BLOCK * half))
            .enumerate()
            .for_each(|(block, (c, s))| {
                let p0 = (block * BLOCK) as f64;
                for (i, &f) in inv.iter().enumerate() {
                    let (s0, c0) = (p0 * f).sin_cos();
                    for k in 0..c.len() / half {
                        let (sk, ck) = offsets[k * half + i];
                        c[k * half + i] = ((c0 * ck - s0 * sk) * m) as f32;
                        s[k * half + i] = ((s0 * ck + c0 * sk) * m) as f32;
                    }
                }
            });
        Ok(Self {
            rotary_dim: 2 * half,
            max_positions,
            cos,
            sin,
        })
    }

    /// Rotary dim `d2`.
    pub fn rotary_dim(&self) -> usize {
        self.rotary_dim
    }

    /// Number of positions covered.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// `cos θ`, `[max_positions, d2 / 2]` f32.
    pub fn cos(&self) -> &[f32] {
        &self.cos
    }

    /// `sin θ`, `[max_positions, d2 / 2]` f32.
    pub fn sin(&self) -> &[f32] {
        &self.sin
    }
}

/// Which elements form a rotated pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeConvention {
    /// `x[i]` with `x[i + d2/2]` ("rotate_half": GPT-NeoX, Hugging Face Llama/Gemma).
    HalfSplit,
    /// `x[2i]` with `x[2i + 1]` (Meta Llama, GGUF llama).
    Interleaved,
}

/// Element strides of a `[.., h, d]` tensor, named by dimension (not by
/// position in the shape). `batch` is ignored for thd, where `seq` is the
/// stride between packed tokens. Element `(b, i, h, e)` lives at
/// `b * batch + i * seq + h * head + e * dim` (thd: `(cu_seqlens[b] + i) * seq + ..`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TensorStrides {
    pub batch: usize,
    pub seq: usize,
    pub head: usize,
    pub dim: usize,
}

impl TensorStrides {
    /// Strides of a contiguous tensor in `format` (`batch`, `max_seqlen` as
    /// in [`RopeArgs`]).
    pub fn contiguous(
        format: QkvFormat,
        batch: usize,
        max_seqlen: usize,
        num_heads: usize,
        head_dim: usize,
    ) -> Self {
        let row = num_heads * head_dim;
        let (b, s) = match format {
            QkvFormat::Bshd => (max_seqlen * row, row),
            QkvFormat::Sbhd => (row, batch * row),
            QkvFormat::Thd => (0, row),
        };
        Self {
            batch: b,
            seq: s,
            head: head_dim,
            dim: 1,
        }
    }
}

/// Arguments of a RoPE call (shapes in the crate-level alphabet).
///
/// The tensor is `[b, s, h, d]` (bshd, `s = max_seqlen`), `[s, b, h, d]`
/// (sbhd) or `[t, h, d]` (thd, `t >= cu_seqlens[b]`; rows past
/// `cu_seqlens[b]` are left alone).
///
/// Position of token `i` of sequence `b` (docs/ARCHITECTURE.md, "RoPE" and "Context parallelism"): with
/// `cp_size == 1`, `start_positions[b] + i`. With context parallelism the
/// local length `L` of each sequence (thd: its `cu_seqlens` length; bshd/sbhd:
/// `max_seqlen`) must be even; the rank holds zigzag chunks `cp_rank` and
/// `2 * cp_size - 1 - cp_rank` of size `c = L / 2`, so token `i < c` is at
/// `cp_rank * c + i` and token `i >= c` at `(2 * cp_size - 1 - cp_rank) * c + i - c`,
/// both plus `start_positions[b]`.
#[derive(Clone, Copy, Debug)]
pub struct RopeArgs<'a> {
    pub format: QkvFormat,
    pub convention: RopeConvention,
    /// Heads `h`.
    pub num_heads: usize,
    /// Head dim `d` (`>= table.rotary_dim()`).
    pub head_dim: usize,
    /// Sequences `b` (thd: must equal `cu_seqlens.len() - 1`).
    pub batch: usize,
    /// `s` of bshd/sbhd; ignored for thd.
    pub max_seqlen: usize,
    /// thd: `[b + 1]` i32, non-decreasing, `cu_seqlens[0] = 0`; `&[]` for bshd/sbhd.
    pub cu_seqlens: &'a [i32],
    /// `[b]` i32 `>= 0`, the position of each sequence's first token; `&[]` means all 0.
    pub start_positions: &'a [i32],
    /// Context-parallel world size (1: no context parallelism).
    pub cp_size: usize,
    /// This rank, `< cp_size`.
    pub cp_rank: usize,
    /// Strides of the input (and of the output when in place); `None`:
    /// contiguous in `format`.
    pub strides: Option<TensorStrides>,
}

impl<'a> RopeArgs<'a> {
    /// Contiguous thd arguments with no context parallelism: the common
    /// generation case (`batch = cu_seqlens.len() - 1`).
    pub fn thd(
        convention: RopeConvention,
        num_heads: usize,
        head_dim: usize,
        cu_seqlens: &'a [i32],
        start_positions: &'a [i32],
    ) -> Self {
        Self {
            format: QkvFormat::Thd,
            convention,
            num_heads,
            head_dim,
            batch: cu_seqlens.len().saturating_sub(1),
            max_seqlen: 0,
            cu_seqlens,
            start_positions,
            cp_size: 1,
            cp_rank: 0,
            strides: None,
        }
    }
}

/// [`RopeArgs`] checked against a table: everything a kernel needs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RopePlan {
    /// Token rows processed: `b * s` (bshd/sbhd) or `cu_seqlens[b]` (thd).
    pub tokens: usize,
    pub strides: TensorStrides,
    /// Smallest input length that holds every element the op touches.
    pub min_len: usize,
}

impl RopeArgs<'_> {
    /// Length of sequence `b` in this call (thd: from `cu_seqlens`).
    #[inline]
    pub(crate) fn seqlen(&self, b: usize) -> usize {
        match self.format {
            QkvFormat::Thd => (self.cu_seqlens[b + 1] - self.cu_seqlens[b]) as usize,
            _ => self.max_seqlen,
        }
    }

    /// Position of token `i` of sequence `b` (whose local length is `len`).
    #[inline]
    pub(crate) fn position(&self, b: usize, i: usize, len: usize) -> usize {
        let start = self.start_positions.get(b).map_or(0, |&p| p as usize);
        if self.cp_size == 1 {
            return start + i;
        }
        let c = len / 2;
        if i < c {
            start + self.cp_rank * c + i
        } else {
            start + (2 * self.cp_size - 1 - self.cp_rank) * c + (i - c)
        }
    }

    /// Sequence and index within it of token row `k` (`k < plan.tokens`).
    #[inline]
    pub(crate) fn token(&self, k: usize) -> (usize, usize) {
        match self.format {
            QkvFormat::Bshd => (k / self.max_seqlen, k % self.max_seqlen),
            QkvFormat::Sbhd => (k % self.batch, k / self.batch),
            QkvFormat::Thd => {
                let b = self.cu_seqlens.partition_point(|&c| c as usize <= k) - 1;
                (b, k - self.cu_seqlens[b] as usize)
            }
        }
    }

    /// Element offset of `(b, i, head 0, elem 0)` under `strides`.
    #[inline]
    pub(crate) fn row_offset(&self, s: &TensorStrides, b: usize, i: usize) -> usize {
        match self.format {
            QkvFormat::Thd => (self.cu_seqlens[b] as usize + i) * s.seq,
            _ => b * s.batch + i * s.seq,
        }
    }

    /// Validates every argument against `table` up front.
    pub(crate) fn plan(
        &self,
        table_rotary_dim: usize,
        table_max_positions: usize,
    ) -> Result<RopePlan, KernelError> {
        let bad = |arg, reason: String| KernelError::InvalidArgument {
            op: OP,
            arg,
            reason,
        };
        if self.num_heads == 0 {
            return Err(bad("num_heads", "must be positive".into()));
        }
        if table_rotary_dim > self.head_dim {
            return Err(bad(
                "head_dim",
                format!(
                    "{} is smaller than the table's rotary_dim {}",
                    self.head_dim, table_rotary_dim
                ),
            ));
        }
        if self.cp_size == 0 || self.cp_rank >= self.cp_size {
            return Err(bad(
                "cp_rank",
                format!("{} with cp_size {}", self.cp_rank, self.cp_size),
            ));
        }
        let tokens = match self.format {
            QkvFormat::Thd => {
                check_cu_seqlens(OP, self.cu_seqlens, self.batch)?;
                self.cu_seqlens[self.batch] as usize
            }
            _ => {
                if !self.cu_seqlens.is_empty() {
                    return Err(bad("cu_seqlens", "must be empty for bshd/sbhd".into()));
                }
                self.batch * self.max_seqlen
            }
        };
        if !self.start_positions.is_empty() && self.start_positions.len() != self.batch {
            return Err(KernelError::ShapeMismatch {
                op: OP,
                arg: "start_positions",
                expected: vec![self.batch],
                got: vec![self.start_positions.len()],
            });
        }
        for b in 0..self.batch {
            if self.start_positions.get(b).is_some_and(|&p| p < 0) {
                return Err(bad(
                    "start_positions",
                    format!("sequence {b} starts at {}", self.start_positions[b]),
                ));
            }
            let len = self.seqlen(b);
            if len == 0 {
                continue;
            }
            if self.cp_size > 1 && !len.is_multiple_of(2) {
                return Err(bad(
                    "cu_seqlens",
                    format!("sequence {b} has odd local length {len}; context parallelism needs 2 chunks per rank"),
                ));
            }
            // Positions grow with i (the second zigzag chunk lies after the first).
            let last = self.position(b, len - 1, len);
            if last >= table_max_positions {
                return Err(KernelError::PositionOutOfRange {
                    op: OP,
                    seq: b,
                    position: last,
                    max_positions: table_max_positions,
                });
            }
        }
        let strides = self.strides.unwrap_or_else(|| {
            TensorStrides::contiguous(
                self.format,
                self.batch,
                self.max_seqlen,
                self.num_heads,
                self.head_dim,
            )
        });
        let min_len = if tokens == 0 {
            0
        } else {
            let last_row = match self.format {
                QkvFormat::Thd => (tokens - 1) * strides.seq,
                _ => (self.batch - 1) * strides.batch + (self.max_seqlen - 1) * strides.seq,
            };
            last_row + (self.num_heads - 1) * strides.head + (self.head_dim - 1) * strides.dim + 1
        };
        Ok(RopePlan {
            tokens,
            strides,
            min_len,
        })
    }
}

/// Checks that distinct `(token, head, elem)` of the strided tensor never
/// share an address (sufficient condition: sorted by stride, each stride
/// exceeds the span of all smaller ones), so in-place writes never race.
pub(crate) fn check_no_overlap(args: &RopeArgs, plan: &RopePlan) -> Result<(), KernelError> {
    let s = plan.strides;
    // (extent, stride) per dimension, on the stack.
    let mut dims = [(0usize, 0usize); 4];
    let all: [(usize, usize); 4] = match args.format {
        QkvFormat::Thd => [
            (plan.tokens, s.seq),
            (1, 0),
            (args.num_heads, s.head),
            (args.head_dim, s.dim),
        ],
        _ => [
            (args.batch, s.batch),
            (args.max_seqlen, s.seq),
            (args.num_heads, s.head),
            (args.head_dim, s.dim),
        ],
    };
    let mut len = 0;
    for d in all.into_iter().filter(|&(n, _)| n > 1) {
        dims[len] = d;
        len += 1;
    }
    let dims = &mut dims[..len];
    dims.sort_by_key(|&(_, st)| st);
    let mut span = 0usize;
    for &mut (n, st) in dims {
        if st <= span {
            return Err(KernelError::InvalidArgument {
                op: OP,
                arg: "strides",
                reason: format!(
                    "{:?} make elements overlap; in-place RoPE needs non-overlapping strides",
                    s
                ),
            });
        }
        span += (n - 1) * st;
    }
    Ok(())
}

/// The tensors [`rope_rows`] reads and writes: `src` read at `src_strides`,
/// `dst` written at `dst_strides` (the same pointer and strides: in place).
#[derive(Clone, Copy)]
pub(crate) struct RopeIo<T> {
    src: *const T,
    dst: SharedMut<T>,
    src_strides: TensorStrides,
    dst_strides: TensorStrides,
    /// Out of place: the elements past the rotary dims (`rotary_dim..d`)
    /// are copied from `src` too.
    copy_tail: bool,
}

impl<T> RopeIo<T> {
    /// In place: `x` at `strides`; the elements past the rotary dims are
    /// left as they are.
    pub(crate) fn in_place(x: *mut T, strides: TensorStrides) -> Self {
        RopeIo {
            src: x,
            dst: SharedMut(x),
            src_strides: strides,
            dst_strides: strides,
            copy_tail: false,
        }
    }

    /// Out of place: `x` read at `x_strides`, every element of `out`
    /// written at `out_strides` (the elements past the rotary dims copied
    /// from `x`).
    pub(crate) fn out_of_place(
        x: *const T,
        x_strides: TensorStrides,
        out: *mut T,
        out_strides: TensorStrides,
    ) -> Self {
        RopeIo {
            src: x,
            dst: SharedMut(out),
            src_strides: x_strides,
            dst_strides: out_strides,
            copy_tail: true,
        }
    }
}

/// Rotates every token row of `io`: reads through `src` with `src_strides`
/// and writes through `dst` with `dst_strides` (equal pointers and strides:
/// in place).
///
/// # Safety
/// Every element addressed must be in bounds of its allocation, and distinct
/// `(token, head, elem)` must map to distinct `dst` addresses.
pub(crate) unsafe fn rope_rows<T: Element>(
    io: RopeIo<T>,
    table: &RopeTable,
    args: &RopeArgs,
    tokens: usize,
) {
    let RopeIo {
        src,
        dst,
        src_strides,
        dst_strides,
        copy_tail,
    } = io;
    let half = table.rotary_dim / 2;
    let src = SharedMut(src as *mut T);
    let (h, d) = (args.num_heads, args.head_dim);
    let unit_dim = src_strides.dim == 1 && dst_strides.dim == 1;
    // Tokens per rayon task: ~256 KiB of f32 each; smaller calls (a decode
    // step) run on the calling thread, where a pool hand-off would dominate.
    let grain = (65536 / (h * d).max(1)).max(1);
    let body = |k: usize| {
        let (src, dst) = (src, dst);
        let (b, i) = args.token(k);
        let pos = args.position(b, i, args.seqlen(b));
        let cos = &table.cos[pos * half..(pos + 1) * half];
        let sin = &table.sin[pos * half..(pos + 1) * half];
        let (sr, dr) = (
            args.row_offset(&src_strides, b, i),
            args.row_offset(&dst_strides, b, i),
        );
        for head in 0..h {
            // SAFETY: the caller guarantees bounds and disjointness.
            unsafe {
                let x = src.0.add(sr + head * src_strides.head) as *const T;
                let y = dst.0.add(dr + head * dst_strides.head);
                if unit_dim {
                    // Contiguous head vector: copy (out of place), then rotate
                    // the slice in place with vectorizable loops.
                    if !std::ptr::eq(x, y) {
                        std::ptr::copy_nonoverlapping(x, y, if copy_tail { d } else { 2 * half });
                    }
                    rotate(
                        std::slice::from_raw_parts_mut(y, 2 * half),
                        cos,
                        sin,
                        args.convention,
                    );
                    continue;
                }
                let (xs, ys) = (src_strides.dim, dst_strides.dim);
                for j in 0..half {
                    let (ia, ib) = match args.convention {
                        RopeConvention::HalfSplit => (j, j + half),
                        RopeConvention::Interleaved => (2 * j, 2 * j + 1),
                    };
                    let a = (*x.add(ia * xs)).to_f32();
                    let bb = (*x.add(ib * xs)).to_f32();
                    let (c, s) = (cos[j], sin[j]);
                    *y.add(ia * ys) = T::from_f32(a * c - bb * s);
                    *y.add(ib * ys) = T::from_f32(bb * c + a * s);
                }
                if copy_tail {
                    for e in 2 * half..d {
                        *y.add(e * ys) = *x.add(e * xs);
                    }
                }
            }
        }
    };
    if tokens <= grain {
        (0..tokens).for_each(body);
    } else {
        (0..tokens)
            .into_par_iter()
            .with_min_len(grain)
            .for_each(body);
    }
}

/// Rotates the first `d2 = 2 * cos.len()` elements of one head vector.
#[inline(always)]
fn rotate<T: Element>(y: &mut [T], cos: &[f32], sin: &[f32], convention: RopeConvention) {
    let rot = |a: T, b: T, c: f32, s: f32| {
        let (a, b) = (a.to_f32(), b.to_f32());
        (T::from_f32(a * c - b * s), T::from_f32(b * c + a * s))
    };
    match convention {
        RopeConvention::HalfSplit => {
            let (lo, hi) = y.split_at_mut(cos.len());
            for (((a, b), &c), &s) in lo.iter_mut().zip(hi.iter_mut()).zip(cos).zip(sin) {
                (*a, *b) = rot(*a, *b, c, s);
            }
        }
        RopeConvention::Interleaved => {
            for ((p, &c), &s) in y.chunks_exact_mut(2).zip(cos).zip(sin) {
                (p[0], p[1]) = rot(p[0], p[1], c, s);
            }
        }
    }
}

/// Applies RoPE in place to `x` (layout per `args.format` and `args.strides`),
/// f32 math for f32, f16 and bf16 storage.
///
/// Errors: any argument inconsistent with the others or with `table`
/// ([`KernelError::InvalidArgument`], [`KernelError::ShapeMismatch`]); a token
/// whose position is `>= table.max_positions()`
/// ([`KernelError::PositionOutOfRange`], naming the sequence); strides under
/// which elements overlap. Nothing is written on error.
pub fn apply_rope_cpu<T: Element>(
    x: &mut [T],
    table: &RopeTable,
    args: &RopeArgs,
) -> Result<(), KernelError> {
    let plan = args.plan(table.rotary_dim, table.max_positions)?;
    check_len("x", x.len(), plan.min_len)?;
    check_no_overlap(args, &plan)?;
    let p = x.as_mut_ptr();
    // SAFETY: bounds checked by `min_len`, disjointness by `check_no_overlap`.
    unsafe { rope_rows(RopeIo::in_place(p, plan.strides), table, args, plan.tokens) };
    Ok(())
}

/// Applies RoPE out of place: reads `x` (layout per `args.format` and
/// `args.strides`, which may be non-contiguous) and writes `out`, contiguous
/// in `args.format` (`[b, s, h, d]`,
/// `[s, b, h, d]` or `[cu_seqlens[b], h, d]`), tail `d2..d` copied.
///
/// Errors: as [`apply_rope_cpu`], plus `out` of the wrong length.
pub fn apply_rope_cpu_out<T: Element>(
    x: &[T],
    out: &mut [T],
    table: &RopeTable,
    args: &RopeArgs,
) -> Result<(), KernelError> {
    let plan = args.plan(table.rotary_dim, table.max_positions)?;
    check_len("x", x.len(), plan.min_len)?;
    let n = plan.tokens * args.num_heads * args.head_dim;
    if out.len() != n {
        return Err(KernelError::ShapeMismatch {
            op: OP,
            arg: "out",
            expected: vec![plan.tokens, args.num_heads, args.head_dim],
            got: vec![out.len()],
        });
    }
    let dst_strides = TensorStrides::contiguous(
        args.format,
        args.batch,
        args.max_seqlen,
        args.num_heads,
        args.head_dim,
    );
    // SAFETY: `x` bounds checked by `min_len`; `out` is contiguous of exactly
    // `tokens * h * d` elements, each written by one task.
    unsafe {
        rope_rows(
            RopeIo::out_of_place(x.as_ptr(), plan.strides, out.as_mut_ptr(), dst_strides),
            table,
            args,
            plan.tokens,
        )
    };
    Ok(())
}

/// `a > b`, false for NaN.
fn greater(a: f64, b: f64) -> bool {
    a > b
}

fn check_len(arg: &'static str, got: usize, min: usize) -> Result<(), KernelError> {
    if got < min {
        return Err(KernelError::InvalidArgument {
            op: OP,
            arg,
            reason: format!("has {got} elements, the arguments address {min}"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every table entry is the float64 `sin_cos` of its angle rounded to
    /// f32 (within half an f32 ulp, up to the f64 error of the
    /// angle-addition), for positions across several blocks.
    #[test]
    fn table_is_f32_rounding_of_exact_angles() {
        for (base, rotary_dim, max_positions) in [(10_000.0, 128, 4099), (1e6, 6, 333)] {
            let freqs = RopeFreqs {
                base,
                rotary_dim,
                max_positions,
                scaling: RopeScaling::None,
            };
            let table = RopeTable::new(&freqs).unwrap();
            let inv = freqs.inv_freqs();
            let half = inv.len();
            for pos in 0..max_positions {
                for (i, f) in inv.iter().enumerate() {
                    let (s, c) = (pos as f64 * f).sin_cos();
                    for (got, want) in [
                        (table.cos()[pos * half + i], c),
                        (table.sin()[pos * half + i], s),
                    ] {
                        let ulp = (want as f32).abs().max(f32::MIN_POSITIVE) * f32::EPSILON;
                        assert!(
                            (got as f64 - want).abs() <= 0.5 * ulp as f64 + 1e-15,
                            "base {base} pos {pos} i {i}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
