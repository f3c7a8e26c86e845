//! GGML tensor types as stored (format identity: ids, names, block
//! layouts, which te-rs decodes) and the bit-layout helpers the decoders of
//! every instruction set share.

/// A GGML tensor type, as stored in the `type` field of a GGUF tensor info.
///
/// Ids (llama.cpp `ggml.h`, `enum ggml_type`): F32 0, F16 1, Q4_0 2, Q4_1 3,
/// Q5_0 6, Q5_1 7, Q8_0 8, Q8_1 9, Q2_K 10, Q3_K 11, Q4_K 12, Q5_K 13,
/// Q6_K 14, Q8_K 15, I8 24, I16 25, I32 26, I64 27, F64 28, BF16 30. Any other
/// id is kept as [`GgmlType::Other`]: the file still opens, but such tensors
/// cannot be read.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    I8,
    I16,
    I32,
    I64,
    F64,
    /// A type id te-rs does not know (IQ*, TQ*, MXFP4, ...).
    Other(u32),
}

impl GgmlType {
    /// The type for a GGUF type id.
    pub fn from_id(id: u32) -> GgmlType {
        use GgmlType::*;
        match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2_K,
            11 => Q3_K,
            12 => Q4_K,
            13 => Q5_K,
            14 => Q6_K,
            15 => Q8_K,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            30 => BF16,
            other => Other(other),
        }
    }

    /// The GGUF type id.
    pub fn id(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q2_K => 10,
            Q3_K => 11,
            Q4_K => 12,
            Q5_K => 13,
            Q6_K => 14,
            Q8_K => 15,
            I8 => 24,
            I16 => 25,
            I32 => 26,
            I64 => 27,
            F64 => 28,
            BF16 => 30,
            Other(id) => id,
        }
    }

    /// The name llama.cpp uses (`"Q4_K"`), or `"id N"` for an unknown id.
    pub fn name(self) -> String {
        match self {
            GgmlType::Other(id) => format!("id {id}"),
            known => format!("{known:?}"),
        }
    }

    /// `(elements per block, bytes per block)`, or `None` for an unknown id.
    pub fn block_layout(self) -> Option<(usize, usize)> {
        use GgmlType::*;
        Some(match self {
            F32 | I32 => (1, 4),
            F16 | BF16 | I16 => (1, 2),
            I8 => (1, 1),
            I64 | F64 => (1, 8),
            Q4_0 => (32, 18),
            Q4_1 => (32, 20),
            Q5_0 => (32, 22),
            Q5_1 => (32, 24),
            Q8_0 => (32, 34),
            Q8_1 => (32, 36),
            Q2_K => (256, 84),
            Q3_K => (256, 110),
            Q4_K => (256, 144),
            Q5_K => (256, 176),
            Q6_K => (256, 210),
            Q8_K => (256, 292),
            Other(_) => return None,
        })
    }

    /// Whether [`dequantize`](super::dequantize) supports this type.
    pub fn can_dequantize(self) -> bool {
        use GgmlType::*;
        matches!(
            self,
            F32 | F16 | BF16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q2_K | Q3_K | Q4_K | Q5_K | Q6_K
        )
    }

    /// Bytes taken by `n_elements` elements of this type, or `None` when the
    /// type is unknown, `n_elements` is not a whole number of blocks, or the
    /// size overflows.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        let (block_len, block_bytes) = self.block_layout()?;
        if !n_elements.is_multiple_of(block_len as u64) {
            return None;
        }
        (n_elements / block_len as u64).checked_mul(block_bytes as u64)
    }
}

/// The 6-bit (scale, min) pair j (< 8) of a Q4_K/Q5_K `scales[12]` array:
/// j < 4: (s\[j\] & 63, s\[j + 4\] & 63); j ≥ 4: scale = (s\[j + 4\] & 15) |
/// (s\[j − 4\] >> 6) << 4, min = (s\[j + 4\] >> 4) | (s\[j\] >> 6) << 4.
pub(crate) fn k4_scale_min(s: &[u8], j: usize) -> (f32, f32) {
    if j < 4 {
        ((s[j] & 63) as f32, (s[j + 4] & 63) as f32)
    } else {
        let scale = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        let min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        (scale as f32, min as f32)
    }
}

/// The 8 scales and the 8 mins of [`k4_scale_min`] at once, from a Q4_K
/// block's 12 scale bytes `s`: byte `j` of the first u64 is scale `j`,
/// byte `j` of the second min `j` (the vector decoders widen them).
/// Inlined, on a fixed-size array: as a call on a slice it bounds-checked
/// and assembled its words byte by byte, and took 9.8% of a Qwen2.5-Coder
/// 1.5B decode's samples (`perf`, `te bench -n 64`), once per Q4_K block
/// and weight row.
#[inline]
pub(crate) fn k4_scales_mins(s: &[u8; 12]) -> (u64, u64) {
    let word = |at: usize| u32::from_le_bytes([s[at], s[at + 1], s[at + 2], s[at + 3]]);
    let (w0, w1, w2) = (word(0), word(4), word(8));
    // Bytes j < 4: the low 6 bits of s[j] / s[j + 4]; bytes j >= 4: 4 bits
    // of s[j + 4] with the top 2 of s[j - 4] / s[j] above them.
    let low6 = 0x3f3f_3f3f;
    let scale =
        (w0 & low6) as u64 | (((w2 & 0x0f0f_0f0f) | ((w0 >> 2) & 0x3030_3030)) as u64) << 32;
    let min =
        (w1 & low6) as u64 | ((((w2 >> 4) & 0x0f0f_0f0f) | ((w1 >> 2) & 0x3030_3030)) as u64) << 32;
    (scale, min)
}

/// [`k4_scales_mins`] of a Q4_K (or Q5_K) block `b`, whose 12 scale bytes
/// follow its two f16 (`b[4..16]`).
#[inline]
pub(crate) fn k4_block_scales_mins(b: &[u8]) -> (u64, u64) {
    k4_scales_mins(
        b[4..16]
            .try_into()
            .expect("a K-quant block holds 12 scale bytes"),
    )
}
