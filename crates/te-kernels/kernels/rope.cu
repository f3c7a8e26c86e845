// Rotary position embedding (RoPE) on a Q or K tensor in bshd, sbhd or thd.
//
// x, out: [b, s, h, d] (bshd), [s, b, h, d] (sbhd) or [t, h, d] (thd, with
// cu_seqlens [b + 1] i32); cos, sin: [max_positions, d2 / 2] f32;
// start_positions: [b] i32. Pair (a, c) at angle θ = pos * inv_freq[j]
// becomes (a cos θ - c sin θ, c cos θ + a sin θ); half-split pairs x[j] with
// x[j + d2/2], interleaved x[2j] with x[2j+1]; d2..d passes through.
// Position of token i of sequence b: start_positions[b] + i, or the zigzag
// context-parallel position (docs/ARCHITECTURE.md, "Context parallelism"). The host validated every
// argument (positions < max_positions included) before the launch.
//
// Grid: one block per token row, threads over (head, pair); 64-bit offsets.

#include "common.cuh"

struct RopeParams {
    long long in_stride_b, in_stride_s, in_stride_h, in_stride_d;
    long long out_stride_b, out_stride_s, out_stride_h, out_stride_d;
    int format;       // 0 bshd, 1 sbhd, 2 thd
    int interleaved;  // 0 half-split, 1 interleaved
    int batch, max_seqlen, num_heads, head_dim, rotary_dim, cp_size, cp_rank;
    int copy_tail;    // out of place: copy d2..d
};

template <typename T>
__device__ void rope_fwd(T* out, const T* x, const float* cos_t, const float* sin_t,
                         const int* cu_seqlens, const int* start_positions, const RopeParams p) {
    const long long k = blockIdx.x;
    int b;
    long long i, len;
    if (p.format == 0) { b = (int)(k / p.max_seqlen); i = k % p.max_seqlen; len = p.max_seqlen; }
    else if (p.format == 1) { b = (int)(k % p.batch); i = k / p.batch; len = p.max_seqlen; }
    else {
        b = seq_of_token(cu_seqlens, p.batch, k);
        i = k - cu_seqlens[b];
        len = cu_seqlens[b + 1] - cu_seqlens[b];
    }
    long long pos = start_positions[b];
    if (p.cp_size == 1) {
        pos += i;
    } else {
        const long long c = len / 2;
        pos += i < c ? p.cp_rank * c + i : (2LL * p.cp_size - 1 - p.cp_rank) * c + (i - c);
    }
    long long in_row, out_row;
    if (p.format == 2) {
        in_row = (cu_seqlens[b] + i) * p.in_stride_s;
        out_row = (cu_seqlens[b] + i) * p.out_stride_s;
    } else {
        in_row = b * p.in_stride_b + i * p.in_stride_s;
        out_row = b * p.out_stride_b + i * p.out_stride_s;
    }
    const int half = p.rotary_dim / 2;
    const float* c_row = cos_t + pos * half;
    const float* s_row = sin_t + pos * half;
    for (int w = threadIdx.x; w < p.num_heads * half; w += blockDim.x) {
        const int h = w / half, j = w % half;
        const int ia = p.interleaved ? 2 * j : j;
        const int ib = p.interleaved ? 2 * j + 1 : j + half;
        const T* xh = x + in_row + h * p.in_stride_h;
        T* yh = out + out_row + h * p.out_stride_h;
        const float a = to_f32(xh[ia * p.in_stride_d]);
        const float c = to_f32(xh[ib * p.in_stride_d]);
        const float cs = c_row[j], sn = s_row[j];
        yh[ia * p.out_stride_d] = from_f32<T>(a * cs - c * sn);
        yh[ib * p.out_stride_d] = from_f32<T>(c * cs + a * sn);
    }
    if (p.copy_tail) {
        const int tail = p.head_dim - p.rotary_dim;
        for (int w = threadIdx.x; w < p.num_heads * tail; w += blockDim.x) {
            const int h = w / tail, e = p.rotary_dim + w % tail;
            out[out_row + h * p.out_stride_h + e * p.out_stride_d] =
                x[in_row + h * p.in_stride_h + e * p.in_stride_d];
        }
    }
}

// x == nullptr: in place on out.
#define ROPE_KERNEL(NAME, T)                                                                   \
    extern "C" __global__ void NAME(T* out, const T* x, const float* cos_t, const float* sin_t, \
                                    const int* cu_seqlens, const int* start_positions,         \
                                    const RopeParams p) {                                      \
        rope_fwd<T>(out, x ? x : out, cos_t, sin_t, cu_seqlens, start_positions, p);           \
    }

ROPE_KERNEL(rope_fwd_f32, float)
ROPE_KERNEL(rope_fwd_f16, F16)
ROPE_KERNEL(rope_fwd_bf16, Bf16)
