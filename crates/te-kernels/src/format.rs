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

impl QkvFormat {
    /// Lowercase name (`"bshd"`, `"sbhd"`, `"thd"`), as parsed by `from_str`.
    pub fn name(self) -> &'static str {
        match self {
            QkvFormat::Bshd => "bshd",
            QkvFormat::Sbhd => "sbhd",
            QkvFormat::Thd => "thd",
        }
    }

    /// The shape in the crate's alphabet: `"[b, s, h, d]"`, `"[s, b, h, d]"`
    /// or `"[t, h, d]"`.
    pub fn shape_name(self) -> &'static str {
        match self {
            QkvFormat::Bshd => "[b, s, h, d]",
            QkvFormat::Sbhd => "[s, b, h, d]",
            QkvFormat::Thd => "[t, h, d]",
        }
    }

    /// Number of axes of a tensor in this format (4, or 3 for thd).
    pub fn rank(self) -> usize {
        match self {
            QkvFormat::Thd => 3,
            QkvFormat::Bshd | QkvFormat::Sbhd => 4,
        }
    }
}

impl std::fmt::Display for QkvFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
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
