// Shared device helpers for te-rs kernels: storage types and f32 conversion.
// Included textually by the Rust side (NVRTC has no file system here), so it
// must not include anything itself. f16 and bf16 are raw 16-bit storage with
// explicit conversions, so no CUDA headers are needed at run time.
#pragma once

struct F16 { unsigned short bits; };
struct Bf16 { unsigned short bits; };

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(F16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
__device__ __forceinline__ float to_f32(Bf16 x) {
    return __uint_as_float(((unsigned int)x.bits) << 16);
}

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ F16 from_f32<F16>(float x) {
    F16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
    return h;
}
// Round to nearest even, NaN kept quiet.
template <> __device__ __forceinline__ Bf16 from_f32<Bf16>(float x) {
    unsigned int u = __float_as_uint(x);
    Bf16 b;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        b.bits = (unsigned short)((u >> 16) | 0x40u);
    } else {
        b.bits = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    return b;
}

// Index b with cu_seqlens[b] <= k < cu_seqlens[b + 1] (sequences may be empty).
__device__ __forceinline__ int seq_of_token(const int* cu_seqlens, int batch, long long k) {
    int lo = 0, hi = batch;  // answer in [0, batch)
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if ((long long)cu_seqlens[mid] <= k) lo = mid; else hi = mid;
    }
    return lo;
}
