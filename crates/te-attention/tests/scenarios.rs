//! Hand-checked scenarios from the issue: first causal rows, decode and
//! chunked prefill through a cache, fully masked rows, argument errors.

mod common;

use common::{check, run, Case, KvSource};
use te_attention::{
    merge_partial, merge_row, AttentionError, AttnMaskType, AttnMetadata, DotProductAttention,
    KvInput,
};
use te_kernels::{KvCacheLayout, KvCacheView, QkvFormat};

fn thd_case(mask: AttnMaskType, kv: KvSource, sq: Vec<usize>, skv: Vec<usize>, seed: u64) -> Case {
    Case {
        q_format: QkvFormat::Thd,
        kv,
        mask,
        window: None,
        softcap: None,
        softmax_scale: None,
        h_kv: 2,
        group: 2,
        d_qk: 64,
        d_v: 64,
        max_seqlen_q: sq.iter().copied().max().unwrap_or(0),
        max_seqlen_kv: skv.iter().copied().max().unwrap_or(0),
        sq,
        skv,
        seed,
    }
}

#[test]
fn causal_first_row_is_first_value() {
    // cu_seqlens [0, 3, 8]: the first query of each sequence sees only its
    // first key, so its output is exactly that key's V.
    let case = thd_case(
        AttnMaskType::Causal,
        KvSource::Tensors(QkvFormat::Thd),
        vec![3, 5],
        vec![3, 5],
        1,
    );
    let data = case.data::<f32>();
    let r = run::<f32, f32>(&case, &data);
    let (hq, dv) = (case.h_q(), case.d_v);
    for (b, first_token) in [(0usize, 0usize), (1, 3)] {
        for h in 0..hq {
            let g = h / case.group;
            let got = &r.out[(first_token * hq + h) * dv..][..dv];
            let want = &data.v[b][g * dv..][..dv];
            for (x, y) in got.iter().zip(want) {
                assert!(
                    (*x as f64 - y).abs() <= 1e-6,
                    "seq {b} head {h}: {x} vs {y}"
                );
            }
        }
    }
    check(&case, &data, &r, 1e-5, 1e-5).unwrap();
}

/// Copies rows `[from, to)` of a `[s, width]` sequence.
fn rows(x: &[f64], width: usize, from: usize, to: usize) -> Vec<f64> {
    x[from * width..to * width].to_vec()
}

#[test]
fn decode_equals_last_row_of_full_causal() {
    let n = 37;
    let full = thd_case(
        AttnMaskType::Causal,
        KvSource::Tensors(QkvFormat::Thd),
        vec![n],
        vec![n],
        7,
    );
    let data = full.data::<f32>();
    let full_run = run::<f32, f32>(&full, &data);
    check(&full, &data, &full_run, 1e-5, 1e-5).unwrap();

    for page_size in [1, 16, 64] {
        let mut decode = thd_case(
            AttnMaskType::PaddingCausalBottomRight,
            KvSource::Cache {
                page_size,
                ring_len: None,
            },
            vec![1],
            vec![n],
            7,
        );
        decode.max_seqlen_q = 1;
        let hq_d = full.h_q() * full.d_qk;
        let dec_data = common::Data {
            q: vec![rows(&data.q[0], hq_d, n - 1, n)],
            k: data.k.clone(),
            v: data.v.clone(),
        };
        let dec_run = run::<f32, f32>(&decode, &dec_data);
        let width = full.h_q() * full.d_v;
        for (x, y) in dec_run.out.iter().zip(&full_run.out[(n - 1) * width..]) {
            assert!(
                (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                "page_size {page_size}: {x} vs {y}"
            );
        }
        check(&decode, &dec_data, &dec_run, 1e-5, 1e-5).unwrap();
    }
}

#[test]
fn chunked_prefill_equals_full_prefill() {
    let full = thd_case(
        AttnMaskType::CausalBottomRight,
        KvSource::Cache {
            page_size: 16,
            ring_len: None,
        },
        vec![6],
        vec![6],
        11,
    );
    let data = full.data::<f32>();
    let full_run = run::<f32, f32>(&full, &data);
    check(&full, &data, &full_run, 1e-5, 1e-5).unwrap();
    let hq_d = full.h_q() * full.d_qk;
    let (kw, vw) = (full.h_kv * full.d_qk, full.h_kv * full.d_v);
    let width = full.h_q() * full.d_v;
    for (chunk, (from, to)) in [(0, 3), (3, 6)].into_iter().enumerate() {
        let case = thd_case(full.mask, full.kv, vec![to - from], vec![to], 11);
        let chunk_data = common::Data {
            q: vec![rows(&data.q[0], hq_d, from, to)],
            k: vec![rows(&data.k[0], kw, 0, to)],
            v: vec![rows(&data.v[0], vw, 0, to)],
        };
        let r = run::<f32, f32>(&case, &chunk_data);
        for (x, y) in r.out.iter().zip(&full_run.out[from * width..to * width]) {
            assert!(
                (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                "chunk {chunk}: {x} vs {y}"
            );
        }
    }
}

#[test]
fn fully_masked_rows_are_zero_with_lse_neg_inf() {
    // Sequence 1 has no keys; top-left causal with sq > skv leaves none
    // masked here, but a window of (0, 0) on a bottom-right mask with
    // sq > skv masks the first queries entirely.
    let mut case = thd_case(
        AttnMaskType::PaddingCausalBottomRight,
        KvSource::Tensors(QkvFormat::Thd),
        vec![5, 2],
        vec![3, 0],
        3,
    );
    case.window = Some((0, 0));
    let data = case.data::<f32>();
    let r = run::<f32, f32>(&case, &data);
    assert!(r.out.iter().all(|x| x.is_finite()));
    let hq = case.h_q();
    let t = 7;
    for h in 0..hq {
        // Queries 0 and 1 of sequence 0 (diagonal at keys -2, -1) and both
        // queries of sequence 1 see nothing.
        for tok in [0, 1, 5, 6] {
            assert_eq!(r.lse[h * t + tok], f32::NEG_INFINITY);
        }
        assert!(r.lse[h * t + 2].is_finite());
    }
    check(&case, &data, &r, 1e-5, 1e-5).unwrap();
}

#[test]
fn bad_arguments_return_named_errors() {
    let attn = DotProductAttention::new(4, 8).with_num_gqa_groups(3);
    assert!(matches!(
        attn.validate(),
        Err(AttentionError::InvalidArgument {
            arg: "num_gqa_groups",
            ..
        })
    ));
    let attn = DotProductAttention::new(4, 8)
        .with_attn_mask_type(AttnMaskType::Causal)
        .with_window_size(4, 2);
    assert!(matches!(
        attn.validate(),
        Err(AttentionError::InvalidArgument {
            arg: "window_size",
            ..
        })
    ));

    let attn = DotProductAttention::new(2, 4).with_formats(QkvFormat::Thd, QkvFormat::Thd);
    let q = vec![0f32; 3 * 2 * 4];
    let kv = vec![0f32; 3 * 2 * 4];
    let mut out = vec![0f32; 3 * 2 * 4];
    let cu_bad = [0, 2, 1];
    let cu = [0, 1, 3];
    let meta = AttnMetadata {
        batch: 2,
        max_seqlen_q: 2,
        max_seqlen_kv: 2,
        cu_seqlens_q: Some(&cu_bad),
        cu_seqlens_kv: Some(&cu),
    };
    let err = attn
        .forward_cpu(
            &q,
            KvInput::Tensors { k: &kv, v: &kv },
            &meta,
            &mut out,
            None,
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            AttentionError::InvalidSeqlens {
                arg: "cu_seqlens_q",
                seq: 1,
                ..
            }
        ),
        "{err}"
    );
    let meta = AttnMetadata {
        cu_seqlens_q: Some(&cu),
        ..meta
    };
    let err = attn
        .forward_cpu(
            &q,
            KvInput::Tensors {
                k: &kv[1..],
                v: &kv,
            },
            &meta,
            &mut out,
            None,
        )
        .unwrap_err();
    assert!(
        matches!(err, AttentionError::ShapeMismatch { arg: "k", .. }),
        "{err}"
    );
    let mut lse = vec![0f32; 5];
    let err = attn
        .forward_cpu(
            &q,
            KvInput::Tensors { k: &kv, v: &kv },
            &meta,
            &mut out,
            Some(&mut lse),
        )
        .unwrap_err();
    assert!(
        matches!(err, AttentionError::ShapeMismatch { arg: "lse", .. }),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "dot_product_attention: argument `lse` has shape [5], expected [2, 3]"
    );
    let meta = AttnMetadata {
        cu_seqlens_q: None,
        ..meta
    };
    let err = attn
        .forward_cpu(
            &q,
            KvInput::Tensors { k: &kv, v: &kv },
            &meta,
            &mut out,
            None,
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            AttentionError::InvalidArgument {
                arg: "cu_seqlens_q",
                ..
            }
        ),
        "{err}"
    );
}

/// Sizes whose products wrap around `usize`, or that would allocate per
/// sequence before any buffer is checked: errors, never a panic or an
/// allocation failure.
#[test]
fn huge_sizes_are_errors_not_crashes() {
    let attn = DotProductAttention::new(1, 8).with_formats(QkvFormat::Bshd, QkvFormat::Bshd);
    let (q, kv) = (vec![0.1f32; 24], vec![0.2f32; 40]);
    let mut out = vec![0f32; 24];
    let run = |meta: AttnMetadata<'_>, out: &mut [f32]| {
        attn.forward_cpu(&q, KvInput::Tensors { k: &kv, v: &kv }, &meta, out, None)
            .unwrap_err()
    };
    let meta = AttnMetadata {
        batch: 1,
        max_seqlen_q: 3,
        max_seqlen_kv: 5,
        cu_seqlens_q: None,
        cu_seqlens_kv: None,
    };
    // 2^61 + 3 rows of 8 wrap to 24 elements.
    let err = run(
        AttnMetadata {
            max_seqlen_q: (1 << 61) + 3,
            ..meta
        },
        &mut out,
    );
    assert!(
        matches!(err, AttentionError::ShapeMismatch { arg: "q", .. }),
        "{err}"
    );
    let err = run(
        AttnMetadata {
            max_seqlen_kv: (1 << 61) + 5,
            ..meta
        },
        &mut out,
    );
    assert!(
        matches!(err, AttentionError::ShapeMismatch { arg: "k", .. }),
        "{err}"
    );
    let err = run(
        AttnMetadata {
            batch: 1 << 36,
            ..meta
        },
        &mut out,
    );
    assert!(
        matches!(err, AttentionError::InvalidArgument { arg: "batch", .. }),
        "{err}"
    );

    // Paged cache geometry that overflows.
    let page_table = [0i32, 0, 0, 0];
    let seqlens = [1i32, 1];
    let cache = vec![0f32; 3 * 8];
    for (max_pages_per_seq, page_size, arg) in [
        (1usize << 63, 1usize, "kv_cache.page_table"),
        (1, usize::MAX / 2, "kv_cache.page_size"),
    ] {
        let layout = KvCacheLayout {
            num_heads_kv: 1,
            head_dim_k: 8,
            head_dim_v: 8,
            page_size,
            page_table: &page_table,
            max_pages_per_seq,
            cache_seqlens: &seqlens,
            ring_len: None,
        };
        let view = KvCacheView {
            k_cache: &cache,
            v_cache: &cache,
            layout,
        };
        let cu = [0, 1, 2];
        let meta = AttnMetadata {
            batch: 2,
            max_seqlen_q: 1,
            max_seqlen_kv: 0,
            cu_seqlens_q: Some(&cu),
            cu_seqlens_kv: None,
        };
        let thd = DotProductAttention::new(1, 8).with_formats(QkvFormat::Thd, QkvFormat::Thd);
        let err = thd
            .forward_cpu(&q[..16], KvInput::Cache(view), &meta, &mut out[..16], None)
            .unwrap_err();
        assert!(
            matches!(err, AttentionError::InvalidArgument { arg: a, .. } if a == arg),
            "{err}"
        );
    }
}

/// A window side too large to matter is the same as no window (no
/// overflow in the key range).
#[test]
fn huge_window_sides_mean_unbounded() {
    let case = thd_case(
        AttnMaskType::NoMask,
        KvSource::Tensors(QkvFormat::Thd),
        vec![3, 5],
        vec![6, 2],
        9,
    );
    let data = case.data::<f32>();
    let plain = run::<f32, f32>(&case, &data);
    for window in [(-1, i64::MAX), (i64::MAX, -1), (i64::MAX, i64::MAX)] {
        let windowed = Case {
            window: Some(window),
            ..case.clone()
        };
        let r = run::<f32, f32>(&windowed, &data);
        assert_eq!(r.out, plain.out, "{window:?}");
        assert_eq!(r.lse, plain.lse, "{window:?}");
    }
}

#[test]
fn mask_names_round_trip() {
    for m in AttnMaskType::ALL {
        assert_eq!(m.as_str().parse::<AttnMaskType>().unwrap(), m);
    }
    assert!("top_left".parse::<AttnMaskType>().is_err());
}

/// Softmax over `logits` (f64): `(out = sum p v, lse)`.
fn softmax_ref(logits: &[f64], v: &[Vec<f64>]) -> (Vec<f64>, f64) {
    let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = logits.iter().map(|s| (s - m).exp()).sum();
    let mut out = vec![0.0; v[0].len()];
    for (s, vj) in logits.iter().zip(v) {
        for (o, x) in out.iter_mut().zip(vj) {
            *o += (s - m).exp() / z * x;
        }
    }
    (out, m + z.ln())
}

#[test]
fn merge_of_disjoint_key_sets_equals_full_softmax() {
    let logits: Vec<f64> = (0..10).map(|j| ((j * 7 % 5) as f64 - 2.0) * 3.1).collect();
    let v: Vec<Vec<f64>> = (0..10)
        .map(|j| (0..4).map(|c| ((j + 3 * c) % 7) as f64 - 3.0).collect())
        .collect();
    let (want, want_lse) = softmax_ref(&logits, &v);
    let (a, lse_a) = softmax_ref(&logits[..4], &v[..4]);
    let (b, lse_b) = softmax_ref(&logits[4..], &v[4..]);
    let mut out: Vec<f32> = a.iter().map(|&x| x as f32).collect();
    let mut lse = lse_a as f32;
    merge_row(
        &mut out,
        &mut lse,
        &b.iter().map(|&x| x as f32).collect::<Vec<_>>(),
        lse_b as f32,
    );
    assert!((lse as f64 - want_lse).abs() <= 1e-5 * (1.0 + want_lse.abs()));
    for (x, y) in out.iter().zip(&want) {
        assert!(
            (*x as f64 - y).abs() <= 1e-5 * (1.0 + y.abs()),
            "{x} vs {y}"
        );
    }
}

#[test]
fn merge_with_empty_side_returns_other_side() {
    let ninf = f32::NEG_INFINITY;
    // [t = 2, h = 1, d = 2]; token 0: b empty; token 1: a empty.
    let mut out_a = vec![1.0, 2.0, 0.0, 0.0];
    let mut lse_a = vec![0.5, ninf];
    let out_b = vec![0.0, 0.0, 3.0, 4.0];
    let lse_b = vec![ninf, 1.5];
    merge_partial(&mut out_a, &mut lse_a, &out_b, &lse_b, 1, 2).unwrap();
    assert_eq!(out_a, vec![1.0, 2.0, 3.0, 4.0]);
    assert_eq!(lse_a, vec![0.5, 1.5]);
    // Both empty: stays 0 / -inf, no NaN.
    let mut o = vec![0.0, 0.0];
    let mut l = ninf;
    merge_row(&mut o, &mut l, &[0.0, 0.0], ninf);
    assert_eq!((o, l), (vec![0.0, 0.0], ninf));
    let err = merge_partial(&mut out_a, &mut lse_a, &out_b[1..], &lse_b, 1, 2).unwrap_err();
    assert!(matches!(
        err,
        AttentionError::ShapeMismatch { arg: "out_b", .. }
    ));
}

/// A long decode (3000 keys, split into pieces across threads) gives the
/// same output bits alone, beside nine other decodes, and beside a
/// prefill, on one thread or two: where its keys split depends on the
/// sequence alone.
#[test]
fn long_decode_is_the_same_bits_in_any_batch() {
    let (hq, hkv, d) = (4usize, 2usize, 64usize);
    let attn = DotProductAttention::new(hq, d)
        .with_num_gqa_groups(hkv)
        .with_attn_mask_type(AttnMaskType::PaddingCausalBottomRight)
        .with_formats(QkvFormat::Thd, QkvFormat::Thd);
    let value = |i: usize, m: usize| ((i * m % 1009) as f32 / 1009.0 - 0.5) * 2.0;
    // Sequence s: sq[s] queries over skv[s] keys; ours is (1, 3000).
    let run = |sq: &[usize], skv: &[usize], threads: usize| -> Vec<f32> {
        let (tq, tk): (usize, usize) = (sq.iter().sum(), skv.iter().sum());
        let cu = |lens: &[usize]| -> Vec<i32> {
            std::iter::once(0)
                .chain(lens.iter().scan(0, |acc, l| {
                    *acc += *l as i32;
                    Some(*acc)
                }))
                .collect()
        };
        let (cu_q, cu_kv) = (cu(sq), cu(skv));
        // Our sequence is last; its data is the same whatever comes first.
        let (q0, k0) = (tq - 1, tk - 3000);
        let q: Vec<f32> = (0..tq * hq * d)
            .map(|i| value(i + (1 << 20) - q0 * hq * d, 7919))
            .collect();
        let k: Vec<f32> = (0..tk * hkv * d)
            .map(|i| value(i + (1 << 22) - k0 * hkv * d, 104729))
            .collect();
        let v: Vec<f32> = (0..tk * hkv * d)
            .map(|i| value(i + (1 << 22) - k0 * hkv * d, 15485863))
            .collect();
        let meta = AttnMetadata {
            batch: sq.len(),
            max_seqlen_q: 0,
            max_seqlen_kv: 0,
            cu_seqlens_q: Some(&cu_q),
            cu_seqlens_kv: Some(&cu_kv),
        };
        let mut out = vec![0f32; tq * hq * d];
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            attn.forward_cpu(&q, KvInput::Tensors { k: &k, v: &v }, &meta, &mut out, None)
                .unwrap()
        });
        out[(tq - 1) * hq * d..].to_vec()
    };
    let bits = |x: Vec<f32>| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let alone = bits(run(&[1], &[3000], 2));
    let mut many_q = vec![1; 9];
    let mut many_kv = vec![700; 9];
    many_q.push(1);
    many_kv.push(3000);
    for (what, sq, skv, threads) in [
        ("alone, one thread", vec![1], vec![3000], 1),
        ("beside nine decodes", many_q, many_kv, 2),
        ("beside a prefill", vec![40, 1], vec![40, 3000], 2),
    ] {
        assert!(bits(run(&sq, &skv, threads)) == alone, "{what}");
    }
}
