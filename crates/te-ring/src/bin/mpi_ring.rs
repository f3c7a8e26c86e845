//! Checks te-ring over MPI: run with `mpirun -np N mpi_ring [MODE]`.
//!
//! - `check` (default): `all_gather`, `all_reduce_min` and `agree`
//!   against hand-computed results, a causal `RingAttention::forward_cpu`
//!   (f32 and bf16) against single-rank attention computed on every rank,
//!   and `all_merge` against attention over all keys. Rank 0 prints "ok".
//! - `mismatch`: the last rank agrees on other settings; every rank must
//!   fail naming it. Rank 0 prints "ok".
//! - `gather-mismatch`: the last rank gathers 4 MiB under another op;
//!   every rank must fail, and exit without hanging on the large sends.
//!   Rank 0 prints "ok".
//! - `oversized`: rank 0 sends a block larger than the others' receives
//!   expect; every rank must fail naming rank 0 and the size, without
//!   receiving it. Rank 0 prints "ok".
//! - `wait`: every rank prints "rank R pid P waiting" and blocks in a
//!   receive nobody sends (for the kill test).
//!
//! Exits non-zero on any failure, naming the rank.

use std::process::ExitCode;

use te_attention::{AttnMaskType, AttnMetadata, AttnOutput, DotProductAttention, KvInput};
use te_kernels::half::bf16;
use te_kernels::{Element, QkvFormat};
use te_ring::{
    agree, all_gather, all_merge, all_reduce_min, Block, Communicator, MpiComm, RingAttention,
    Zigzag, MAX_MARKER_BYTES,
};

type Check = Result<(), String>;

fn main() -> ExitCode {
    let mode = std::env::args().nth(1).unwrap_or_else(|| "check".into());
    let mut comm = match MpiComm::world() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("mpi_ring: {e}");
            return ExitCode::FAILURE;
        }
    };
    let rank = comm.cp_rank();
    let result = match mode.as_str() {
        "check" => check(&mut comm),
        "mismatch" => mismatch(&mut comm),
        "gather-mismatch" => gather_mismatch(&mut comm),
        "oversized" => oversized(&mut comm),
        "wait" => wait(&mut comm),
        other => Err(format!("unknown mode {other:?}")),
    };
    match result {
        Ok(()) => {
            if rank == 0 {
                println!("ok");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("mpi_ring: rank {rank}: {e}");
            ExitCode::FAILURE
        }
    }
}

fn check(comm: &mut MpiComm) -> Check {
    let (r, n) = (comm.cp_rank(), comm.cp_size());
    // Rank r contributes r + 1 copies of r.
    let all = all_gather(comm, "gather", &[1, 2], &vec![r as u32; r + 1]).map_err(s)?;
    let want: Vec<Vec<u32>> = (0..n).map(|i| vec![i as u32; i + 1]).collect();
    expect(all == want, || format!("all_gather gave {all:?}"))?;

    let mut v = [10 + r as u64, 100 - r as u64, (r * r) as u64];
    all_reduce_min(comm, "min", &mut v).map_err(s)?;
    let want = [10, 100 - (n as u64 - 1), 0];
    expect(v == want, || {
        format!("all_reduce_min gave {v:?}, want {want:?}")
    })?;

    agree(comm, "settings", &[1, 2, 3]).map_err(s)?;
    ring_forward::<f32>(comm, 1e-5)?;
    ring_forward::<bf16>(comm, 1e-4)?;
    merge(comm)
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Causal ring attention over two sequences against `DotProductAttention`
/// on the full sequences, computed on every rank; outputs gathered from
/// every rank.
fn ring_forward<T: Element>(comm: &mut MpiComm, tol: f32) -> Check {
    let (r, n) = (comm.cp_rank(), comm.cp_size());
    let (h, d, seqlens) = (2, 8, [13usize, 5]);
    let total: usize = seqlens.iter().sum();
    let attn = DotProductAttention::new(h, d).with_attn_mask_type(AttnMaskType::Causal);
    let full: [Vec<T>; 3] = [1, 2, 3].map(|seed| {
        values(total * h * d, seed)
            .into_iter()
            .map(T::from_f32)
            .collect()
    });

    // Reference: one rank, the whole sequences (thd).
    let mut cu = vec![0i32];
    for &len in &seqlens {
        cu.push(cu.last().unwrap() + len as i32);
    }
    let meta = AttnMetadata {
        batch: seqlens.len(),
        max_seqlen_q: 13,
        max_seqlen_kv: 13,
        cu_seqlens_q: Some(&cu),
        cu_seqlens_kv: Some(&cu),
    };
    let mut want = vec![0f32; total * h * d];
    attn.clone()
        .with_formats(QkvFormat::Thd, QkvFormat::Thd)
        .forward_cpu(
            &full[0],
            KvInput::Tensors {
                k: &full[1],
                v: &full[2],
            },
            &meta,
            &mut want,
            None,
        )
        .map_err(s)?;

    let z = Zigzag::new(n).map_err(s)?;
    let [q, k, v] = [0, 1, 2].map(|i| z.shard(&full[i], h * d, &seqlens, r));
    let (q, k, v) = (q.map_err(s)?, k.map_err(s)?, v.map_err(s)?);
    let mut out = vec![f32::NAN; q.len()];
    let ring = RingAttention::new(attn).map_err(s)?;
    let output = AttnOutput {
        out: &mut out,
        lse: None,
    };
    ring.forward_cpu(comm, &seqlens, &q, &k, &v, output)
        .map_err(s)?;
    let shards = all_gather(comm, "ring_out", &[], &out).map_err(s)?;
    let shards: Vec<&[f32]> = shards.iter().map(Vec::as_slice).collect();
    let got = z.unshard(&shards, h * d, &seqlens).map_err(s)?;
    close(&got, &want, tol, T::DTYPE.to_string().as_str())
}

/// Decode with keys split by rank: partials merged by `all_merge` against
/// attention over all keys.
fn merge(comm: &mut MpiComm) -> Check {
    let (r, n) = (comm.cp_rank(), comm.cp_size());
    let (h, d, t, skv) = (2, 8, 3, 10);
    let attn = DotProductAttention::new(h, d)
        .with_attn_mask_type(AttnMaskType::NoMask)
        .with_formats(QkvFormat::Thd, QkvFormat::Thd);
    let q = values(t * h * d, 4);
    let (k, v) = (values(skv * h * d, 5), values(skv * h * d, 6));
    let run = |k: &[f32], v: &[f32]| {
        let rows = k.len() / (h * d);
        let (cu_q, cu_kv) = ([0, t as i32], [0, rows as i32]);
        let meta = AttnMetadata {
            batch: 1,
            max_seqlen_q: t,
            max_seqlen_kv: rows,
            cu_seqlens_q: Some(&cu_q),
            cu_seqlens_kv: Some(&cu_kv),
        };
        let (mut out, mut lse) = (vec![0f32; t * h * d], vec![0f32; h * t]);
        attn.forward_cpu(
            &q,
            KvInput::Tensors { k, v },
            &meta,
            &mut out,
            Some(&mut lse),
        )
        .map(|()| (out, lse))
    };
    let (want, _) = run(&k, &v).map_err(s)?;
    // Rank r holds keys r * skv / n .. (r + 1) * skv / n.
    let (a, b) = (r * skv / n * h * d, (r + 1) * skv / n * h * d);
    let (mut out, mut lse) = run(&k[a..b], &v[a..b]).map_err(s)?;
    all_merge(comm, &mut out, &mut lse, h, d).map_err(s)?;
    close(&out, &want, 1e-5, "all_merge")
}

fn mismatch(comm: &mut MpiComm) -> Check {
    let last = comm.cp_size() - 1;
    let words: &[u64] = if comm.cp_rank() == last {
        &[1, 2, 4]
    } else {
        &[1, 2, 3]
    };
    match agree(comm, "settings", words) {
        Ok(()) => Err("agree accepted different settings".into()),
        Err(e) => {
            let want = format!("rank {last} runs other settings: word 2 is 4 where rank 0 has 3");
            expect(e.to_string().ends_with(&want), || {
                format!("agree failed with {e}")
            })
        }
    }
}

fn gather_mismatch(comm: &mut MpiComm) -> Check {
    let odd = comm.cp_rank() == comm.cp_size() - 1;
    let big = vec![7u8; 4 << 20];
    match all_gather(comm, if odd { "b" } else { "a" }, &[], &big) {
        Ok(_) => Err("all_gather mixed calls".into()),
        Err(e) => {
            let text = e.to_string();
            expect(text.contains("another call"), || {
                format!("all_gather failed with {text}")
            })
        }
    }
}

fn oversized(comm: &mut MpiComm) -> Check {
    // Over the abort marker's size, under MPI's eager limits (the unreceived
    // send completes on its own).
    let size = MAX_MARKER_BYTES + 100;
    if comm.cp_rank() == 0 {
        comm.send_next(Block::from_slice(1, &vec![0u8; size]))
            .map_err(s)?;
    }
    match comm.recv_prev(64) {
        Ok(_) => Err("received an oversized block".into()),
        Err(e) => {
            let want = format!(
                "rank 0 failed: it sent a block of {size} bytes where this step expects at most 64"
            );
            expect(e.to_string().ends_with(&want), || {
                format!("the receive failed with {e}")
            })
        }
    }
}

fn wait(comm: &mut MpiComm) -> Check {
    println!("rank {} pid {} waiting", comm.cp_rank(), std::process::id());
    match comm.recv_prev(usize::MAX) {
        Ok(_) => Err("received a block nobody sent".into()),
        Err(e) => Err(e.to_string()),
    }
}

fn s(e: impl std::fmt::Display) -> String {
    e.to_string()
}

fn expect(ok: bool, msg: impl FnOnce() -> String) -> Check {
    if ok {
        Ok(())
    } else {
        Err(msg())
    }
}

/// `got` within `tol * (1 + |want|)` of `want`, element by element.
fn close(got: &[f32], want: &[f32], tol: f32, what: &str) -> Check {
    expect(got.len() == want.len(), || {
        format!("{what}: {} values, want {}", got.len(), want.len())
    })?;
    match got
        .iter()
        .zip(want)
        .position(|(g, w)| (g - w).abs().is_nan() || (g - w).abs() > tol * (1.0 + w.abs()))
    {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what}: element {i} is {} want {}",
            got[i], want[i]
        )),
    }
}
