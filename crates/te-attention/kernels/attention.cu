// Scaled dot-product attention forward (te-attention's CUDA path): tiled
// online softmax for prefill, split-KV with an LSE combine for decode
// (flash-decoding style). Same semantics as `DotProductAttention::forward_cpu`.
//
// Per sequence b, query i, query head h (KV head g = h / group):
//   s_j   = scale * q_i . k_j, then softcap * tanh(s_j / softcap) if softcap > 0
//   keep j in [lo(i), hi(i)]: diag = i + offset_b,
//         lo = max(first_key_b, diag - left (left >= 0), 0),
//         hi = min(skv_b - 1, diag + right (right >= 0))
//   out_i = sum_j softmax(s)_j v_j,   lse_i = ln sum_j exp(s_j)   (natural log)
// A query that sees no key gets out 0 and lse -inf.
//
// Layouts (row = token row in units of heads * dim):
//   q   [q_rows, h_q, d_qk], out [q_rows, h_q, d_v]: row of (b, i) is
//       q_base_b + i * q_stride_b (bshd: b * s + i; sbhd: i * batch + b;
//       thd: cu_seqlens_q[b] + i)
//   lse f32: thd [h_q, q_rows]; bshd/sbhd [b, h_q, max_seqlen_q]
//   k [.., h_kv, d_qk], v [.., h_kv, d_v]: tensors (row kv_base_b + j *
//       kv_stride_b) or a cache [num_pages * page_size, h_kv, d] addressed
//       through the page table (logical slot j, or j % ring_len on a
//       sliding-window layer; page = page_table[b][slot / page_size]).
//   meta i64: [batch, SEQ_FIELDS] per-sequence fields (SeqInfo), then the
//       page table [batch, max_pages_per_seq] (cache only).
//   split partials (num_splits > 1): o_part f32 [num_splits, q_rows, h_q, d_v],
//       lse_part f32 [num_splits, q_rows, h_q], each normalized over its keys.
//
// attn_fwd_<T>: grid (row tiles, h_kv, batch * num_splits), ATTN_THREADS
// threads. A block owns ATTN_ROWS consecutive (query, head-in-group) rows of
// one KV head (row R: query R / group, head g * group + R % group), so GQA
// heads share each K/V tile; the block's key range (the union of its rows',
// both ends non-decreasing in i) is cut into num_splits chunks of whole tiles
// and the block walks chunk `split`. Each K/V tile of ATTN_BC keys is staged
// in shared memory as f32; warp w owns rows 4w..4w+3: lane = key for the
// scores, lane = output columns (lane + 32 k) for o += p v. Rows past a
// sequence's length in bshd/sbhd are written as 0 / -inf.
// attn_decode<R>_<T> (R = 1, 4, 8): the same function for launches of at most
// R (query, head-in-group) rows per (sequence, KV head) (decode, short
// verification chunks) and d_qk, d_v <= DEC_MAX_D. Grid (1, h_kv,
// batch * num_splits), DEC_THREADS threads: the block holds its rows' q in
// shared memory; warp w walks keys klo + w, klo + w + DEC_WARPS, .. of the
// split's chunk straight from global memory (lane = columns lane + 32 k, two
// keys' loads in flight), each with its own online softmax per row; the
// warps' (m, l, acc) are merged by LSE in shared memory at the end. No key
// tile is staged, so a block's bytes are its keys' K and V rows, read once.
// attn_combine_<T>: grid (max query rows, h_q, batch), merges the partials by
// LSE (lse = m + ln sum exp(lse_s - m), out = sum out_s exp(lse_s - lse); the
// n-way form of te-attention's merge.rs).
// All offsets 64-bit.

#include "common.cuh"

#define ATTN_WARPS 4
#define ATTN_ROWS_PER_WARP 4
#define ATTN_ROWS (ATTN_WARPS * ATTN_ROWS_PER_WARP)  // rows per block
#define ATTN_THREADS (ATTN_WARPS * 32)
#define ATTN_BC 32                                   // keys per tile (= lanes)
#define ATTN_MAX_DV 256                              // output columns per row
#define ATTN_DV_PER_LANE (ATTN_MAX_DV / 32)
#define ATTN_SEQ_FIELDS 8
#define DEC_WARPS 4
#define DEC_THREADS (DEC_WARPS * 32)
#define DEC_MAX_D 256                                // d_qk and d_v
#define DEC_PER_LANE (DEC_MAX_D / 32)

// Mirror of `AttnParams` in crates/te-attention/src/cuda.rs.
struct AttnParams {
    long long q_rows;        // rows of q / out (t_q, or b * max_seqlen_q)
    long long ring_len;      // 0: every position held
    long long window_left;   // -1: unbounded
    long long window_right;  // -1: unbounded (0 for causal masks)
    int batch, h_q, h_kv, group, d_qk, d_v;
    int max_seqlen_q;        // bshd/sbhd: out rows per sequence
    int q_thd;               // 1: thd q/out/lse
    int kv_cache;            // 1: K/V from the paged/contiguous cache
    int page_size, max_pages_per_seq;
    int num_splits;
    int has_lse;
    float scale;
    float softcap;           // 0: none
};

// NVRTC has no math.h: -inf and 64-bit min/max spelled out.
__device__ __forceinline__ float neg_inf() { return __uint_as_float(0xff800000u); }
__device__ __forceinline__ long long lmin(long long a, long long b) { return a < b ? a : b; }
__device__ __forceinline__ long long lmax(long long a, long long b) { return a > b ? a : b; }

// One sequence's fields of `meta` (see `seq_fields` on the Rust side).
struct SeqInfo {
    long long sq, skv, first_key, offset, q_base, q_stride, kv_base, kv_stride;
};

__device__ __forceinline__ SeqInfo load_seq(const long long* meta, int b) {
    const long long* m = meta + (long long)b * ATTN_SEQ_FIELDS;
    SeqInfo s;
    s.sq = m[0]; s.skv = m[1]; s.first_key = m[2]; s.offset = m[3];
    s.q_base = m[4]; s.q_stride = m[5]; s.kv_base = m[6]; s.kv_stride = m[7];
    return s;
}

// Visible keys [lo, hi] of query i (empty when lo > hi); KeyRange::bounds.
__device__ __forceinline__ void key_bounds(const AttnParams& p, const SeqInfo& s, long long i,
                                           long long* lo, long long* hi) {
    const long long diag = i + s.offset;
    long long l = s.first_key;
    if (p.window_left >= 0) l = lmax(l, diag - p.window_left);
    long long h = s.skv - 1;
    if (p.window_right >= 0) h = lmin(h, diag + p.window_right);
    *lo = lmax(l, 0);
    *hi = h;
}

// Row of key j of sequence b in K/V (units of h_kv * d).
__device__ __forceinline__ long long kv_row(const AttnParams& p, const long long* meta,
                                            const SeqInfo& s, int b, long long j) {
    if (!p.kv_cache) return s.kv_base + j * s.kv_stride;
    const long long slot = p.ring_len > 0 ? j % p.ring_len : j;
    const long long page =
        meta[(long long)p.batch * ATTN_SEQ_FIELDS + (long long)b * p.max_pages_per_seq + slot / p.page_size];
    return page * p.page_size + slot % p.page_size;
}

// Index of (b, i, h) in lse; q_row = row of (b, i) in q.
__device__ __forceinline__ long long lse_index(const AttnParams& p, int b, long long i, int h,
                                               long long q_row) {
    return p.q_thd ? (long long)h * p.q_rows + q_row
                   : ((long long)b * p.h_q + h) * p.max_seqlen_q + i;
}

__device__ __forceinline__ float warp_max(float x) {
    for (int m = 16; m > 0; m >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, m));
    return x;
}

// Butterfly: every lane ends with the same sum (each step adds a pair in both
// orders, and float addition is commutative).
__device__ __forceinline__ float warp_sum(float x) {
    for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
    return x;
}

// The block's key range (the union of rows [0, rows)'s, both ends
// non-decreasing in the query), then split `split`'s chunk of it, rounded to
// `align` keys: [*klo, *khi], empty when *klo > *khi.
__device__ __forceinline__ void split_keys(const AttnParams& p, const SeqInfo& s, long long r0,
                                           long long rows, int split, int align, long long* klo,
                                           long long* khi) {
    *klo = 0;
    *khi = -1;
    if (rows <= 0) return;
    long long lo, hi, unused;
    key_bounds(p, s, r0 / p.group, &lo, &unused);
    key_bounds(p, s, (r0 + rows - 1) / p.group, &unused, &hi);
    if (lo > hi) return;
    const long long n = hi - lo + 1;
    long long chunk = (n + p.num_splits - 1) / p.num_splits;
    chunk = (chunk + align - 1) / align * align;
    *klo = lo + split * chunk;
    *khi = lmin(hi, *klo + chunk - 1);
}

template <typename T>
__device__ void attn_fwd(const T* q, const T* k, const T* v, const long long* meta, T* out,
                         float* lse, float* o_part, float* lse_part, const AttnParams p) {
    // Shared memory: key rows [BC] i64, q [ROWS, d_qk] (scaled), k [BC, d_qk + 1]
    // (padded: lane j reads row j without bank conflicts), v [BC, d_v],
    // probabilities [ROWS, BC]; all f32 after the key rows.
    extern __shared__ __align__(16) unsigned char smem_raw[];
    long long* krow_s = (long long*)smem_raw;
    float* q_s = (float*)(krow_s + ATTN_BC);
    const int kstride = p.d_qk + 1;
    float* k_s = q_s + ATTN_ROWS * p.d_qk;
    float* v_s = k_s + ATTN_BC * kstride;
    float* p_s = v_s + ATTN_BC * p.d_v;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = blockIdx.y;
    const int b = blockIdx.z / p.num_splits, split = blockIdx.z % p.num_splits;
    const SeqInfo s = load_seq(meta, b);
    const long long rows_valid = s.sq * p.group;                       // real rows
    const long long rows_out = (p.q_thd ? s.sq : p.max_seqlen_q) * p.group;  // + padding
    const long long r0 = (long long)blockIdx.x * ATTN_ROWS;
    if (r0 >= rows_out) return;  // uniform over the block

    // Q tile, pre-scaled; rows past the sequence are zeros.
    for (int e = tid; e < ATTN_ROWS * p.d_qk; e += ATTN_THREADS) {
        const long long r = r0 + e / p.d_qk;
        const int c = e % p.d_qk;
        float x = 0.f;
        if (r < rows_valid) {
            const long long i = r / p.group;
            const int h = g * p.group + (int)(r % p.group);
            const long long row = s.q_base + i * s.q_stride;
            x = to_f32(q[(row * p.h_q + h) * p.d_qk + c]) * p.scale;
        }
        q_s[e] = x;
    }

    // The block's key range, then this split's chunk of whole tiles.
    long long klo, khi;
    split_keys(p, s, r0, lmin(r0 + ATTN_ROWS, rows_valid) - r0, split, ATTN_BC, &klo, &khi);

    // This warp's rows: visible keys, running max m, sum l, output acc.
    long long row_lo[ATTN_ROWS_PER_WARP], row_hi[ATTN_ROWS_PER_WARP];
    float m[ATTN_ROWS_PER_WARP], l[ATTN_ROWS_PER_WARP];
    float acc[ATTN_ROWS_PER_WARP][ATTN_DV_PER_LANE];
#pragma unroll
    for (int rr = 0; rr < ATTN_ROWS_PER_WARP; ++rr) {
        const long long r = r0 + warp * ATTN_ROWS_PER_WARP + rr;
        row_lo[rr] = 1;
        row_hi[rr] = 0;
        if (r < rows_valid) key_bounds(p, s, r / p.group, &row_lo[rr], &row_hi[rr]);
        m[rr] = neg_inf();
        l[rr] = 0.f;
#pragma unroll
        for (int kk = 0; kk < ATTN_DV_PER_LANE; ++kk) acc[rr][kk] = 0.f;
    }

    for (long long j0 = klo; j0 <= khi; j0 += ATTN_BC) {
        __syncthreads();  // the previous tile is consumed (and q_s written)
        if (tid < ATTN_BC) {
            const long long j = j0 + tid;
            krow_s[tid] = j <= khi ? kv_row(p, meta, s, b, j) : -1;
        }
        __syncthreads();
        for (int e = tid; e < ATTN_BC * p.d_qk; e += ATTN_THREADS) {
            const int jj = e / p.d_qk, c = e % p.d_qk;
            const long long row = krow_s[jj];
            k_s[jj * kstride + c] = row >= 0 ? to_f32(k[(row * p.h_kv + g) * p.d_qk + c]) : 0.f;
        }
        for (int e = tid; e < ATTN_BC * p.d_v; e += ATTN_THREADS) {
            const int jj = e / p.d_v, c = e % p.d_v;
            const long long row = krow_s[jj];
            v_s[e] = row >= 0 ? to_f32(v[(row * p.h_kv + g) * p.d_v + c]) : 0.f;
        }
        __syncthreads();

        // Scores: lane = key j0 + lane, for the warp's rows.
        float sc[ATTN_ROWS_PER_WARP];
#pragma unroll
        for (int rr = 0; rr < ATTN_ROWS_PER_WARP; ++rr) sc[rr] = 0.f;
        const float* q_w = q_s + warp * ATTN_ROWS_PER_WARP * p.d_qk;
        for (int c = 0; c < p.d_qk; ++c) {
            const float kc = k_s[lane * kstride + c];
#pragma unroll
            for (int rr = 0; rr < ATTN_ROWS_PER_WARP; ++rr) sc[rr] = fmaf(q_w[rr * p.d_qk + c], kc, sc[rr]);
        }

        // Online softmax (Milakov & Gimelshein 2018): rescale by exp(m_old - m_new).
        const long long j = j0 + lane;
        float* p_w = p_s + warp * ATTN_ROWS_PER_WARP * ATTN_BC;
#pragma unroll
        for (int rr = 0; rr < ATTN_ROWS_PER_WARP; ++rr) {
            const bool visible = j >= row_lo[rr] && j <= row_hi[rr] && j <= khi;
            float x = sc[rr];
            if (p.softcap > 0.f) x = p.softcap * tanhf(x / p.softcap);
            x = visible ? x : neg_inf();
            const float m_new = fmaxf(m[rr], warp_max(x));
            float pj = 0.f, corr = 1.f;
            if (m_new != neg_inf()) {
                pj = visible ? expf(x - m_new) : 0.f;
                corr = expf(m[rr] - m_new);  // 0 when m_old = -inf
            }
            l[rr] = l[rr] * corr + warp_sum(pj);
            m[rr] = m_new;
            p_w[rr * ATTN_BC + lane] = pj;
#pragma unroll
            for (int kk = 0; kk < ATTN_DV_PER_LANE; ++kk) acc[rr][kk] *= corr;
        }
        __syncwarp();

        // o += p v: lane owns columns lane + 32 kk.
        for (int jj = 0; jj < ATTN_BC; ++jj) {
            float pr[ATTN_ROWS_PER_WARP];
#pragma unroll
            for (int rr = 0; rr < ATTN_ROWS_PER_WARP; ++rr) pr[rr] = p_w[rr * ATTN_BC + jj];
#pragma unroll
            for (int kk = 0; kk < ATTN_DV_PER_LANE; ++kk) {
                const int c = lane + 32 * kk;
                if (c < p.d_v) {
                    const float vc = v_s[jj * p.d_v + c];
#pragma unroll
                    for (int rr = 0; rr < ATTN_ROWS_PER_WARP; ++rr) acc[rr][kk] = fmaf(pr[rr], vc, acc[rr][kk]);
                }
            }
        }
    }

    // Normalize and write: out/lse directly, or this split's partials.
#pragma unroll
    for (int rr = 0; rr < ATTN_ROWS_PER_WARP; ++rr) {
        const long long r = r0 + warp * ATTN_ROWS_PER_WARP + rr;
        if (r >= rows_out) continue;
        const long long i = r / p.group;
        const int h = g * p.group + (int)(r % p.group);
        const long long q_row = s.q_base + i * s.q_stride;
        const float inv = l[rr] > 0.f ? 1.f / l[rr] : 0.f;
        const float lse_r = l[rr] > 0.f ? m[rr] + logf(l[rr]) : neg_inf();
        if (p.num_splits == 1) {
#pragma unroll
            for (int kk = 0; kk < ATTN_DV_PER_LANE; ++kk) {
                const int c = lane + 32 * kk;
                if (c < p.d_v) out[(q_row * p.h_q + h) * p.d_v + c] = from_f32<T>(acc[rr][kk] * inv);
            }
            if (p.has_lse && lane == 0) lse[lse_index(p, b, i, h, q_row)] = lse_r;
        } else if (r < rows_valid) {
            const long long pr = ((long long)split * p.q_rows + q_row) * p.h_q + h;
#pragma unroll
            for (int kk = 0; kk < ATTN_DV_PER_LANE; ++kk) {
                const int c = lane + 32 * kk;
                if (c < p.d_v) o_part[pr * p.d_v + c] = acc[rr][kk] * inv;
            }
            if (lane == 0) lse_part[pr] = lse_r;
        }
    }
}

// Loads key j's K and V columns lane + 32 kk (zeros past d, or for j < 0).
template <typename T>
__device__ __forceinline__ void load_kv_row(const AttnParams& p, const long long* meta,
                                            const SeqInfo& s, int b, int g, long long j,
                                            const T* k, const T* v, int lane,
                                            float kx[DEC_PER_LANE], float vx[DEC_PER_LANE]) {
    const long long row = j >= 0 ? kv_row(p, meta, s, b, j) : -1;
    const long long at = row >= 0 ? row : 0;  // no pointer before the buffers
    const T* kr = k + (at * p.h_kv + g) * p.d_qk;
    const T* vr = v + (at * p.h_kv + g) * p.d_v;
#pragma unroll
    for (int kk = 0; kk < DEC_PER_LANE; ++kk) {
        const int c = lane + 32 * kk;
        kx[kk] = row >= 0 && c < p.d_qk ? to_f32(kr[c]) : 0.f;
        vx[kk] = row >= 0 && c < p.d_v ? to_f32(vr[c]) : 0.f;
    }
}

// One key for the warp's rows: score (q pre-scaled in q_s), softcap, then
// the online-softmax update with one exp (the larger of m and the score is
// the new max) where the key is visible to the row.
template <int R>
__device__ __forceinline__ void decode_key(const AttnParams& p, const float* q_s, int rows,
                                           const long long row_lo[R],
                                           const long long row_hi[R], long long j,
                                           int lane, const float kx[DEC_PER_LANE],
                                           const float vx[DEC_PER_LANE], float m[R],
                                           float l[R],
                                           float acc[R][DEC_PER_LANE]) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (r >= rows) break;  // uniform
        float part = 0.f;
#pragma unroll
        for (int kk = 0; kk < DEC_PER_LANE; ++kk) {
            const int c = lane + 32 * kk;
            if (c < p.d_qk) part = fmaf(q_s[r * p.d_qk + c], kx[kk], part);
        }
        float x = warp_sum(part);
        if (p.softcap > 0.f) x = p.softcap * tanhf(x / p.softcap);
        if (j < row_lo[r] || j > row_hi[r]) continue;  // uniform
        float corr = 1.f, pj = 1.f;
        if (x > m[r]) {
            corr = expf(m[r] - x);  // 0 when m = -inf
            m[r] = x;
        } else {
            pj = x == neg_inf() ? 0.f : expf(x - m[r]);  // -inf weighs nothing
        }
        l[r] = l[r] * corr + pj;
#pragma unroll
        for (int kk = 0; kk < DEC_PER_LANE; ++kk) acc[r][kk] = fmaf(pj, vx[kk], acc[r][kk] * corr);
    }
}

template <typename T, int R>
__device__ void attn_decode(const T* q, const T* k, const T* v, const long long* meta, T* out,
                            float* lse, float* o_part, float* lse_part, const AttnParams p) {
    // Shared memory (f32): q [R, d_qk] (scaled), then each warp's
    // m and l [DEC_WARPS, R] and acc [DEC_WARPS, R, d_v].
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* q_s = (float*)smem_raw;
    float* m_s = q_s + R * p.d_qk;
    float* l_s = m_s + DEC_WARPS * R;
    float* o_s = l_s + DEC_WARPS * R;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = blockIdx.y;
    const int b = blockIdx.z / p.num_splits, split = blockIdx.z % p.num_splits;
    const SeqInfo s = load_seq(meta, b);
    const int rows = (int)(s.sq * p.group);                                 // real rows
    const int rows_out = (int)((p.q_thd ? s.sq : p.max_seqlen_q) * p.group);  // + padding
    if (rows_out == 0) return;  // uniform over the block

    for (int e = tid; e < R * p.d_qk; e += DEC_THREADS) {
        const int r = e / p.d_qk, c = e % p.d_qk;
        float x = 0.f;
        if (r < rows) {
            const long long i = r / p.group;
            const int h = g * p.group + r % p.group;
            x = to_f32(q[((s.q_base + i * s.q_stride) * p.h_q + h) * p.d_qk + c]) * p.scale;
        }
        q_s[e] = x;
    }
    long long klo, khi;
    split_keys(p, s, 0, rows, split, 1, &klo, &khi);

    long long row_lo[R], row_hi[R];
    float m[R], l[R], acc[R][DEC_PER_LANE];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        row_lo[r] = 1;
        row_hi[r] = 0;
        if (r < rows) key_bounds(p, s, r / p.group, &row_lo[r], &row_hi[r]);
        m[r] = neg_inf();
        l[r] = 0.f;
#pragma unroll
        for (int kk = 0; kk < DEC_PER_LANE; ++kk) acc[r][kk] = 0.f;
    }
    __syncthreads();  // q_s written

    // Two keys per step, both loaded before either is used.
    for (long long j = klo + warp; j <= khi; j += 2 * DEC_WARPS) {
        const long long j2 = j + DEC_WARPS <= khi ? j + DEC_WARPS : -1;
        float kx[DEC_PER_LANE], vx[DEC_PER_LANE], kx2[DEC_PER_LANE], vx2[DEC_PER_LANE];
        load_kv_row(p, meta, s, b, g, j, k, v, lane, kx, vx);
        load_kv_row(p, meta, s, b, g, j2, k, v, lane, kx2, vx2);
        decode_key<R>(p, q_s, rows, row_lo, row_hi, j, lane, kx, vx, m, l, acc);
        if (j2 >= 0) decode_key<R>(p, q_s, rows, row_lo, row_hi, j2, lane, kx2, vx2, m, l, acc);
    }

    // Each warp's state to shared memory, then merge the warps by LSE.
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (lane == 0) {
            m_s[warp * R + r] = m[r];
            l_s[warp * R + r] = l[r];
        }
#pragma unroll
        for (int kk = 0; kk < DEC_PER_LANE; ++kk) {
            const int c = lane + 32 * kk;
            if (c < p.d_v) o_s[(warp * R + r) * p.d_v + c] = acc[r][kk];
        }
    }
    __syncthreads();
    for (int e = tid; e < rows_out * p.d_v; e += DEC_THREADS) {
        const int r = e / p.d_v, c = e % p.d_v;
        float mx = neg_inf();
        for (int w = 0; w < DEC_WARPS; ++w) mx = fmaxf(mx, m_s[w * R + r]);
        float sum = 0.f, o = 0.f;
        if (mx != neg_inf()) {
            for (int w = 0; w < DEC_WARPS; ++w) {
                const float mw = m_s[w * R + r];
                if (mw == neg_inf()) continue;
                const float f = expf(mw - mx);
                sum = fmaf(l_s[w * R + r], f, sum);
                o = fmaf(o_s[(w * R + r) * p.d_v + c], f, o);
            }
        }
        const long long i = r / p.group;
        const int h = g * p.group + r % p.group;
        const long long q_row = s.q_base + i * s.q_stride;
        const float val = sum > 0.f ? o / sum : 0.f;
        const float lse_r = sum > 0.f ? mx + logf(sum) : neg_inf();
        if (p.num_splits == 1) {
            out[(q_row * p.h_q + h) * p.d_v + c] = from_f32<T>(val);
            if (p.has_lse && c == 0) lse[lse_index(p, b, i, h, q_row)] = lse_r;
        } else if (r < rows) {
            const long long pr = ((long long)split * p.q_rows + q_row) * p.h_q + h;
            o_part[pr * p.d_v + c] = val;
            if (c == 0) lse_part[pr] = lse_r;
        }
    }
}

template <typename T>
__device__ void attn_combine(const float* o_part, const float* lse_part, const long long* meta,
                             T* out, float* lse, const AttnParams p) {
    const int b = blockIdx.z, h = blockIdx.y;
    const long long i = blockIdx.x;
    const SeqInfo s = load_seq(meta, b);
    if (i >= (p.q_thd ? s.sq : (long long)p.max_seqlen_q)) return;
    const long long q_row = s.q_base + i * s.q_stride;
    const long long stride = p.q_rows * p.h_q;  // one split's lse_part
    const long long pr = q_row * p.h_q + h;

    // Padding rows (i >= sq) have no partials: out 0, lse -inf.
    float mx = neg_inf();
    if (i < s.sq)
        for (int sp = 0; sp < p.num_splits; ++sp) mx = fmaxf(mx, lse_part[sp * stride + pr]);
    float lse_r = neg_inf();
    if (mx != neg_inf()) {
        float sum = 0.f;
        for (int sp = 0; sp < p.num_splits; ++sp) sum += expf(lse_part[sp * stride + pr] - mx);
        lse_r = mx + logf(sum);
    }
    for (int c = threadIdx.x; c < p.d_v; c += blockDim.x) {
        float o = 0.f;
        if (lse_r != neg_inf()) {
            for (int sp = 0; sp < p.num_splits; ++sp) {
                const float ls = lse_part[sp * stride + pr];
                if (ls != neg_inf()) o += o_part[(sp * stride + pr) * p.d_v + c] * expf(ls - lse_r);
            }
        }
        out[pr * p.d_v + c] = from_f32<T>(o);
    }
    if (p.has_lse && threadIdx.x == 0) lse[lse_index(p, b, i, h, q_row)] = lse_r;
}

#define ATTN_DECODE(R, SUFFIX, T)                                                                     \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS)                                         \
        attn_decode##R##_##SUFFIX(const T* q, const T* k, const T* v, const long long* meta, T* out,  \
                                  float* lse, float* o_part, float* lse_part, const AttnParams p) {    \
        attn_decode<T, R>(q, k, v, meta, out, lse, o_part, lse_part, p);                              \
    }

#define ATTN_KERNELS(SUFFIX, T)                                                                       \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS)                                        \
        attn_fwd_##SUFFIX(const T* q, const T* k, const T* v, const long long* meta, T* out,          \
                          float* lse, float* o_part, float* lse_part, const AttnParams p) {            \
        attn_fwd<T>(q, k, v, meta, out, lse, o_part, lse_part, p);                                    \
    }                                                                                                 \
    ATTN_DECODE(1, SUFFIX, T)                                                                         \
    ATTN_DECODE(4, SUFFIX, T)                                                                         \
    ATTN_DECODE(8, SUFFIX, T)                                                                         \
    extern "C" __global__ void attn_combine_##SUFFIX(const float* o_part, const float* lse_part,       \
                                                     const long long* meta, T* out, float* lse,        \
                                                     const AttnParams p) {                             \
        attn_combine<T>(o_part, lse_part, meta, out, lse, p);                                         \
    }

ATTN_KERNELS(f32, float)
ATTN_KERNELS(f16, F16)
ATTN_KERNELS(bf16, Bf16)
