//! The `ndarray` front ends (`te_kernels::nd`) against the slice API on the
//! same logical tensors: standard, sliced, permuted and reversed
//! (negative-stride) views, in every format; plus wrong ranks and shapes.
//! The slice API itself is checked against float64 references in `rope.rs`
//! and `kv_save.rs`.

use ndarray::{
    s, Array, Array2, Array3, Array4, ArrayViewMut, Axis, Dimension, IxDyn, ShapeBuilder,
};
use rand::{Rng, SeedableRng};
use te_kernels::nd::{self, NdRopeArgs, NdSaveArgs};
use te_kernels::{
    apply_rope_cpu, apply_rope_cpu_out, convert_bshd_to_thd, convert_thd_to_bshd, save_kv_cpu,
    ConvertArgs, KernelError, KvCacheLayout, KvStep, QkvFormat, RopeArgs, RopeConvention,
    RopeFreqs, RopeScaling, RopeTable,
};

const POISON: f32 = -777.0;

fn random<Sh: ShapeBuilder>(shape: Sh, seed: u64) -> Array<f32, Sh::Dim> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    Array::from_shape_simple_fn(shape, || rng.gen_range(-2.0f32..2.0))
}

fn table() -> RopeTable {
    RopeTable::new(&RopeFreqs {
        base: 10000.0,
        rotary_dim: 6,
        max_positions: 64,
        scaling: RopeScaling::None,
    })
    .unwrap()
}

/// The view's elements in standard order (what the slice API sees).
fn flat<D: Dimension>(v: &ArrayViewMut<'_, f32, D>) -> Vec<f32> {
    v.iter().copied().collect()
}

/// Slice-API RoPE in place on the logical tensor `x` (contiguous in
/// `format`, shape `shape`).
fn rope_slice(x: &mut [f32], shape: &[usize], args: &NdRopeArgs) {
    let (batch, max_seqlen, h, d) = match args.format {
        QkvFormat::Bshd => (shape[0], shape[1], shape[2], shape[3]),
        QkvFormat::Sbhd => (shape[1], shape[0], shape[2], shape[3]),
        QkvFormat::Thd => (args.cu_seqlens.len() - 1, 0, shape[1], shape[2]),
    };
    let rope = RopeArgs {
        format: args.format,
        convention: args.convention,
        num_heads: h,
        head_dim: d,
        batch,
        max_seqlen,
        cu_seqlens: args.cu_seqlens,
        start_positions: args.start_positions,
        cp_size: args.cp_size,
        cp_rank: args.cp_rank,
        strides: None,
    };
    apply_rope_cpu(x, &table(), &rope).unwrap();
}

/// Runs `nd::apply_rope` on `view` and checks it equals the slice API on
/// the view's logical contents; `base_before` / `base_after` let the caller
/// check that elements outside the view are untouched.
fn check_rope_view(mut view: ArrayViewMut<'_, f32, IxDyn>, args: &NdRopeArgs, what: &str) {
    let shape = view.shape().to_vec();
    let mut want = flat(&view);
    rope_slice(&mut want, &shape, args);
    nd::apply_rope(view.view_mut(), &table(), args).unwrap();
    assert_eq!(flat(&view), want, "{what}");
}

fn rope_args<'a>(
    format: QkvFormat,
    conv: RopeConvention,
    cu: &'a [i32],
    starts: &'a [i32],
) -> NdRopeArgs<'a> {
    let args = NdRopeArgs::new(format, conv).with_start_positions(starts);
    if format == QkvFormat::Thd {
        args.with_cu_seqlens(cu)
    } else {
        args
    }
}

#[test]
fn rope_on_sliced_permuted_and_reversed_views_equals_slice_api() {
    let (b, sq, h, d) = (3usize, 5usize, 2usize, 8usize);
    let cu = [0, 4, 4, 9]; // thd: 9 packed tokens of 11 rows
    for conv in [RopeConvention::HalfSplit, RopeConvention::Interleaved] {
        for format in [QkvFormat::Bshd, QkvFormat::Sbhd, QkvFormat::Thd] {
            let starts: Vec<i32> = vec![0, 7, 30];
            let args = rope_args(format, conv, &cu, &starts);
            let logical: Vec<usize> = match format {
                QkvFormat::Bshd => vec![b, sq, h, d],
                QkvFormat::Sbhd => vec![sq, b, h, d],
                QkvFormat::Thd => vec![11, h, d],
            };
            let n = logical.len();
            // 1. Standard layout.
            let mut a = random(IxDyn(&logical), 1);
            check_rope_view(a.view_mut(), &args, "standard");

            // 2. Q slice of a fused QKV tensor: heads 0..h of 3h, and head
            //    dim padded (d of d + 3), with the rest poisoned.
            let mut fused_shape = logical.clone();
            fused_shape[n - 2] = 3 * h;
            fused_shape[n - 1] = d + 3;
            let mut fused = random(IxDyn(&fused_shape), 2);
            let before = fused.clone();
            {
                let mut v = fused.view_mut();
                v.slice_axis_inplace(Axis(n - 2), (h..2 * h).into());
                v.slice_axis_inplace(Axis(n - 1), (0..d).into());
                assert!(!v.is_standard_layout());
                check_rope_view(v, &args, "fused slice");
            }
            for ((idx, x), y) in fused.indexed_iter().zip(before.iter()) {
                let (hh, e) = (idx[n - 2], idx[n - 1]);
                if !((h..2 * h).contains(&hh) && e < d) {
                    assert_eq!(x, y, "outside the view, {idx:?}");
                }
            }

            // 3. Permuted: memory in another axis order, seen in `format`.
            //    Store with the axes reversed, view with them reversed back.
            let rev: Vec<usize> = (0..n).rev().collect();
            let stored_shape: Vec<usize> = rev.iter().map(|&i| logical[i]).collect();
            let mut stored = random(IxDyn(&stored_shape), 3);
            let v = stored.view_mut().permuted_axes(IxDyn(&rev));
            assert_eq!(v.shape(), logical.as_slice());
            check_rope_view(v, &args, "permuted");

            // 4. Reversed seq/token axis (negative stride): copied path.
            let mut c = random(IxDyn(&logical), 4);
            let mut v = c.view_mut();
            v.invert_axis(Axis(0));
            check_rope_view(v, &args, "reversed");
        }
    }
}

#[test]
fn rope_out_of_place_on_strided_input_and_output_equals_slice_api() {
    let (h, d) = (3usize, 8usize);
    let cu = [0, 2, 7];
    let starts = [5, 0];
    for format in [QkvFormat::Bshd, QkvFormat::Sbhd, QkvFormat::Thd] {
        let args = rope_args(format, RopeConvention::HalfSplit, &cu, &starts);
        let (in_shape, out_shape): (Vec<usize>, Vec<usize>) = match format {
            QkvFormat::Bshd => (vec![2, 5, h, d], vec![2, 5, h, d]),
            QkvFormat::Sbhd => (vec![5, 2, h, d], vec![5, 2, h, d]),
            QkvFormat::Thd => (vec![9, h, d], vec![7, h, d]),
        };
        let n = in_shape.len();
        // Input: every other element of a twice-as-long head dim.
        let mut wide = in_shape.clone();
        wide[n - 1] = 2 * d;
        let x_base = random(IxDyn(&wide), 7);
        let x = x_base.slice_axis(Axis(n - 1), ndarray::Slice::new(0, None, 2));
        assert_eq!(x.shape(), in_shape.as_slice());
        let x_std: Vec<f32> = x.iter().copied().collect();
        let rope = RopeArgs {
            format,
            convention: RopeConvention::HalfSplit,
            num_heads: h,
            head_dim: d,
            batch: 2,
            max_seqlen: if format == QkvFormat::Thd { 0 } else { 5 },
            cu_seqlens: if format == QkvFormat::Thd { &cu } else { &[] },
            start_positions: &starts,
            cp_size: 1,
            cp_rank: 0,
            strides: None,
        };
        let mut want = vec![POISON; out_shape.iter().product()];
        apply_rope_cpu_out(&x_std, &mut want, &table(), &rope).unwrap();
        // Output: a transposed (non-standard) view, poisoned.
        let rev: Vec<usize> = (0..n).rev().collect();
        let stored: Vec<usize> = rev.iter().map(|&i| out_shape[i]).collect();
        let mut out = Array::from_elem(IxDyn(&stored), POISON);
        let out_view = out.view_mut().permuted_axes(IxDyn(&rev));
        nd::apply_rope_out(x.view(), out_view, &table(), &args).unwrap();
        let got: Vec<f32> = out
            .view()
            .permuted_axes(IxDyn(&rev))
            .iter()
            .copied()
            .collect();
        assert_eq!(got, want, "{format}");
        // Standard-layout output too.
        let mut out = Array::from_elem(IxDyn(&out_shape), POISON);
        nd::apply_rope_out(x, out.view_mut(), &table(), &args).unwrap();
        assert_eq!(out.iter().copied().collect::<Vec<_>>(), want, "{format}");
    }
}

#[test]
fn context_parallel_positions_pass_through() {
    let cu = [0, 4, 8];
    let args = NdRopeArgs::new(QkvFormat::Thd, RopeConvention::Interleaved)
        .with_cu_seqlens(&cu)
        .with_start_positions(&[1, 2])
        .with_context_parallel(2, 1);
    let mut x = random(IxDyn(&[8, 2, 6]), 9);
    let mut want: Vec<f32> = x.iter().copied().collect();
    rope_slice(&mut want, &[8, 2, 6], &args);
    nd::apply_rope(x.view_mut(), &table(), &args).unwrap();
    assert_eq!(x.iter().copied().collect::<Vec<_>>(), want);
}

#[test]
fn rope_wrong_rank_and_shape_are_errors_naming_the_argument() {
    let t = table();
    // A 3-axis view given as bshd.
    let mut x = Array3::<f32>::ones((2, 3, 8));
    let err = nd::apply_rope(
        x.view_mut(),
        &t,
        &NdRopeArgs::new(QkvFormat::Bshd, RopeConvention::HalfSplit),
    )
    .unwrap_err();
    match &err {
        KernelError::InvalidArgument {
            op: "rope",
            arg: "x",
            reason,
        } => {
            assert!(
                reason.contains("[b, s, h, d]") && reason.contains("[2, 3, 8]"),
                "{err}"
            )
        }
        other => panic!("{other:?}"),
    }
    assert!(x.iter().all(|&v| v == 1.0), "nothing written on error");
    // thd with fewer rows than cu_seqlens packs.
    let cu = [0, 3];
    let err = nd::apply_rope(
        x.view_mut(),
        &t,
        &NdRopeArgs::new(QkvFormat::Thd, RopeConvention::HalfSplit).with_cu_seqlens(&[0, 5]),
    )
    .unwrap_err();
    assert_eq!(
        err,
        KernelError::ShapeMismatch {
            op: "rope",
            arg: "x",
            expected: vec![5, 3, 8],
            got: vec![2, 3, 8],
        }
    );
    // The same through the copying path (a reversed, negative-stride view).
    let mut rev = x.view_mut();
    rev.invert_axis(Axis(0));
    let err = nd::apply_rope(
        rev,
        &t,
        &NdRopeArgs::new(QkvFormat::Thd, RopeConvention::HalfSplit).with_cu_seqlens(&[0, 5]),
    )
    .unwrap_err();
    assert!(
        matches!(&err, KernelError::ShapeMismatch { arg: "x", got, .. } if got == &[2, 3, 8]),
        "{err:?}"
    );
    assert!(x.iter().all(|&v| v == 1.0), "nothing written on error");
    // Out-of-place output of the wrong shape.
    let x = Array4::<f32>::ones((2, 3, 1, 8));
    let mut out = Array4::<f32>::zeros((3, 2, 1, 8));
    let err = nd::apply_rope_out(
        x.view(),
        out.view_mut(),
        &t,
        &NdRopeArgs::new(QkvFormat::Bshd, RopeConvention::HalfSplit),
    )
    .unwrap_err();
    assert_eq!(
        err,
        KernelError::ShapeMismatch {
            op: "rope",
            arg: "out",
            expected: vec![2, 3, 1, 8],
            got: vec![3, 2, 1, 8],
        }
    );
    assert!(out.iter().all(|&v| v == 0.0));
    // Head dim below the table's rotary dim: the slice API's error.
    let mut x = Array3::<f32>::ones((3, 1, 4));
    let err = nd::apply_rope(
        x.view_mut(),
        &t,
        &NdRopeArgs::new(QkvFormat::Thd, RopeConvention::HalfSplit).with_cu_seqlens(&cu),
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            KernelError::InvalidArgument {
                arg: "head_dim",
                ..
            }
        ),
        "{err:?}"
    );
}

/// A paged save through views equals the slice API: `k` and `v` sliced out
/// of one fused `[.., 2 * h_kv, d]` tensor, a permuted page table, and a
/// non-standard (head-dim sliced) value cache.
#[test]
fn save_kv_on_sliced_views_equals_slice_api() {
    let (h, dk, dv, ps, pages) = (2usize, 4usize, 4usize, 3usize, 7usize);
    let step_lens = [2usize, 0, 3];
    let cached = [4usize, 1, 0];
    let cu = [0, 2, 2, 5];
    let seqlens: Vec<i32> = cached
        .iter()
        .zip(&step_lens)
        .map(|(c, s)| (c + s) as i32)
        .collect();
    // Page table [b = 3, 2 pages]: stored transposed, seen as [b, 2].
    let pt_t = Array2::from_shape_vec((2, 3), vec![5, 2, 0, 1, 6, 3]).unwrap();
    let pt = pt_t.t();
    assert!(!pt.is_standard_layout());
    let pt_flat: Vec<i32> = pt.iter().copied().collect();
    for format in [QkvFormat::Bshd, QkvFormat::Sbhd, QkvFormat::Thd] {
        let lead: Vec<usize> = match format {
            QkvFormat::Bshd => vec![3, 3],
            QkvFormat::Sbhd => vec![3, 3],
            QkvFormat::Thd => vec![6],
        };
        let n = lead.len() + 2;
        let mut fused_shape = lead.clone();
        fused_shape.extend([2 * h, dk]);
        let fused = random(IxDyn(&fused_shape), 11);
        let k = fused.slice_axis(Axis(n - 2), (0..h).into());
        let v = fused.slice_axis(Axis(n - 2), (h..2 * h).into());
        let kc0 = random((pages, ps, h, dk), 12);
        // v_cache: the first dv of a 2 * dv head dim.
        let vc0 = random((pages, ps, h, 2 * dv), 13);

        // The slice API on contiguous copies.
        let (k_flat, v_flat): (Vec<f32>, Vec<f32>) =
            (k.iter().copied().collect(), v.iter().copied().collect());
        let mut kc_want: Vec<f32> = kc0.iter().copied().collect();
        let mut vc_want: Vec<f32> = vc0.slice(s![.., .., .., ..dv]).iter().copied().collect();
        let layout = KvCacheLayout {
            num_heads_kv: h,
            head_dim_k: dk,
            head_dim_v: dv,
            page_size: ps,
            page_table: &pt_flat,
            max_pages_per_seq: 2,
            cache_seqlens: &seqlens,
            ring_len: None,
        };
        let step = KvStep {
            format,
            cu_seqlens: &cu,
            max_seqlen: if format == QkvFormat::Thd { 0 } else { 3 },
        };
        save_kv_cpu(&k_flat, &v_flat, &mut kc_want, &mut vc_want, &layout, &step).unwrap();

        let (mut kc, mut vc) = (kc0.clone(), vc0.clone());
        let vc_view = vc.slice_mut(s![.., .., .., ..dv]);
        assert!(!vc_view.is_standard_layout());
        nd::save_kv(
            k,
            v,
            kc.view_mut(),
            vc_view,
            &NdSaveArgs {
                format,
                cu_seqlens: &cu,
                page_table: pt,
                cache_seqlens: &seqlens,
                ring_len: None,
            },
        )
        .unwrap();
        assert_eq!(kc.iter().copied().collect::<Vec<_>>(), kc_want, "{format}");
        assert_eq!(
            vc.slice(s![.., .., .., ..dv])
                .iter()
                .copied()
                .collect::<Vec<_>>(),
            vc_want,
            "{format}"
        );
        // The rest of the value buffer is untouched.
        assert_eq!(
            vc.slice(s![.., .., .., dv..]),
            vc0.slice(s![.., .., .., dv..])
        );
        // Something was written (the test is not vacuous).
        assert_ne!(kc, kc0);
    }
}

#[test]
fn save_kv_shape_errors_name_the_argument() {
    let cu = [0, 1];
    let seqlens = [1];
    let pt = Array2::from_elem((1, 1), 0);
    let args = NdSaveArgs {
        format: QkvFormat::Bshd,
        cu_seqlens: &cu,
        page_table: pt.view(),
        cache_seqlens: &seqlens,
        ring_len: None,
    };
    let k = Array4::<f32>::ones((1, 1, 2, 4));
    let mut kc = Array4::<f32>::zeros((1, 4, 2, 4));
    let mut vc = Array4::<f32>::zeros((1, 4, 2, 4));
    // v with 3 heads where the cache has 2.
    let v = Array4::<f32>::ones((1, 1, 3, 4));
    let err = nd::save_kv(k.view(), v.view(), kc.view_mut(), vc.view_mut(), &args).unwrap_err();
    assert_eq!(
        err,
        KernelError::ShapeMismatch {
            op: "save_kv",
            arg: "v",
            expected: vec![1, 1, 2, 4],
            got: vec![1, 1, 3, 4],
        }
    );
    // A 3-axis cache.
    let mut kc3 = Array3::<f32>::zeros((4, 2, 4));
    let mut vc3 = Array3::<f32>::zeros((4, 2, 4));
    let err = nd::save_kv(k.view(), k.view(), kc3.view_mut(), vc3.view_mut(), &args).unwrap_err();
    assert!(
        matches!(&err, KernelError::InvalidArgument { arg: "k_cache", reason, .. } if reason.contains("[4, 2, 4]")),
        "{err:?}"
    );
    // k's batch differs from cache_seqlens'.
    let k2 = Array4::<f32>::ones((2, 1, 2, 4));
    let err = nd::save_kv(k2.view(), k2.view(), kc.view_mut(), vc.view_mut(), &args).unwrap_err();
    assert_eq!(
        err,
        KernelError::ShapeMismatch {
            op: "save_kv",
            arg: "k",
            expected: vec![1, 1, 2, 4],
            got: vec![2, 1, 2, 4],
        }
    );
    assert!(kc.iter().chain(vc.iter()).all(|&x| x == 0.0));
    // And the good call writes.
    nd::save_kv(k.view(), k.view(), kc.view_mut(), vc.view_mut(), &args).unwrap();
    assert_eq!(kc.slice(s![0, 0, .., ..]), Array2::<f32>::ones((2, 4)));
    assert_eq!(kc.slice(s![0, 1.., .., ..]).sum(), 0.0);
}

#[test]
fn thd_bshd_conversions_on_permuted_views_equal_slice_api() {
    let (h, d, s) = (2usize, 3usize, 4usize);
    let cu = [0, 3, 3, 7];
    let args = ConvertArgs {
        cu_seqlens: &cu,
        num_heads: h,
        head_dim: d,
        max_seqlen: s,
    };
    // thd input [8, h, d] stored as [d, h, 8] and permuted back.
    let thd_store = random(IxDyn(&[d, h, 8]), 21);
    let thd = thd_store.view().permuted_axes(IxDyn(&[2, 1, 0]));
    let thd_flat: Vec<f32> = thd.iter().copied().collect();
    let mut want = vec![POISON; 3 * s * h * d];
    convert_thd_to_bshd(&thd_flat, &mut want, &args).unwrap();
    // Output: bshd seen through sbhd memory.
    let mut sbhd = Array::from_elem((s, 3, h, d), POISON);
    nd::convert_thd_to_bshd(thd, sbhd.view_mut().permuted_axes([1, 0, 2, 3]), &cu).unwrap();
    let got: Vec<f32> = sbhd
        .view()
        .permuted_axes([1, 0, 2, 3])
        .iter()
        .copied()
        .collect();
    assert_eq!(got, want);

    // And back, from the permuted bshd view into a sliced thd view.
    let bshd = sbhd.view().permuted_axes([1, 0, 2, 3]);
    let bshd_flat: Vec<f32> = bshd.iter().copied().collect();
    let mut back_want = vec![POISON; 8 * h * d];
    convert_bshd_to_thd(&bshd_flat, &mut back_want, &args).unwrap();
    let mut wide = Array::from_elem((8, h, 2 * d), POISON);
    nd::convert_bshd_to_thd(bshd, wide.slice_mut(s![.., .., ..d]), &cu).unwrap();
    let got: Vec<f32> = wide.slice(s![.., .., ..d]).iter().copied().collect();
    assert_eq!(got, back_want);
    assert!(wide.slice(s![.., .., d..]).iter().all(|&x| x == POISON));
    // Round trip restores the packed rows.
    assert_eq!(&got[..7 * h * d], &thd_flat[..7 * h * d]);
}

#[test]
fn conversion_shape_errors_name_the_argument() {
    let cu = [0, 2, 3];
    let thd = Array3::<f32>::ones((3, 2, 4));
    // bshd with the wrong batch.
    let mut bshd = Array4::<f32>::zeros((3, 2, 2, 4));
    let err = nd::convert_thd_to_bshd(thd.view(), bshd.view_mut(), &cu).unwrap_err();
    assert_eq!(
        err,
        KernelError::ShapeMismatch {
            op: "convert_thd_to_bshd",
            arg: "bshd",
            expected: vec![2, 2, 2, 4],
            got: vec![3, 2, 2, 4],
        }
    );
    // thd of rank 2.
    let flat = Array2::<f32>::ones((3, 8));
    let mut bshd = Array4::<f32>::zeros((2, 2, 2, 4));
    let err = nd::convert_thd_to_bshd(flat.view(), bshd.view_mut(), &cu).unwrap_err();
    assert!(
        matches!(&err, KernelError::InvalidArgument { arg: "thd", reason, .. } if reason.contains("[t, h, d]") && reason.contains("[3, 8]")),
        "{err:?}"
    );
    // thd output with fewer rows than packed tokens.
    let mut short = Array3::<f32>::zeros((2, 2, 4));
    let err = nd::convert_bshd_to_thd(bshd.view(), short.view_mut(), &cu).unwrap_err();
    assert_eq!(
        err,
        KernelError::ShapeMismatch {
            op: "convert_bshd_to_thd",
            arg: "thd",
            expected: vec![3, 2, 4],
            got: vec![2, 2, 4],
        }
    );
    assert!(bshd.iter().all(|&x| x == 0.0));
}
