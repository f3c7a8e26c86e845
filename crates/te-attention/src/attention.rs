//! [`DotProductAttention`]: the configuration, the argument types and the
//! up-front validation shared by every device path.

use te_kernels::{KvCacheLayout, KvCacheView, QkvFormat};

use crate::error::AttentionError;
use crate::mask::{AttnMaskType, KeyRange};

pub(crate) const OP: &str = "dot_product_attention";

/// Most sequences in one forward ([`AttnMetadata::batch`]); the bound keeps
/// a corrupt `batch` from allocating per-sequence state it cannot fill.
pub const MAX_BATCH: usize = 1 << 24;

/// Scaled dot-product attention, configured like TransformerEngine's
/// `DotProductAttention`.
///
/// For each sequence `b`, query head `h` and query `i`:
/// `s_j = softmax_scale * q_i · k_j`, optionally softcapped to
/// `softcap * tanh(s_j / softcap)`, masked to the keys `j` in
/// [`KeyRange`] (mask type, window, sequence lengths), then
/// `out_i = sum_j softmax(s)_j v_j` and `lse_i = ln(sum_j exp(s_j))`
/// (natural log). Query head `h` reads KV head
/// `h / (num_attention_heads / num_gqa_groups)` (GQA/MQA, repeat_interleave).
/// A query that sees no key gets output 0 and lse -inf.
///
/// Build with [`DotProductAttention::new`] and the `with_*` setters; every
/// forward validates the configuration ([`DotProductAttention::validate`]).
#[derive(Clone, Debug, PartialEq)]
pub struct DotProductAttention {
    /// Query heads `h_q`.
    pub num_attention_heads: usize,
    /// KV heads `h_kv`; divides `h_q` (`h_kv = h_q`: MHA, 1: MQA).
    pub num_gqa_groups: usize,
    /// Query/key head dim `d_qk`.
    pub head_dim_qk: usize,
    /// Value (and output) head dim `d_v`.
    pub head_dim_v: usize,
    /// Logit scale; `None`: `1 / sqrt(head_dim_qk)`.
    pub softmax_scale: Option<f32>,
    pub attn_mask_type: AttnMaskType,
    /// Sliding window `(left, right)`, -1 = unbounded, `None` = `(-1, -1)`:
    /// query `i` of a sequence with `sq` queries and `skv` keys sees keys
    /// `j` in `[i + skv - sq - left, i + skv - sq + right]` (aligned
    /// bottom-right, as decode with a cache needs; `i - left ..= i + right`
    /// under the top-left `causal` and `padding_causal` masks). Values
    /// beyond the sequence lengths mean unbounded. Causal masks force `right = 0` (the window's
    /// right must then be 0 or -1). Hugging Face `sliding_window = W` is
    /// `(W - 1, 0)`.
    pub window_size: Option<(i64, i64)>,
    /// Logit softcap `cap` (> 0): `cap * tanh(s / cap)` after scaling,
    /// before masking and softmax (Gemma 2).
    pub softcap: Option<f32>,
    /// Layout of Q and of the output.
    pub qkv_format: QkvFormat,
    /// Layout of K and V when given as tensors ([`KvInput::Tensors`]);
    /// ignored for [`KvInput::Cache`].
    pub kv_format: QkvFormat,
}

impl DotProductAttention {
    /// MHA with `num_attention_heads` heads of dim `head_dim` (for Q, K and
    /// V), scale `1 / sqrt(head_dim)`, `no_mask`, no window, no softcap,
    /// bshd for Q and K/V.
    pub fn new(num_attention_heads: usize, head_dim: usize) -> Self {
        DotProductAttention {
            num_attention_heads,
            num_gqa_groups: num_attention_heads,
            head_dim_qk: head_dim,
            head_dim_v: head_dim,
            softmax_scale: None,
            attn_mask_type: AttnMaskType::NoMask,
            window_size: None,
            softcap: None,
            qkv_format: QkvFormat::Bshd,
            kv_format: QkvFormat::Bshd,
        }
    }

    /// Sets `num_gqa_groups` (KV heads).
    pub fn with_num_gqa_groups(mut self, num_gqa_groups: usize) -> Self {
        self.num_gqa_groups = num_gqa_groups;
        self
    }

    /// Sets the value head dim `d_v`.
    pub fn with_head_dim_v(mut self, head_dim_v: usize) -> Self {
        self.head_dim_v = head_dim_v;
        self
    }

    /// Sets an explicit `softmax_scale`.
    pub fn with_softmax_scale(mut self, softmax_scale: f32) -> Self {
        self.softmax_scale = Some(softmax_scale);
        self
    }

    /// Sets the mask type.
    pub fn with_attn_mask_type(mut self, attn_mask_type: AttnMaskType) -> Self {
        self.attn_mask_type = attn_mask_type;
        self
    }

    /// Sets the sliding window `(left, right)`, -1 = unbounded.
    pub fn with_window_size(mut self, left: i64, right: i64) -> Self {
        self.window_size = Some((left, right));
        self
    }

    /// Sets the logit softcap.
    pub fn with_softcap(mut self, softcap: f32) -> Self {
        self.softcap = Some(softcap);
        self
    }

    /// Sets the Q/output format and the K/V format.
    pub fn with_formats(mut self, qkv_format: QkvFormat, kv_format: QkvFormat) -> Self {
        self.qkv_format = qkv_format;
        self.kv_format = kv_format;
        self
    }

    /// The scale applied to `q · k`: `softmax_scale` or `1 / sqrt(d_qk)`.
    pub fn effective_softmax_scale(&self) -> f32 {
        self.softmax_scale
            .unwrap_or_else(|| 1.0 / (self.head_dim_qk as f32).sqrt())
    }

    /// Query heads per KV head (`h_q / h_kv`).
    pub fn kv_group(&self) -> usize {
        self.num_attention_heads / self.num_gqa_groups.max(1)
    }

    /// Checks the configuration alone.
    ///
    /// Errors: zero heads or head dims, `num_gqa_groups` not dividing
    /// `num_attention_heads`, a non-finite or non-positive scale or softcap,
    /// window sides below -1, a causal mask with a window `right` other than
    /// 0 or -1.
    pub fn validate(&self) -> Result<(), AttentionError> {
        let invalid = |arg: &'static str, reason: String| {
            Err(AttentionError::InvalidArgument {
                op: OP,
                arg,
                reason,
            })
        };
        if self.num_attention_heads == 0 {
            return invalid("num_attention_heads", "must be > 0".into());
        }
        if self.num_gqa_groups == 0
            || self.num_attention_heads / self.num_gqa_groups * self.num_gqa_groups
                != self.num_attention_heads
        {
            return invalid(
                "num_gqa_groups",
                format!(
                    "{} must be > 0 and divide num_attention_heads = {}",
                    self.num_gqa_groups, self.num_attention_heads
                ),
            );
        }
        if self.head_dim_qk == 0 {
            return invalid("head_dim_qk", "must be > 0".into());
        }
        if self.head_dim_v == 0 {
            return invalid("head_dim_v", "must be > 0".into());
        }
        if let Some(s) = self.softmax_scale {
            if !s.is_finite() || s <= 0.0 {
                return invalid("softmax_scale", format!("{s} must be finite and > 0"));
            }
        }
        if let Some(c) = self.softcap {
            if !c.is_finite() || c <= 0.0 {
                return invalid("softcap", format!("{c} must be finite and > 0"));
            }
        }
        if let Some((l, r)) = self.window_size {
            if l < -1 || r < -1 {
                return invalid(
                    "window_size",
                    format!("({l}, {r}): each side must be >= -1 (-1 = unbounded)"),
                );
            }
            if self.attn_mask_type.is_causal() && r > 0 {
                return invalid(
                    "window_size",
                    format!(
                        "({l}, {r}): right must be 0 or -1 with mask {}",
                        self.attn_mask_type
                    ),
                );
            }
        }
        Ok(())
    }
}

/// Where K and V come from.
#[derive(Clone, Copy, Debug)]
pub enum KvInput<'a, T> {
    /// `k: [.., h_kv, d_qk]`, `v: [.., h_kv, d_v]` in the `kv_format` of
    /// the [`DotProductAttention`]: bshd `[b, max_seqlen_kv, ..]`, sbhd
    /// `[max_seqlen_kv, b, ..]`, thd `[t_kv, ..]` with `cu_seqlens_kv`.
    Tensors { k: &'a [T], v: &'a [T] },
    /// Read straight from an `InferenceParams` cache (contiguous or paged).
    /// Sequence `b` has `layout.seqlen(b)` keys, of which those before
    /// `layout.first_held_position(b)` are absent (masked out: a
    /// sliding-window ring holds the last `ring_len`). `AttnMetadata::batch`
    /// must equal `cache_seqlens.len()`; `max_seqlen_kv`, `cu_seqlens_kv`
    /// and the `kv_format` are not used. Page-table entries past those a
    /// sequence's cached slots use are not read.
    Cache(KvCacheView<'a, T>),
}

/// Where a CPU forward writes
/// ([`DotProductAttention::forward_cpu_at_positions`]).
#[derive(Debug)]
pub struct AttnOutput<'a, O> {
    /// `[.., h_q, d_v]` in the `qkv_format` of the [`DotProductAttention`]
    /// (bshd `[b, max_seqlen_q, ..]`, sbhd `[max_seqlen_q, b, ..]`, thd
    /// `[t_q, ..]`); fully written (rows of padded or fully masked queries
    /// get 0). `O` may differ from the input dtype (e.g. f32 partial outputs
    /// for an LSE merge).
    pub out: &'a mut [O],
    /// Optional f32 natural-log LSE, `[b, h_q, max_seqlen_q]` (bshd/sbhd) or
    /// `[h_q, t_q]` (thd); -inf for queries that see no key.
    pub lse: Option<&'a mut [f32]>,
}

/// The K/V lengths (elements) and cache layout a forward validates, for any
/// device's buffers.
#[derive(Clone, Copy, Debug)]
pub(crate) enum KvLens<'a> {
    Tensors {
        k: usize,
        v: usize,
    },
    Cache {
        k_cache: usize,
        v_cache: usize,
        layout: KvCacheLayout<'a>,
    },
}

impl<T> KvInput<'_, T> {
    pub(crate) fn lens(&self) -> KvLens<'_> {
        match self {
            KvInput::Tensors { k, v } => KvLens::Tensors {
                k: k.len(),
                v: v.len(),
            },
            KvInput::Cache(view) => KvLens::Cache {
                k_cache: view.k_cache.len(),
                v_cache: view.v_cache.len(),
                layout: view.layout,
            },
        }
    }
}

/// Per-step sequence metadata (build once per step, reuse in every layer).
///
/// Lengths of sequence `b`:
/// - queries: `cu_seqlens_q[b+1] - cu_seqlens_q[b]` in thd, or in bshd/sbhd
///   with a padding mask; otherwise `max_seqlen_q`;
/// - keys: from the cache with [`KvInput::Cache`]; else
///   `cu_seqlens_kv[b+1] - cu_seqlens_kv[b]` in thd or with a padding mask;
///   otherwise `max_seqlen_kv`.
#[derive(Clone, Copy, Debug, Default)]
pub struct AttnMetadata<'a> {
    /// Sequences `b`.
    pub batch: usize,
    /// Padded query length `s` of bshd/sbhd Q (unused for thd).
    pub max_seqlen_q: usize,
    /// Padded key length of bshd/sbhd K/V tensors (unused for thd and caches).
    pub max_seqlen_kv: usize,
    /// `[b + 1]` i32 query offsets (thd, or padding masks).
    pub cu_seqlens_q: Option<&'a [i32]>,
    /// `[b + 1]` i32 key offsets (thd K/V, or padding masks with tensors).
    pub cu_seqlens_kv: Option<&'a [i32]>,
}

/// One sequence's resolved lengths.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SeqLens {
    pub sq: usize,
    pub key_range: KeyRange,
    /// With [`Positions`]: where this sequence's per-query bounds start in
    /// [`Plan::row_bounds`] (they replace `key_range`).
    pub row_base: Option<usize>,
}

/// Everything a device path needs after validation.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    pub seqs: Vec<SeqLens>,
    /// Per query `(lo, hi)` key indices of the sequences with `row_base`.
    pub row_bounds: Vec<(i64, i64)>,
    /// Q rows (units of `h_q * d_qk`): `t_q` for thd, else `b * max_seqlen_q`.
    pub q_rows: usize,
    /// Per-sequence query and key lengths and first held key, while planning.
    sq: Vec<usize>,
    skv: Vec<usize>,
    first: Vec<usize>,
}

impl Plan {
    /// Keys `[lo, hi]` (inclusive, empty when `lo > hi`) that query `i` of
    /// sequence `b` sees.
    #[inline]
    pub fn bounds(&self, b: usize, i: usize) -> (i64, i64) {
        let seq = &self.seqs[b];
        match seq.row_base {
            Some(base) => self.row_bounds[base + i],
            None => seq.key_range.bounds(i),
        }
    }
}

/// Absolute positions of queries and keys whose keys are not one run of
/// consecutive positions: a context-parallel rank holds only its shard of
/// each sequence's keys ([`DotProductAttention::forward_cpu_at_positions`]).
///
/// Sequence `b`'s queries sit at consecutive positions from `q_start[b]`;
/// its key `j` (the `j`-th key the cache or tensor holds for it, absent
/// sliding-window slots included) sits at `k[cu_k[b] + j]`.
#[derive(Clone, Copy, Debug)]
pub struct Positions<'a> {
    /// `[b]` i32: position of each sequence's first query.
    pub q_start: &'a [i32],
    /// `[b + 1]` i32 offsets into `k`; `cu_k[b + 1] - cu_k[b]` is the
    /// sequence's key length.
    pub cu_k: &'a [i32],
    /// Key positions, strictly increasing within each sequence.
    pub k: &'a [i32],
}

impl Positions<'_> {
    /// Replaces each sequence's key range in `plan` by per-query bounds
    /// from the positions, under `attn`'s mask and window read in
    /// positions: the query at position `p` sees the keys at `p - left ..=
    /// p + right` (`right` 0 under a causal mask; a side of -1 or no window
    /// is unbounded), among those held.
    pub(crate) fn apply(
        &self,
        attn: &DotProductAttention,
        plan: &mut Plan,
    ) -> Result<(), AttentionError> {
        let b = plan.seqs.len();
        let bad = |arg: &'static str, seq: usize, reason: String| {
            Err(AttentionError::InvalidSeqlens {
                op: OP,
                arg,
                seq,
                reason,
            })
        };
        if self.q_start.len() != b || self.cu_k.len() != b + 1 {
            return Err(AttentionError::ShapeMismatch {
                op: OP,
                arg: "positions",
                expected: vec![b, b + 1],
                got: vec![self.q_start.len(), self.cu_k.len()],
            });
        }
        let (wl, wr) = attn.window_size.unwrap_or((-1, -1));
        let right = if attn.attn_mask_type.is_causal() {
            Some(0)
        } else {
            (wr >= 0).then_some(wr)
        };
        let left = (wl >= 0).then_some(wl);
        plan.row_bounds.clear();
        for s in 0..b {
            let (k0, k1) = (self.cu_k[s], self.cu_k[s + 1]);
            if k0 < 0 || k1 < k0 || k1 as usize > self.k.len() {
                return bad("positions.cu_k", s, format!("offsets {k0}..{k1}"));
            }
            let keys = &self.k[k0 as usize..k1 as usize];
            if keys.len() != plan.skv[s] {
                return bad(
                    "positions.cu_k",
                    s,
                    format!("{} key positions for {} keys", keys.len(), plan.skv[s]),
                );
            }
            if let Some(w) = keys.windows(2).position(|w| w[0] >= w[1]) {
                return bad(
                    "positions.k",
                    s,
                    format!(
                        "key positions {} then {} do not increase",
                        keys[w],
                        keys[w + 1]
                    ),
                );
            }
            let first = plan.first[s] as i64;
            plan.seqs[s].row_base = Some(plan.row_bounds.len());
            for i in 0..plan.seqs[s].sq {
                let p = self.q_start[s] as i64 + i as i64;
                let lo = match left {
                    Some(l) => keys.partition_point(|&k| (k as i64) < p - l) as i64,
                    None => 0,
                };
                let hi = match right {
                    Some(r) => keys.partition_point(|&k| k as i64 <= p + r) as i64 - 1,
                    None => keys.len() as i64 - 1,
                };
                plan.row_bounds.push((lo.max(first), hi));
            }
        }
        Ok(())
    }
}

/// One side (queries or keys) of a batch, for reading its per-sequence
/// lengths.
struct Side<'a> {
    /// The offsets' argument name in errors (`cu_seqlens_q` / `cu_seqlens_kv`).
    arg: &'static str,
    format: QkvFormat,
    cu: Option<&'a [i32]>,
    max_seqlen: usize,
}

impl Side<'_> {
    /// Per-sequence lengths into `out` (`batch` entries): from the offsets
    /// for thd (unbounded) or a padding mask (each at most `max_seqlen`),
    /// else every sequence is `max_seqlen` long.
    fn lengths(
        &self,
        mask: AttnMaskType,
        batch: usize,
        out: &mut Vec<usize>,
    ) -> Result<(), AttentionError> {
        if self.format == QkvFormat::Thd {
            lengths_from_cu(self.arg, self.cu, batch, None, out)
        } else if mask.is_padding() {
            lengths_from_cu(self.arg, self.cu, batch, Some(self.max_seqlen), out)
        } else {
            out.clear();
            out.resize(batch, self.max_seqlen);
            Ok(())
        }
    }
}

pub(crate) fn lengths_from_cu(
    arg: &'static str,
    cu: Option<&[i32]>,
    batch: usize,
    max_seqlen: Option<usize>,
    out: &mut Vec<usize>,
) -> Result<(), AttentionError> {
    let cu = cu.ok_or_else(|| AttentionError::InvalidArgument {
        op: OP,
        arg,
        reason: "required for thd or a padding mask".into(),
    })?;
    if cu.len() != batch + 1 {
        return Err(AttentionError::ShapeMismatch {
            op: OP,
            arg,
            expected: vec![batch + 1],
            got: vec![cu.len()],
        });
    }
    if cu[0] != 0 {
        return Err(AttentionError::InvalidSeqlens {
            op: OP,
            arg,
            seq: 0,
            reason: format!("cu_seqlens[0] = {} must be 0", cu[0]),
        });
    }
    out.clear();
    for b in 0..batch {
        out.push({
            let len = cu[b + 1] as i64 - cu[b] as i64;
            if len < 0 {
                return Err(AttentionError::InvalidSeqlens {
                    op: OP,
                    arg,
                    seq: b,
                    reason: format!("offsets decrease ({} then {})", cu[b], cu[b + 1]),
                });
            }
            if let Some(m) = max_seqlen {
                if len as usize > m {
                    return Err(AttentionError::InvalidSeqlens {
                        op: OP,
                        arg,
                        seq: b,
                        reason: format!("length {len} exceeds the padded length {m}"),
                    });
                }
            }
            len as usize
        });
    }
    Ok(())
}

fn check_len(arg: &'static str, got: usize, shape: &[usize]) -> Result<(), AttentionError> {
    // A product that overflows matches no real buffer.
    if shape.iter().try_fold(1usize, |a, &x| a.checked_mul(x)) == Some(got) {
        Ok(())
    } else {
        Err(AttentionError::ShapeMismatch {
            op: OP,
            arg,
            expected: shape.to_vec(),
            got: vec![got],
        })
    }
}

/// Shape of a `[.., heads, dim]` tensor in `format` (on the stack: `dims[..rank]`).
struct Shape {
    dims: [usize; 4],
    rank: usize,
}

impl std::ops::Deref for Shape {
    type Target = [usize];
    fn deref(&self) -> &[usize] {
        &self.dims[..self.rank]
    }
}

fn shape(
    format: QkvFormat,
    batch: usize,
    max_seqlen: usize,
    t: usize,
    heads: usize,
    dim: usize,
) -> Shape {
    match format {
        QkvFormat::Bshd => Shape {
            dims: [batch, max_seqlen, heads, dim],
            rank: 4,
        },
        QkvFormat::Sbhd => Shape {
            dims: [max_seqlen, batch, heads, dim],
            rank: 4,
        },
        QkvFormat::Thd => Shape {
            dims: [t, heads, dim, 0],
            rank: 3,
        },
    }
}

impl DotProductAttention {
    /// Validates every argument of a forward and resolves the lengths.
    pub(crate) fn plan(
        &self,
        q_len: usize,
        kv: &KvLens<'_>,
        meta: &AttnMetadata<'_>,
        out_len: usize,
        lse_len: Option<usize>,
    ) -> Result<Plan, AttentionError> {
        let mut plan = Plan::default();
        self.plan_into(q_len, kv, meta, out_len, lse_len, &mut plan)?;
        Ok(plan)
    }

    /// [`plan`](Self::plan) into `plan`, reusing its buffers.
    pub(crate) fn plan_into(
        &self,
        q_len: usize,
        kv: &KvLens<'_>,
        meta: &AttnMetadata<'_>,
        out_len: usize,
        lse_len: Option<usize>,
        plan: &mut Plan,
    ) -> Result<(), AttentionError> {
        self.validate()?;
        let (b, hq, hkv) = (meta.batch, self.num_attention_heads, self.num_gqa_groups);
        if b > MAX_BATCH {
            return Err(AttentionError::InvalidArgument {
                op: OP,
                arg: "batch",
                reason: format!("{b} sequences; at most {MAX_BATCH} are supported"),
            });
        }
        let (dqk, dv) = (self.head_dim_qk, self.head_dim_v);
        let mask = self.attn_mask_type;

        // Query lengths and the Q / out / lse shapes.
        let q_thd = self.qkv_format == QkvFormat::Thd;
        let sq = &mut plan.sq;
        let q_side = Side {
            arg: "cu_seqlens_q",
            format: self.qkv_format,
            cu: meta.cu_seqlens_q,
            max_seqlen: meta.max_seqlen_q,
        };
        q_side.lengths(mask, b, sq)?;
        let t_q = if q_thd { sq.iter().sum() } else { 0 };
        let q_shape = |d| shape(self.qkv_format, b, meta.max_seqlen_q, t_q, hq, d);
        check_len("q", q_len, &q_shape(dqk))?;
        check_len("out", out_len, &q_shape(dv))?;
        if let Some(n) = lse_len {
            if q_thd {
                check_len("lse", n, &[hq, t_q])?;
            } else {
                check_len("lse", n, &[b, hq, meta.max_seqlen_q])?;
            }
        }

        // Key lengths, first held key, and the K/V shapes.
        let (skv, first) = (&mut plan.skv, &mut plan.first);
        match kv {
            KvLens::Tensors { k, v } => {
                let kv_thd = self.kv_format == QkvFormat::Thd;
                let kv_side = Side {
                    arg: "cu_seqlens_kv",
                    format: self.kv_format,
                    cu: meta.cu_seqlens_kv,
                    max_seqlen: meta.max_seqlen_kv,
                };
                kv_side.lengths(mask, b, skv)?;
                let t_kv = if kv_thd { skv.iter().sum() } else { 0 };
                let kv_shape = |d| shape(self.kv_format, b, meta.max_seqlen_kv, t_kv, hkv, d);
                check_len("k", *k, &kv_shape(dqk))?;
                check_len("v", *v, &kv_shape(dv))?;
                first.clear();
                first.resize(b, 0);
            }
            KvLens::Cache {
                k_cache,
                v_cache,
                layout: l,
            } => {
                self.check_cache(*k_cache, *v_cache, l, b)?;
                skv.clear();
                first.clear();
                for s in 0..b {
                    skv.push(l.seqlen(s));
                    first.push(l.first_held_position(s));
                }
            }
        }

        plan.seqs.clear();
        for s in 0..b {
            plan.seqs.push(SeqLens {
                sq: plan.sq[s],
                key_range: KeyRange::new(
                    mask,
                    self.window_size,
                    plan.sq[s],
                    plan.skv[s],
                    plan.first[s],
                ),
                row_base: None,
            });
        }
        plan.row_bounds.clear();
        plan.q_rows = q_len / (hq * dqk);
        Ok(())
    }

    fn check_cache(
        &self,
        k_cache_len: usize,
        v_cache_len: usize,
        l: &KvCacheLayout<'_>,
        batch: usize,
    ) -> Result<(), AttentionError> {
        let mismatch = |arg: &'static str, expected: usize, got: usize| {
            Err(AttentionError::ShapeMismatch {
                op: OP,
                arg,
                expected: vec![expected],
                got: vec![got],
            })
        };
        if l.num_heads_kv != self.num_gqa_groups {
            return mismatch("kv_cache.num_heads_kv", self.num_gqa_groups, l.num_heads_kv);
        }
        if l.head_dim_k != self.head_dim_qk {
            return mismatch("kv_cache.head_dim_k", self.head_dim_qk, l.head_dim_k);
        }
        if l.head_dim_v != self.head_dim_v {
            return mismatch("kv_cache.head_dim_v", self.head_dim_v, l.head_dim_v);
        }
        if l.batch() != batch {
            return mismatch("kv_cache.cache_seqlens", batch, l.batch());
        }
        if l.page_size == 0 {
            return Err(AttentionError::InvalidArgument {
                op: OP,
                arg: "kv_cache.page_size",
                reason: "must be > 0".into(),
            });
        }
        match batch.checked_mul(l.max_pages_per_seq) {
            Some(n) if n <= l.page_table.len() => {}
            _ => {
                return Err(AttentionError::InvalidArgument {
                    op: OP,
                    arg: "kv_cache.page_table",
                    reason: format!(
                        "{} entries, fewer than batch {batch} x max_pages_per_seq {}",
                        l.page_table.len(),
                        l.max_pages_per_seq
                    ),
                })
            }
        }
        let page_elems = (l.num_heads_kv * l.head_dim_k)
            .checked_mul(l.page_size)
            .ok_or_else(|| AttentionError::InvalidArgument {
                op: OP,
                arg: "kv_cache.page_size",
                reason: format!(
                    "a page of {} x {} x {} elements overflows",
                    l.page_size, l.num_heads_kv, l.head_dim_k
                ),
            })?;
        if !k_cache_len.is_multiple_of(page_elems) {
            return Err(AttentionError::ShapeMismatch {
                op: OP,
                arg: "k_cache",
                expected: vec![
                    k_cache_len / page_elems,
                    l.page_size,
                    l.num_heads_kv,
                    l.head_dim_k,
                ],
                got: vec![k_cache_len],
            });
        }
        let num_pages = k_cache_len / page_elems;
        check_len(
            "v_cache",
            v_cache_len,
            &[num_pages, l.page_size, l.num_heads_kv, l.head_dim_v],
        )?;
        if let Some(r) = l.ring_len {
            if r == 0 || r % l.page_size != 0 {
                return Err(AttentionError::InvalidArgument {
                    op: OP,
                    arg: "kv_cache.ring_len",
                    reason: format!(
                        "{r} must be a positive multiple of page_size {}",
                        l.page_size
                    ),
                });
            }
        }
        for s in 0..batch {
            let seqlen = l.cache_seqlens[s];
            if seqlen < 0 {
                return Err(AttentionError::InvalidSeqlens {
                    op: OP,
                    arg: "kv_cache.cache_seqlens",
                    seq: s,
                    reason: format!("negative length {seqlen}"),
                });
            }
            let slots = match l.ring_len {
                Some(r) => (seqlen as usize).min(r),
                None => seqlen as usize,
            };
            let pages = slots.div_ceil(l.page_size);
            if pages > l.max_pages_per_seq {
                return Err(AttentionError::InvalidSeqlens {
                    op: OP,
                    arg: "kv_cache.page_table",
                    seq: s,
                    reason: format!(
                        "{slots} cached slots need {pages} pages, max_pages_per_seq is {}",
                        l.max_pages_per_seq
                    ),
                });
            }
            let row = &l.page_table[s * l.max_pages_per_seq..][..pages];
            if let Some(&p) = row.iter().find(|&&p| p < 0 || p as usize >= num_pages) {
                return Err(AttentionError::InvalidSeqlens {
                    op: OP,
                    arg: "kv_cache.page_table",
                    seq: s,
                    reason: format!(
                        "page id {p} outside the cache's {num_pages} pages \
                         (its {slots} cached slots use the first {pages} entries of its row)"
                    ),
                });
            }
        }
        Ok(())
    }
}
