//! Attention mask types and the key range each query may see.
//!
//! Every mask of [`AttnMaskType`] combined with a sliding window reduces,
//! for query `i` of a sequence with `sq` queries and `skv` keys, to one
//! contiguous key range `[lo(i), hi(i)]` (see [`KeyRange`]).

use std::fmt;
use std::str::FromStr;

/// TransformerEngine's `attn_mask_type`.
///
/// - `NoMask`: every query sees every key of its sequence.
/// - `Causal` (top-left): query `i` sees keys `j <= i`.
/// - `CausalBottomRight`: query `i` sees keys `j <= i + skv - sq` (the last
///   query is aligned with the last key: decode and chunked prefill).
/// - `Padding*`: as the type without `padding`, with each sequence's actual
///   lengths taken from `cu_seqlens_q` / `cu_seqlens_kv` (or the cache) in
///   bshd/sbhd; padded query rows give output 0 and lse -inf.
///
/// In thd, or with K/V from a cache, lengths always come from `cu_seqlens`
/// or the cache, so `Causal` and `PaddingCausal` (and the bottom-right and
/// no-mask pairs) behave the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum AttnMaskType {
    #[default]
    NoMask,
    Causal,
    CausalBottomRight,
    Padding,
    PaddingCausal,
    PaddingCausalBottomRight,
}

impl AttnMaskType {
    /// TransformerEngine's name (`"padding_causal_bottom_right"`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            AttnMaskType::NoMask => "no_mask",
            AttnMaskType::Causal => "causal",
            AttnMaskType::CausalBottomRight => "causal_bottom_right",
            AttnMaskType::Padding => "padding",
            AttnMaskType::PaddingCausal => "padding_causal",
            AttnMaskType::PaddingCausalBottomRight => "padding_causal_bottom_right",
        }
    }

    /// Every mask type, in TransformerEngine's order.
    pub const ALL: [AttnMaskType; 6] = [
        AttnMaskType::NoMask,
        AttnMaskType::Causal,
        AttnMaskType::CausalBottomRight,
        AttnMaskType::Padding,
        AttnMaskType::PaddingCausal,
        AttnMaskType::PaddingCausalBottomRight,
    ];

    /// Whether the type masks future keys.
    pub fn is_causal(self) -> bool {
        matches!(
            self,
            AttnMaskType::Causal
                | AttnMaskType::CausalBottomRight
                | AttnMaskType::PaddingCausal
                | AttnMaskType::PaddingCausalBottomRight
        )
    }

    /// Whether per-sequence lengths come from `cu_seqlens` in bshd/sbhd.
    pub fn is_padding(self) -> bool {
        matches!(
            self,
            AttnMaskType::Padding
                | AttnMaskType::PaddingCausal
                | AttnMaskType::PaddingCausalBottomRight
        )
    }

    /// Whether the diagonal is top-left aligned (query `i` with key `i`);
    /// otherwise it is bottom-right aligned (query `i` with key
    /// `i + skv - sq`). Only `Causal` and `PaddingCausal` are top-left; the
    /// window of a non-causal type is bottom-right aligned (docs/ARCHITECTURE.md, "Formats and masks").
    pub fn is_top_left(self) -> bool {
        matches!(self, AttnMaskType::Causal | AttnMaskType::PaddingCausal)
    }
}

impl fmt::Display for AttnMaskType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for AttnMaskType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        AttnMaskType::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "unknown attn_mask_type {s:?} (expected no_mask, causal, causal_bottom_right, \
                     padding, padding_causal or padding_causal_bottom_right)"
                )
            })
    }
}

/// The keys query `i` of one sequence may see: `[lo(i), hi(i)]`, inclusive,
/// both non-decreasing in `i`; empty when `lo > hi`.
///
/// `lo(i) = max(first_key, i + offset - left)`,
/// `hi(i) = min(skv - 1, i + offset + right)`, where `offset` is 0 for a
/// top-left mask and `skv - sq` otherwise, `right = 0` for causal masks,
/// and an unbounded side (window -1, or no window) is the sequence edge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyRange {
    offset: i64,
    left: Option<i64>,
    right: Option<i64>,
    first_key: i64,
    skv: i64,
}

impl KeyRange {
    /// The range rule of one sequence with `sq` queries and `skv` keys, of
    /// which those before `first_key` are absent (a sliding-window cache).
    /// `window_size = (left, right)` with -1 for unbounded.
    pub fn new(
        mask: AttnMaskType,
        window_size: Option<(i64, i64)>,
        sq: usize,
        skv: usize,
        first_key: usize,
    ) -> Self {
        let (wl, wr) = window_size.unwrap_or((-1, -1));
        // A side of at least sq + skv already reaches the sequence edge;
        // clamping keeps `bounds` (and device kernels) free of overflow.
        let edge = (sq as i64).saturating_add(skv as i64);
        let left = (wl >= 0).then_some(wl.min(edge));
        let right = if mask.is_causal() {
            Some(0)
        } else {
            (wr >= 0).then_some(wr.min(edge))
        };
        let offset = if mask.is_top_left() {
            0
        } else {
            skv as i64 - sq as i64
        };
        KeyRange {
            offset,
            left,
            right,
            first_key: first_key as i64,
            skv: skv as i64,
        }
    }

    /// `(lo, hi)` for query `i`, as i64 (empty when `lo > hi`).
    #[inline]
    pub fn bounds(&self, i: usize) -> (i64, i64) {
        let diag = i as i64 + self.offset;
        let lo = match self.left {
            Some(l) => (diag - l).max(self.first_key),
            None => self.first_key,
        };
        let hi = match self.right {
            Some(r) => (diag + r).min(self.skv - 1),
            None => self.skv - 1,
        };
        (lo.max(0), hi)
    }

    /// The rule's parts `(offset, left, right, first_key, skv)`, -1 for an
    /// unbounded window side: what a device kernel needs to evaluate
    /// [`KeyRange::bounds`] itself.
    pub(crate) fn parts(&self) -> (i64, i64, i64, i64, i64) {
        (
            self.offset,
            self.left.unwrap_or(-1),
            self.right.unwrap_or(-1),
            self.first_key,
            self.skv,
        )
    }
}
