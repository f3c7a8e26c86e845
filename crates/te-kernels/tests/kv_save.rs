//! KV-cache save and thd <-> bshd conversions against naive references
//! written here.

use proptest::prelude::*;
use rand::{seq::SliceRandom, Rng, SeedableRng};
use te_kernels::{
    convert_bshd_to_thd, convert_thd_to_bshd, save_kv_cpu, ConvertArgs, KvCacheLayout, KvStep,
    QkvFormat,
};

const POISON: f32 = -12345.0;

/// One random save: sequences with `cached` old tokens and `step` new ones.
#[derive(Clone, Debug)]
struct Case {
    format: QkvFormat,
    cached: Vec<usize>,
    step: Vec<usize>,
    h: usize,
    dk: usize,
    dv: usize,
    page_size: usize,
    seed: u64,
}

impl Case {
    fn batch(&self) -> usize {
        self.step.len()
    }
    fn max_step(&self) -> usize {
        self.step.iter().copied().max().unwrap_or(0)
    }
    fn cu(&self) -> Vec<i32> {
        let mut cu = vec![0i32];
        for &l in &self.step {
            cu.push(cu.last().unwrap() + l as i32);
        }
        cu
    }
    fn seqlens(&self) -> Vec<i32> {
        self.cached
            .iter()
            .zip(&self.step)
            .map(|(c, s)| (c + s) as i32)
            .collect()
    }
    fn rows(&self) -> usize {
        match self.format {
            QkvFormat::Thd => self.step.iter().sum(),
            _ => self.batch() * self.max_step(),
        }
    }
    /// Input row of new token i of sequence b, from the format definitions.
    fn src_row(&self, b: usize, i: usize) -> usize {
        match self.format {
            QkvFormat::Bshd => b * self.max_step() + i,
            QkvFormat::Sbhd => i * self.batch() + b,
            QkvFormat::Thd => self.step[..b].iter().sum::<usize>() + i,
        }
    }
    fn pages_per_seq(&self) -> usize {
        let longest = self.seqlens().into_iter().max().unwrap_or(0) as usize;
        longest.div_ceil(self.page_size).max(1)
    }
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        prop_oneof![
            Just(QkvFormat::Bshd),
            Just(QkvFormat::Sbhd),
            Just(QkvFormat::Thd)
        ],
        proptest::collection::vec((0usize..12, 0usize..6), 1..6),
        1usize..4,
        1usize..9,
        1usize..9,
        prop_oneof![Just(1usize), 2usize..6, Just(16)],
        any::<u64>(),
    )
        .prop_map(|(format, lens, h, dk, dv, page_size, seed)| Case {
            format,
            cached: lens.iter().map(|l| l.0).collect(),
            step: lens.iter().map(|l| l.1).collect(),
            h,
            dk,
            dv,
            page_size,
            seed,
        })
}

fn random(n: usize, rng: &mut impl Rng) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

/// Runs a paged save with shuffled physical pages and checks the whole cache
/// against a naive expectation; returns the cache for further checks.
/// A saved cache and the page table it was saved with.
struct Saved {
    k_cache: Vec<f32>,
    page_table: Vec<i32>,
    pages_per_seq: usize,
}

fn paged_save(case: &Case) -> Result<Saved, TestCaseError> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(case.seed);
    let (b, h, dk, dv, ps) = (case.batch(), case.h, case.dk, case.dv, case.page_size);
    let mpp = case.pages_per_seq();
    let num_pages = b * mpp + 2;
    let mut pages: Vec<i32> = (0..num_pages as i32).collect();
    pages.shuffle(&mut rng);
    let page_table: Vec<i32> = pages[..b * mpp].to_vec();
    // Data from its own generator, independent of the page shuffle.
    let mut data_rng = rand::rngs::StdRng::seed_from_u64(case.seed ^ 1);
    let k = random(case.rows() * h * dk, &mut data_rng);
    let v = random(case.rows() * h * dv, &mut data_rng);
    let mut k_cache = vec![POISON; num_pages * ps * h * dk];
    let mut v_cache = vec![POISON; num_pages * ps * h * dv];
    let seqlens = case.seqlens();
    let layout = KvCacheLayout {
        num_heads_kv: h,
        head_dim_k: dk,
        head_dim_v: dv,
        page_size: ps,
        page_table: &page_table,
        max_pages_per_seq: mpp,
        cache_seqlens: &seqlens,
        ring_len: None,
    };
    let cu = case.cu();
    let step = KvStep {
        format: case.format,
        cu_seqlens: &cu,
        max_seqlen: case.max_step(),
    };
    save_kv_cpu(&k, &v, &mut k_cache, &mut v_cache, &layout, &step).unwrap();
    let mut want_k = vec![POISON; k_cache.len()];
    let mut want_v = vec![POISON; v_cache.len()];
    for s in 0..b {
        for i in 0..case.step[s] {
            let pos = case.cached[s] + i;
            let page = page_table[s * mpp + pos / ps] as usize;
            let row = page * ps + pos % ps;
            let src = case.src_row(s, i);
            want_k[row * h * dk..][..h * dk].copy_from_slice(&k[src * h * dk..][..h * dk]);
            want_v[row * h * dv..][..h * dv].copy_from_slice(&v[src * h * dv..][..h * dv]);
        }
    }
    prop_assert_eq!(&k_cache, &want_k);
    prop_assert_eq!(&v_cache, &want_v);
    Ok(Saved {
        k_cache,
        page_table,
        pages_per_seq: mpp,
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn paged_save_matches_reference(case in case_strategy()) {
        paged_save(&case)?;
    }

    /// A paged copy followed by a gather of every sequence equals a
    /// contiguous copy (page_size = max_seqlen, one page per sequence).
    #[test]
    fn paged_then_gather_equals_contiguous(case in case_strategy()) {
        let max_seqlen = case.pages_per_seq() * case.page_size;
        let contiguous = Case { page_size: max_seqlen, ..case.clone() };
        let gather = |c: &Case| -> Result<Vec<f32>, TestCaseError> {
            let Saved { k_cache, page_table, pages_per_seq: mpp } = paged_save(c)?;
            let row = c.h * c.dk;
            let mut out = vec![POISON; c.batch() * max_seqlen * row];
            for s in 0..c.batch() {
                for pos in 0..c.cached[s] + c.step[s] {
                    let r = page_table[s * mpp + pos / c.page_size] as usize * c.page_size + pos % c.page_size;
                    out[(s * max_seqlen + pos) * row..][..row].copy_from_slice(&k_cache[r * row..][..row]);
                }
            }
            Ok(out)
        };
        prop_assert_eq!(gather(&case)?, gather(&contiguous)?);
    }

    #[test]
    fn thd_bshd_round_trip(lens in proptest::collection::vec(0usize..7, 1..6), h in 1usize..3, d in 1usize..5, extra in 0usize..3, seed in any::<u64>()) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut cu = vec![0i32];
        for &l in &lens { cu.push(cu.last().unwrap() + l as i32); }
        let s = lens.iter().copied().max().unwrap() + extra;
        let t = *cu.last().unwrap() as usize + extra;
        let row = h * d;
        let thd = random(t * row, &mut rng);
        let args = ConvertArgs { cu_seqlens: &cu, num_heads: h, head_dim: d, max_seqlen: s };
        let mut bshd = vec![POISON; lens.len() * s * row];
        convert_thd_to_bshd(&thd, &mut bshd, &args).unwrap();
        for b in 0..lens.len() {
            for i in 0..s {
                let got = &bshd[(b * s + i) * row..][..row];
                if i < lens[b] {
                    let src = cu[b] as usize + i;
                    prop_assert_eq!(got, &thd[src * row..][..row]);
                } else {
                    prop_assert!(got.iter().all(|&x| x == 0.0));
                }
            }
        }
        let mut back = vec![POISON; t * row];
        convert_bshd_to_thd(&bshd, &mut back, &args).unwrap();
        let valid = *cu.last().unwrap() as usize * row;
        prop_assert_eq!(&back[..valid], &thd[..valid]);
        prop_assert!(back[valid..].iter().all(|&x| x == 0.0));
    }
}

fn layout<'a>(
    page_table: &'a [i32],
    seqlens: &'a [i32],
    mpp: usize,
    ps: usize,
    ring: Option<usize>,
) -> KvCacheLayout<'a> {
    KvCacheLayout {
        num_heads_kv: 1,
        head_dim_k: 2,
        head_dim_v: 1,
        page_size: ps,
        page_table,
        max_pages_per_seq: mpp,
        cache_seqlens: seqlens,
        ring_len: ring,
    }
}

#[test]
fn page_size_one_and_max_seqlen() {
    for ps in [1usize, 8] {
        let mpp = 8 / ps;
        // Sequence 0 has pages 0..mpp reversed; sequence 1 the next ones.
        let page_table: Vec<i32> = (0..2 * mpp as i32).rev().collect();
        let seqlens = [8, 3];
        let cu = [0, 2, 5];
        let k: Vec<f32> = (0..10).map(|x| x as f32).collect();
        let v: Vec<f32> = (0..5).map(|x| 100.0 + x as f32).collect();
        let mut kc = vec![POISON; 2 * mpp * ps * 2];
        let mut vc = vec![POISON; 2 * mpp * ps];
        let step = KvStep {
            format: QkvFormat::Thd,
            cu_seqlens: &cu,
            max_seqlen: 0,
        };
        save_kv_cpu(
            &k,
            &v,
            &mut kc,
            &mut vc,
            &layout(&page_table, &seqlens, mpp, ps, None),
            &step,
        )
        .unwrap();
        // Sequence 0's new tokens are positions 6 and 7; sequence 1's 0..3.
        let row = |b: usize, pos: usize| page_table[b * mpp + pos / ps] as usize * ps + pos % ps;
        for (b, pos, src) in [(0, 6, 0), (0, 7, 1), (1, 0, 2), (1, 1, 3), (1, 2, 4)] {
            assert_eq!(
                vc[row(b, pos)],
                100.0 + src as f32,
                "ps {ps} seq {b} pos {pos}"
            );
            assert_eq!(
                kc[2 * row(b, pos)..2 * row(b, pos) + 2],
                [2.0 * src as f32, 2.0 * src as f32 + 1.0]
            );
        }
        assert_eq!(vc.iter().filter(|&&x| x != POISON).count(), 5);
    }
}

#[test]
fn sliding_window_keeps_last_ring_len_tokens() {
    // ring_len 4, page_size 2: positions 0..6 of a 6-token prefill; only
    // positions 2..6 are written, position p into logical slot p % 4.
    let page_table = [1, 0];
    let seqlens = [6];
    let cu = [0, 6];
    let k: Vec<f32> = (0..12).map(|x| x as f32).collect();
    let v: Vec<f32> = (0..6).map(|x| x as f32).collect();
    let mut kc = vec![POISON; 8];
    let mut vc = vec![POISON; 4];
    let step = KvStep {
        format: QkvFormat::Thd,
        cu_seqlens: &cu,
        max_seqlen: 0,
    };
    save_kv_cpu(
        &k,
        &v,
        &mut kc,
        &mut vc,
        &layout(&page_table, &seqlens, 2, 2, Some(4)),
        &step,
    )
    .unwrap();
    // Slots: pos 4 -> 0 (page 1 row 0 = row 2), 5 -> 1 (row 3), 2 -> 2 (page 0 row 0), 3 -> 3 (row 1).
    assert_eq!(vc, [2.0, 3.0, 4.0, 5.0]);
}

#[test]
fn bad_arguments_are_errors() {
    let cu = [0, 2];
    let step = KvStep {
        format: QkvFormat::Thd,
        cu_seqlens: &cu,
        max_seqlen: 0,
    };
    let (k, v) = (vec![0f32; 4], vec![0f32; 2]);
    let (mut kc, mut vc) = (vec![POISON; 8], vec![POISON; 4]);
    let cases: Vec<(&[i32], &[i32], usize)> = vec![
        (&[0, 1], &[1], 2), // cache_seqlens below the step length
        (&[5, 0], &[2], 2), // page id outside the cache
        (&[0, 1], &[6], 2), // position past max_pages_per_seq
        (&[0], &[2], 2),    // page table too short
    ];
    for (pt, seqlens, mpp) in cases {
        let err = save_kv_cpu(
            &k,
            &v,
            &mut kc,
            &mut vc,
            &layout(pt, seqlens, mpp, 2, None),
            &step,
        );
        assert!(err.is_err(), "{pt:?} {seqlens:?}");
    }
    // Two sequences sharing a page write the same row.
    let cu2 = [0, 1, 2];
    let step2 = KvStep {
        format: QkvFormat::Thd,
        cu_seqlens: &cu2,
        max_seqlen: 0,
    };
    let err = save_kv_cpu(
        &k,
        &v,
        &mut kc,
        &mut vc,
        &layout(&[0, 0], &[1, 1], 1, 2, None),
        &step2,
    )
    .unwrap_err();
    assert!(err.to_string().contains("same cache row"), "{err}");
    assert!(kc.iter().all(|&x| x == POISON), "nothing written on error");
    // Wrong k length.
    let err = save_kv_cpu(
        &k[..3],
        &v,
        &mut kc,
        &mut vc,
        &layout(&[0, 1], &[2], 2, 2, None),
        &step,
    )
    .unwrap_err();
    assert!(err.to_string().contains("`k`"), "{err}");
}
