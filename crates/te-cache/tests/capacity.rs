//! Memory accounting and error reporting with hand-computed expectations.

use half::{bf16, f16};
use te_cache::{CacheError, CacheLayout, CacheShape, InferenceParams};
use te_kernels::{DType, QkvFormat};

fn paged(page_size: usize, total_num_pages: usize) -> CacheLayout {
    CacheLayout::Paged {
        page_size,
        total_num_pages,
    }
}

/// 64 sequences of 16 tokens and one of 4000 fit in a pool of 5024 tokens
/// plus page rounding; TransformerEngine's paged manager would reserve
/// 65 x 4000 tokens.
#[test]
fn ragged_batch_fits_pool_sized_for_its_tokens() {
    for page_size in [1usize, 16, 64] {
        let pages = 64 * 16usize.div_ceil(page_size) + 4000usize.div_ceil(page_size);
        let mut params = InferenceParams::new(CacheShape {
            max_batch_size: 65,
            max_seqlen: 4000,
            num_layers: 2,
            num_heads_kv: 1,
            head_dim_k: 1,
            head_dim_v: 1,
            dtype: DType::F32,
            layout: paged(page_size, pages),
        })
        .unwrap();
        let mut steps: Vec<(u64, usize)> = (0..64).map(|id| (id, 16)).collect();
        steps.push((64, 4000));
        params.pre_step(&steps).unwrap();
        assert_eq!(params.tokens_cached(), 5024);
        assert_eq!(params.pages_in_use(0).unwrap(), pages);
        assert_eq!(params.pages_free(0).unwrap(), 0);
        assert!(pages * page_size < 5024 + 65 * page_size);
        assert!(pages * page_size * 10 < 65 * 4000);

        // One more token for a short sequence needs a new page when 16 is a
        // multiple of page_size: refused, nothing changes. Otherwise it fits
        // in the page's rounding slack.
        let before = params.clone();
        match params.pre_step(&[(0, 1)]) {
            Err(err) => {
                assert_eq!(16 % page_size, 0);
                assert_eq!(
                    err,
                    CacheError::CacheFull {
                        layer: 0,
                        page_size,
                        pages_needed: 1,
                        pages_free: 0
                    }
                );
                assert!(params == before);
            }
            Ok(()) => assert_ne!(16 % page_size, 0),
        }

        // Releasing the long sequence returns its pages.
        params.release(64).unwrap();
        assert_eq!(params.pages_free(0).unwrap(), 4000usize.div_ceil(page_size));
        params.pre_step(&[(0, 1)]).unwrap();
        assert_eq!(
            params.cached_tokens(0),
            17 + usize::from(16 % page_size != 0)
        );
    }
}

/// Gemma 3: 5 of 6 layers slide with window 512. With steps of at most 512
/// tokens each ring holds round_up(511 + 512, 16) = 1024 rows, so at 32k
/// context the cache is (5 * 1024 + 32768) / (6 * 32768) = 0.193 of a full one.
#[test]
fn gemma3_sliding_layers_cost_a_sixth() {
    let (max_batch, max_seqlen) = (2, 32768);
    for layout in [
        CacheLayout::Contiguous,
        paged(16, max_batch * max_seqlen / 16),
    ] {
        let full = InferenceParams::new(CacheShape {
            max_batch_size: max_batch,
            max_seqlen,
            num_layers: 6,
            num_heads_kv: 1,
            head_dim_k: 4,
            head_dim_v: 4,
            dtype: DType::BF16,
            layout,
        })
        .unwrap();
        let mut gemma = full.clone();
        for layer in (0..6).filter(|l| l % 6 != 5) {
            gemma.set_sliding_window(layer, 512, 512).unwrap();
        }
        let ring = if layout == CacheLayout::Contiguous {
            1023
        } else {
            1024
        };
        assert_eq!(gemma.ring_len(0), Some(ring));
        assert_eq!(gemma.ring_len(5), None);
        let want = (5 * ring + max_seqlen) as f64 / (6 * max_seqlen) as f64;
        let got = gemma.memory_allocated() as f64 / full.memory_allocated() as f64;
        assert!((got - want).abs() < 1e-12, "{got} vs {want}");
        assert!(got < 0.2);

        // A 32k sequence in chunks of 512: sliding layers hold 1024 rows.
        for _ in 0..64 {
            gemma.pre_step(&[(7, 512)]).unwrap();
        }
        assert_eq!(gemma.cached_tokens(7), 32768);
        let err = gemma.pre_step(&[(8, 513)]).unwrap_err();
        assert_eq!(
            err,
            CacheError::StepExceedsWindowRing {
                seq_id: 8,
                step_len: 513,
                layer: 0,
                max_step_len: 512
            }
        );
        assert!(err.to_string().contains("sequence 8"));
    }
}

#[test]
fn contiguous_view_uses_batch_slots() {
    let mut params = InferenceParams::new(CacheShape {
        max_batch_size: 3,
        max_seqlen: 10,
        num_layers: 1,
        num_heads_kv: 1,
        head_dim_k: 1,
        head_dim_v: 1,
        dtype: DType::F32,
        layout: CacheLayout::Contiguous,
    })
    .unwrap();
    params.pre_step(&[(5, 3), (9, 2)]).unwrap();
    params.pre_step(&[(9, 1), (5, 1), (1, 4)]).unwrap();
    assert_eq!(params.cu_seqlens_q(), &[0, 1, 2, 6]);
    assert_eq!(params.cu_seqlens_kv(), &[0, 3, 7, 11]);
    assert_eq!(params.start_positions(), &[2, 3, 0]);
    let view = params
        .step::<f32>(0, &[1.0; 6], &[2.0; 6], QkvFormat::Thd)
        .unwrap();
    assert_eq!(view.layout.page_size, 10);
    assert_eq!(view.layout.max_pages_per_seq, 1);
    assert_eq!(view.layout.page_table, &[1, 0, 2]);
    assert_eq!(view.k_cache.len(), 3 * 10);
    assert_eq!(params.memory_in_use(), 3 * 10 * 2 * 4);
}

#[test]
fn half_precision_storage() {
    let mut params = InferenceParams::new(CacheShape {
        max_batch_size: 2,
        max_seqlen: 8,
        num_layers: 1,
        num_heads_kv: 1,
        head_dim_k: 2,
        head_dim_v: 2,
        dtype: DType::F16,
        layout: paged(4, 4),
    })
    .unwrap();
    params.pre_step(&[(0, 2)]).unwrap();
    let k = [1.5, -2.0, 0.25, 3.0].map(f16::from_f32);
    let v = [0.5, 1.0, -1.0, 2.0].map(f16::from_f32);
    let view = params.step(0, &k, &v, QkvFormat::Thd).unwrap();
    let r = view.layout.row(0, 1);
    assert_eq!(&view.k_cache[r * 2..r * 2 + 2], &k[2..]);
    let err = params
        .step(0, &[bf16::ZERO; 4], &[bf16::ZERO; 4], QkvFormat::Thd)
        .unwrap_err();
    assert_eq!(
        err,
        CacheError::DTypeMismatch {
            arg: "k",
            expected: DType::F16,
            got: DType::BF16
        }
    );
}

#[test]
fn errors_name_the_offending_argument() {
    let mut params = InferenceParams::new(CacheShape {
        max_batch_size: 2,
        max_seqlen: 8,
        num_layers: 2,
        num_heads_kv: 1,
        head_dim_k: 2,
        head_dim_v: 1,
        dtype: DType::F32,
        layout: paged(4, 3),
    })
    .unwrap();
    assert_eq!(
        params.step::<f32>(0, &[], &[], QkvFormat::Thd).unwrap_err(),
        CacheError::NoStep
    );
    assert_eq!(
        params.pre_step(&[(1, 2), (1, 1)]).unwrap_err(),
        CacheError::DuplicateSequence { seq_id: 1 }
    );
    assert_eq!(
        params.pre_step(&[(1, 1), (2, 1), (3, 1)]).unwrap_err(),
        CacheError::BatchTooLarge {
            batch: 3,
            max_batch_size: 2
        }
    );
    assert_eq!(
        params.pre_step(&[(4, 9)]).unwrap_err(),
        CacheError::ExceedsMaxSeqlen {
            seq_id: 4,
            cached: 0,
            step_len: 9,
            max_seqlen: 8
        }
    );
    assert_eq!(
        params.pre_step(&[(4, 0)]).unwrap_err(),
        CacheError::EmptyStep { seq_id: 4 }
    );
    assert_eq!(
        params.release(4).unwrap_err(),
        CacheError::UnknownSequence { seq_id: 4 }
    );
    params.pre_step(&[(1, 5), (2, 1)]).unwrap();
    assert_eq!(
        params.pre_step(&[(3, 1)]).unwrap_err(),
        CacheError::TooManySequences {
            seq_id: 3,
            live: 2,
            max_batch_size: 2
        }
    );
    assert_eq!(
        params.pre_step(&[(2, 5)]).unwrap_err(),
        CacheError::CacheFull {
            layer: 0,
            page_size: 4,
            pages_needed: 1,
            pages_free: 0
        }
    );
    let err = params
        .step::<f32>(0, &[0.0; 10], &[0.0; 6], QkvFormat::Thd)
        .unwrap_err();
    assert_eq!(
        err,
        CacheError::ShapeMismatch {
            arg: "k",
            expected: vec![6, 1, 2],
            got: 10
        }
    );
    let err = params
        .step::<f32>(0, &[0.0; 20], &[0.0; 9], QkvFormat::Bshd)
        .unwrap_err();
    assert_eq!(
        err,
        CacheError::ShapeMismatch {
            arg: "v",
            expected: vec![2, 5, 1, 1],
            got: 9
        }
    );
    assert_eq!(
        params.step::<f32>(2, &[], &[], QkvFormat::Thd).unwrap_err(),
        CacheError::LayerOutOfRange {
            layer: 2,
            num_layers: 2
        }
    );
    assert_eq!(
        params.set_sliding_window(0, 4, 2).unwrap_err(),
        CacheError::NotEmpty {
            op: "set_sliding_window",
            live: 2
        }
    );
    assert!(matches!(
        InferenceParams::new(CacheShape {
            max_batch_size: 0,
            max_seqlen: 8,
            num_layers: 1,
            num_heads_kv: 1,
            head_dim_k: 1,
            head_dim_v: 1,
            dtype: DType::F32,
            layout: CacheLayout::Contiguous,
        }),
        Err(CacheError::InvalidArgument {
            arg: "max_batch_size",
            ..
        })
    ));
    assert!(matches!(
        InferenceParams::new(CacheShape {
            max_batch_size: 1,
            max_seqlen: 8,
            num_layers: 1,
            num_heads_kv: 1,
            head_dim_k: 1,
            head_dim_v: 1,
            dtype: DType::F32,
            layout: paged(0, 4),
        }),
        Err(CacheError::InvalidArgument {
            arg: "page_size",
            ..
        })
    ));
}

#[test]
fn fork_copies_keys_and_values() {
    for layout in [CacheLayout::Contiguous, paged(2, 8)] {
        let mut params = InferenceParams::new(CacheShape {
            max_batch_size: 3,
            max_seqlen: 8,
            num_layers: 1,
            num_heads_kv: 1,
            head_dim_k: 1,
            head_dim_v: 1,
            dtype: DType::F32,
            layout,
        })
        .unwrap();
        params.pre_step(&[(1, 3)]).unwrap();
        params
            .step(0, &[1.0, 2.0, 3.0], &[4.0, 5.0, 6.0], QkvFormat::Thd)
            .unwrap();
        params.fork(1, 2).unwrap();
        assert_eq!(
            params.fork(1, 2).unwrap_err(),
            CacheError::DuplicateSequence { seq_id: 2 }
        );
        assert_eq!(
            params.fork(9, 3).unwrap_err(),
            CacheError::UnknownSequence { seq_id: 9 }
        );
        params.pre_step(&[(2, 1), (1, 1)]).unwrap();
        let view = params
            .step(0, &[7.0, 8.0], &[9.0, 10.0], QkvFormat::Thd)
            .unwrap();
        let read = |b: usize| -> Vec<f32> {
            (0..4)
                .map(|pos| view.k_cache[view.layout.row(b, pos)])
                .collect()
        };
        assert_eq!(read(0), [1.0, 2.0, 3.0, 7.0]);
        assert_eq!(read(1), [1.0, 2.0, 3.0, 8.0]);
        let v: Vec<f32> = (0..4)
            .map(|pos| view.v_cache[view.layout.row(0, pos)])
            .collect();
        assert_eq!(v, [4.0, 5.0, 6.0, 9.0]);
    }
}
