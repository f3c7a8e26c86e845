// KV-cache save and thd <-> bshd conversions (row copies).
//
// kv_save: k [rows_k, h_kv * d_k], v [rows_v, h_kv * d_v] (bshd/sbhd/thd
// token rows); k_cache [num_pages * page_size, h_kv * d_k], v_cache likewise.
// The host resolves the page table into `pairs` ([n, 2] u64: source token
// row, cache row; cache rows distinct), so the kernel is a pure copy. A cache
// row of ~0 (KV_SKIP) copies nothing: the padded rows of a CUDA-graph decode
// step, whose launch size is fixed by its batch bucket.
// convert_thd_to_bshd: bshd row (b, i) = thd row cu_seqlens[b] + i, or zeros
// past the sequence's length; convert_bshd_to_thd: thd row r of sequence b =
// bshd row (b, r - cu_seqlens[b]), or zeros for r >= cu_seqlens[b].
//
// Grid: one block per destination row, threads over the row; 64-bit offsets.

#include "common.cuh"

struct KvSaveParams {
    long long row_k;  // h_kv * d_k
    long long row_v;  // h_kv * d_v
};

struct ConvertParams {
    long long row;  // h * d
    int batch, max_seqlen;
};

template <typename T>
__device__ void kv_save(T* k_cache, T* v_cache, const T* k, const T* v,
                        const unsigned long long* pairs, const KvSaveParams p) {
    const unsigned long long src = pairs[2 * blockIdx.x], dst = pairs[2 * blockIdx.x + 1];
    if (dst == ~0ull) return;  // KV_SKIP
    for (long long e = threadIdx.x; e < p.row_k; e += blockDim.x) k_cache[dst * p.row_k + e] = k[src * p.row_k + e];
    for (long long e = threadIdx.x; e < p.row_v; e += blockDim.x) v_cache[dst * p.row_v + e] = v[src * p.row_v + e];
}

template <typename T>
__device__ void thd_to_bshd(T* bshd, const T* thd, const int* cu_seqlens, const ConvertParams p) {
    const long long r = blockIdx.x;
    const int b = (int)(r / p.max_seqlen);
    const long long i = r % p.max_seqlen;
    const bool valid = i < (long long)(cu_seqlens[b + 1] - cu_seqlens[b]);
    const long long src = cu_seqlens[b] + i;
    for (long long e = threadIdx.x; e < p.row; e += blockDim.x)
        bshd[r * p.row + e] = valid ? thd[src * p.row + e] : T{};
}

template <typename T>
__device__ void bshd_to_thd(T* thd, const T* bshd, const int* cu_seqlens, const ConvertParams p) {
    const long long r = blockIdx.x;
    const bool valid = r < (long long)cu_seqlens[p.batch];
    const int b = valid ? seq_of_token(cu_seqlens, p.batch, r) : 0;
    const long long src = (long long)b * p.max_seqlen + (r - cu_seqlens[b]);
    for (long long e = threadIdx.x; e < p.row; e += blockDim.x)
        thd[r * p.row + e] = valid ? bshd[src * p.row + e] : T{};
}

#define KV_KERNELS(SUFFIX, T)                                                                          \
    extern "C" __global__ void kv_save_##SUFFIX(T* k_cache, T* v_cache, const T* k, const T* v,        \
                                                const unsigned long long* pairs, const KvSaveParams p) { \
        kv_save<T>(k_cache, v_cache, k, v, pairs, p);                                                  \
    }                                                                                                  \
    extern "C" __global__ void convert_thd_to_bshd_##SUFFIX(T* bshd, const T* thd,                     \
                                                            const int* cu_seqlens, const ConvertParams p) { \
        thd_to_bshd<T>(bshd, thd, cu_seqlens, p);                                                      \
    }                                                                                                  \
    extern "C" __global__ void convert_bshd_to_thd_##SUFFIX(T* thd, const T* bshd,                     \
                                                            const int* cu_seqlens, const ConvertParams p) { \
        bshd_to_thd<T>(thd, bshd, cu_seqlens, p);                                                      \
    }

KV_KERNELS(f32, float)
KV_KERNELS(f16, F16)
KV_KERNELS(bf16, Bf16)
