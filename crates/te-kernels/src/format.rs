//! Tensor layouts for Q, K and V (TransformerEngine's `qkv_format`).

/// Layout of a `[.., h, d]` activation tensor.
///
/// - `Bshd`: `[b, s, h, d]`, every sequence padded to `s`.
/// - `Sbhd`: `[s, b, h, d]`.
/// - `Thd`: `[t, h, d]`, sequences packed back to back; needs `cu_seqlens`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QkvFormat {
    Bshd,
    Sbhd,
    Thd,
}

impl QkvFormat {
    /// Row index (in units of `h * d` elements) of token `i` of sequence `b`.
    ///
    /// `batch` and `max_seqlen` describe the padded formats; `cu_seqlens` the
    /// packed one (pass `&[]` for bshd/sbhd).
    #[inline]
    pub fn token_row(
        self,
        b: usize,
        i: usize,
        batch: usize,
        max_seqlen: usize,
        cu_seqlens: &[i32],
    ) -> usize {
        match self {
            QkvFormat::Bshd => b * max_seqlen + i,
            QkvFormat::Sbhd => i * batch + b,
            QkvFormat::Thd => cu_seqlens[b] as usize + i,
        }
    }
}

impl std::str::FromStr for QkvFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "bshd" => Ok(QkvFormat::Bshd),
            "sbhd" => Ok(QkvFormat::Sbhd),
            "thd" => Ok(QkvFormat::Thd),
            other => Err(format!(
                "unknown qkv_format {other:?} (expected bshd, sbhd or thd)"
            )),
        }
    }
}
