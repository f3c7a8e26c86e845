//! `DotProductAttention::forward_nd` (ndarray views) against `forward_cpu`
//! (slices) on the same logical tensors: Q/K/V sliced out of one fused QKV
//! tensor, permuted (memory in another format's order), strided and
//! reversed views, non-standard outputs; plus wrong ranks and shapes.
//! `forward_cpu` itself is checked against a float64 reference in
//! `properties.rs`.

use ndarray::{s, Array, Array3, Array4, ArrayD, ArrayView, Axis, Dimension, IxDyn, ShapeBuilder};
use rand::{Rng, SeedableRng};
use te_attention::nd::NdSeqlens;
use te_attention::{AttentionError, AttnMaskType, AttnMetadata, DotProductAttention, KvInput};
use te_kernels::QkvFormat;

const POISON: f32 = -777.0;

fn random<Sh: ShapeBuilder>(shape: Sh, seed: u64) -> Array<f32, Sh::Dim> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    Array::from_shape_simple_fn(shape, || rng.gen_range(-2.0f32..2.0))
}

fn flat<D: Dimension>(v: &ArrayView<'_, f32, D>) -> Vec<f32> {
    v.iter().copied().collect()
}

/// `forward_cpu` on contiguous copies of the views: (out, lse) in standard
/// order.
fn slice_forward(
    attn: &DotProductAttention,
    q: &ArrayView<'_, f32, IxDyn>,
    k: &ArrayView<'_, f32, IxDyn>,
    v: &ArrayView<'_, f32, IxDyn>,
    meta: &AttnMetadata,
    out_len: usize,
    lse_len: usize,
) -> (Vec<f32>, Vec<f32>) {
    let mut out = vec![POISON; out_len];
    let mut lse = vec![POISON; lse_len];
    attn.forward_cpu(
        &flat(q),
        KvInput::Tensors {
            k: &flat(k),
            v: &flat(v),
        },
        meta,
        &mut out,
        Some(&mut lse),
    )
    .unwrap();
    (out, lse)
}

/// Q, K and V sliced out of one fused `[b, s, h_q + 2 h_kv, d]` tensor
/// (bshd), GQA 6 / 2, causal bottom-right; output into a permuted view.
#[test]
fn fused_qkv_slices_equal_slice_api() {
    let (b, sq, hq, hkv, d) = (2usize, 7usize, 6usize, 2usize, 16usize);
    let fused = random((b, sq, hq + 2 * hkv, d), 1).into_dyn();
    let q = fused.slice(s![.., .., ..hq, ..]).into_dyn();
    let k = fused.slice(s![.., .., hq..hq + hkv, ..]).into_dyn();
    let v = fused.slice(s![.., .., hq + hkv.., ..]).into_dyn();
    assert!(!q.is_standard_layout() && !k.is_standard_layout());
    let attn = DotProductAttention::new(hq, d)
        .with_num_gqa_groups(hkv)
        .with_attn_mask_type(AttnMaskType::CausalBottomRight);
    let meta = AttnMetadata {
        batch: b,
        max_seqlen_q: sq,
        max_seqlen_kv: sq,
        ..Default::default()
    };
    let (want_out, want_lse) =
        slice_forward(&attn, &q, &k, &v, &meta, b * sq * hq * d, b * hq * sq);
    // Output stored [d, h, s, b] and seen as [b, s, h, d].
    let mut out_store = Array::from_elem((d, hq, sq, b), POISON);
    let mut lse = Array3::from_elem((b, hq, sq), POISON);
    attn.forward_nd(
        q.view(),
        k.view(),
        v.view(),
        &NdSeqlens::default(),
        out_store.view_mut().permuted_axes([3, 2, 1, 0]),
        Some(lse.view_mut().into_dyn()),
    )
    .unwrap();
    let got = out_store.view().permuted_axes([3, 2, 1, 0]);
    assert_eq!(got.iter().copied().collect::<Vec<_>>(), want_out);
    assert_eq!(lse.iter().copied().collect::<Vec<_>>(), want_lse);
    assert!(
        want_lse.iter().all(|x| x.is_finite()),
        "every query sees a key"
    );
}

/// sbhd Q seen through bshd memory, thd K/V taking every other row of a
/// longer buffer, a padding mask with cu_seqlens for both sides.
#[test]
fn permuted_q_and_strided_thd_kv_equal_slice_api() {
    let (b, sq, hq, d, dv) = (3usize, 5usize, 2usize, 8usize, 4usize);
    let cu_q = [0, 5, 7, 10];
    let cu_kv = [0, 6, 6, 13];
    let q_store = random((b, sq, hq, d), 2); // bshd memory
    let q = q_store.view().permuted_axes([1, 0, 2, 3]).into_dyn(); // [s, b, h, d]
    let k_store = random((26, hq, d), 3);
    let v_store = random((26, hq, dv + 2), 4);
    let k = k_store.slice(s![..;2, .., ..]).into_dyn();
    let v = v_store.slice(s![..;2, .., 1..=dv]).into_dyn();
    let attn = DotProductAttention::new(hq, d)
        .with_head_dim_v(dv)
        .with_attn_mask_type(AttnMaskType::PaddingCausalBottomRight)
        .with_softcap(5.0)
        .with_formats(QkvFormat::Sbhd, QkvFormat::Thd);
    let seqlens = NdSeqlens {
        cu_seqlens_q: Some(&cu_q),
        cu_seqlens_kv: Some(&cu_kv),
    };
    let meta = AttnMetadata {
        batch: b,
        max_seqlen_q: sq,
        max_seqlen_kv: 0,
        cu_seqlens_q: Some(&cu_q),
        cu_seqlens_kv: Some(&cu_kv),
    };
    let (want_out, want_lse) =
        slice_forward(&attn, &q, &k, &v, &meta, sq * b * hq * dv, b * hq * sq);
    let mut out = Array4::from_elem((sq, b, hq, dv), POISON);
    let mut lse = Array3::from_elem((b, hq, sq), POISON);
    attn.forward_nd(
        q,
        k,
        v,
        &seqlens,
        out.view_mut(),
        Some(lse.view_mut().into_dyn()),
    )
    .unwrap();
    assert_eq!(out.iter().copied().collect::<Vec<_>>(), want_out);
    let got_lse: Vec<f32> = lse.iter().copied().collect();
    // Bit-equal, -inf (padded query rows) included.
    assert_eq!(
        got_lse.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        want_lse.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    assert!(
        want_lse.contains(&f32::NEG_INFINITY),
        "padding rows present"
    );
}

/// thd Q reversed along t (negative stride), sbhd K/V stored as bshd,
/// lse `[h, t]` written through a transposed view, f16 output.
#[test]
fn reversed_thd_q_and_transposed_lse_equal_slice_api() {
    let (hq, hkv, d) = (4usize, 1usize, 8usize);
    let cu_q = [0, 3, 9];
    let q_store = random((9, hq, d), 5).into_dyn();
    // The logical Q is the stored rows in reverse order.
    let q = {
        let mut v = q_store.view();
        v.invert_axis(Axis(0));
        v
    };
    let kv_store = random((2, 10, hkv, d), 6); // [b, s, h, d] memory
    let k = kv_store.view().permuted_axes([1, 0, 2, 3]).into_dyn(); // [s, b, h, d]
    let v_store = random((2, 10, hkv, d), 7);
    let v = v_store.view().permuted_axes([1, 0, 2, 3]).into_dyn();
    let attn = DotProductAttention::new(hq, d)
        .with_num_gqa_groups(hkv)
        .with_attn_mask_type(AttnMaskType::PaddingCausalBottomRight)
        .with_window_size(4, 0)
        .with_formats(QkvFormat::Thd, QkvFormat::Sbhd);
    let cu_kv = [0, 10, 16];
    let meta = AttnMetadata {
        batch: 2,
        max_seqlen_q: 0,
        max_seqlen_kv: 10,
        cu_seqlens_q: Some(&cu_q),
        cu_seqlens_kv: Some(&cu_kv),
    };
    let (want_out, want_lse) = slice_forward(&attn, &q, &k, &v, &meta, 9 * hq * d, hq * 9);
    let mut out = Array3::<half::f16>::from_elem((9, hq, d), half::f16::from_f32(POISON));
    let mut lse_t = Array::from_elem((9, hq), POISON); // [t, h] memory
    attn.forward_nd(
        q,
        k,
        v,
        &NdSeqlens {
            cu_seqlens_q: Some(&cu_q),
            cu_seqlens_kv: Some(&cu_kv),
        },
        out.view_mut(),
        Some(lse_t.view_mut().reversed_axes().into_dyn()),
    )
    .unwrap();
    let want_f16: Vec<half::f16> = want_out.iter().map(|&x| half::f16::from_f32(x)).collect();
    assert_eq!(out.iter().copied().collect::<Vec<_>>(), want_f16);
    assert_eq!(lse_t.t().iter().copied().collect::<Vec<_>>(), want_lse);
}

/// Every mismatch names its argument with both shapes; nothing is written.
#[test]
fn wrong_rank_and_shape_are_errors_naming_the_argument() {
    let attn = DotProductAttention::new(2, 4);
    let q = Array4::<f32>::ones((1, 3, 2, 4));
    let kv = Array4::<f32>::ones((1, 5, 2, 4));
    let mut out = Array4::<f32>::zeros((1, 3, 2, 4));
    let run = |q: ArrayD<f32>,
               k: ArrayD<f32>,
               v: ArrayD<f32>,
               out: &mut ArrayD<f32>,
               attn: &DotProductAttention,
               seqlens: NdSeqlens| {
        let r = attn.forward_nd(q.view(), k.view(), v.view(), &seqlens, out.view_mut(), None);
        assert!(out.iter().all(|&x| x == 0.0), "nothing written on error");
        r.unwrap_err()
    };
    let d = |a: &Array4<f32>| a.clone().into_dyn();
    let mut out_d = d(&out);

    // Q of rank 3 in bshd.
    let err = run(
        Array3::<f32>::ones((3, 2, 4)).into_dyn(),
        d(&kv),
        d(&kv),
        &mut out_d,
        &attn,
        NdSeqlens::default(),
    );
    match &err {
        AttentionError::InvalidArgument {
            arg: "q", reason, ..
        } => {
            assert!(
                reason.contains("[b, s, h, d]") && reason.contains("[3, 2, 4]"),
                "{err}"
            )
        }
        other => panic!("{other:?}"),
    }
    // K with another batch than Q.
    let err = run(
        d(&q),
        Array4::<f32>::ones((2, 5, 2, 4)).into_dyn(),
        d(&kv),
        &mut out_d,
        &attn,
        NdSeqlens::default(),
    );
    assert_eq!(
        err,
        AttentionError::ShapeMismatch {
            op: "dot_product_attention",
            arg: "k",
            expected: vec![1, 5, 2, 4],
            got: vec![2, 5, 2, 4],
        }
    );
    // V with another head dim than configured.
    let err = run(
        d(&q),
        d(&kv),
        Array4::<f32>::ones((1, 5, 2, 6)).into_dyn(),
        &mut out_d,
        &attn,
        NdSeqlens::default(),
    );
    assert_eq!(
        err,
        AttentionError::ShapeMismatch {
            op: "dot_product_attention",
            arg: "v",
            expected: vec![1, 5, 2, 4],
            got: vec![1, 5, 2, 6],
        }
    );
    // Output transposed (same element count, wrong shape).
    let mut bad_out = Array4::<f32>::zeros((3, 1, 2, 4)).into_dyn();
    let err = run(
        d(&q),
        d(&kv),
        d(&kv),
        &mut bad_out,
        &attn,
        NdSeqlens::default(),
    );
    assert_eq!(
        err,
        AttentionError::ShapeMismatch {
            op: "dot_product_attention",
            arg: "out",
            expected: vec![1, 3, 2, 4],
            got: vec![3, 1, 2, 4],
        }
    );
    // lse of the wrong shape.
    let mut lse = Array3::<f32>::zeros((1, 3, 2));
    let err = attn
        .forward_nd(
            q.view(),
            kv.view(),
            kv.view(),
            &NdSeqlens::default(),
            out.view_mut(),
            Some(lse.view_mut().into_dyn()),
        )
        .unwrap_err();
    assert_eq!(
        err,
        AttentionError::ShapeMismatch {
            op: "dot_product_attention",
            arg: "lse",
            expected: vec![1, 2, 3],
            got: vec![1, 3, 2],
        }
    );
    // thd Q without cu_seqlens_q, and with more rows than it packs.
    let thd = attn.clone().with_formats(QkvFormat::Thd, QkvFormat::Thd);
    let q3 = Array3::<f32>::ones((4, 2, 4)).into_dyn();
    let mut out3 = Array3::<f32>::zeros((4, 2, 4)).into_dyn();
    let err = run(
        q3.clone(),
        q3.clone(),
        q3.clone(),
        &mut out3,
        &thd,
        NdSeqlens::default(),
    );
    assert!(
        matches!(
            err,
            AttentionError::InvalidArgument {
                arg: "cu_seqlens_q",
                ..
            }
        ),
        "{err:?}"
    );
    let cu = [0, 3];
    let err = run(
        q3.clone(),
        q3.clone(),
        q3,
        &mut out3,
        &thd,
        NdSeqlens {
            cu_seqlens_q: Some(&cu),
            cu_seqlens_kv: Some(&cu),
        },
    );
    assert_eq!(
        err,
        AttentionError::ShapeMismatch {
            op: "dot_product_attention",
            arg: "q",
            expected: vec![3, 2, 4],
            got: vec![4, 2, 4],
        }
    );
    // And the good call writes.
    attn.forward_nd(
        q.view(),
        kv.view(),
        kv.view(),
        &NdSeqlens::default(),
        out.view_mut(),
        None,
    )
    .unwrap();
    // V is all ones, so every output is 1.
    assert!(out.iter().all(|&x| (x - 1.0).abs() < 1e-6));
}
