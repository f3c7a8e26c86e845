// Tiled bf16 GEMM on tensor cores (mma.sync m16n8k16, f32 accumulate): the
// CUDA path's fallback when cuBLAS does not load, and its parity reference.
//
//   y[t, n] = x[t, k] . w[n, k]^T (+ bias[n])
//   x: [t, k] bf16 row-major (the activations, rounded once), w: [n, k] bf16
//   row-major (a Linear's weight as stored), y: [t, n] f32, bias: [n] f32 or
//   null.
//
// Block: GEMM_THREADS = 128 threads (4 warps, 2 x 2), a 64 x 64 tile of y
// (64 rows of x by 64 rows of w), k in steps of 32 staged in shared memory
// (zero-filled past the edges, so any t, n, k work). Each warp owns a
// 32 x 32 sub-tile: 2 x 4 mma tiles of 16 x 8. Fragment layout of
// m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"): g = lane / 4,
// c = lane % 4; A regs a0..a3 hold (row g | g + 8, k 2c | 2c + 8, 2 values
// each); B regs b0, b1 hold (k 2c | 2c + 8, col g); C regs hold rows g and
// g + 8, cols 2c, 2c + 1. Grid: (ceil(n / 64), ceil(t / 64)).

#include "common.cuh"

#define GEMM_THREADS 128
#define GEMM_BM 64
#define GEMM_BN 64
#define GEMM_BK 32
// Row pitch of the shared tiles in bf16 values (pad 8: fewer bank conflicts).
#define GEMM_PITCH (GEMM_BK + 8)

__device__ __forceinline__ unsigned int pair(const unsigned short* p) {
    return *(const unsigned int*)p;  // two consecutive bf16, 4-byte aligned
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
gemm_bf16(float* y, const Bf16* x, const Bf16* w, const float* bias, int t, int n, int k) {
    __shared__ __align__(16) unsigned short xs[GEMM_BM * GEMM_PITCH];
    __shared__ __align__(16) unsigned short ws[GEMM_BN * GEMM_PITCH];
    const int row0 = blockIdx.y * GEMM_BM, col0 = blockIdx.x * GEMM_BN;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;
    const int g = lane / 4, c = lane % 4;
    float acc[2][4][4];
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++)
            for (int r = 0; r < 4; r++) acc[i][j][r] = 0.0f;

    for (int k0 = 0; k0 < k; k0 += GEMM_BK) {
        // Stage both tiles, zero past the edges: 64 x 32 values each.
        for (int e = threadIdx.x; e < GEMM_BM * GEMM_BK; e += GEMM_THREADS) {
            const int r = e / GEMM_BK, kk = e % GEMM_BK;
            const int gr = row0 + r, gn = col0 + r, gk = k0 + kk;
            xs[r * GEMM_PITCH + kk] = (gr < t && gk < k) ? x[(long long)gr * k + gk].bits : 0;
            ws[r * GEMM_PITCH + kk] = (gn < n && gk < k) ? w[(long long)gn * k + gk].bits : 0;
        }
        __syncthreads();
        for (int kk = 0; kk < GEMM_BK; kk += 16) {
            unsigned int a[2][4], b[4][2];
            for (int i = 0; i < 2; i++) {
                const unsigned short* p = xs + (wm + 16 * i + g) * GEMM_PITCH + kk + 2 * c;
                a[i][0] = pair(p);
                a[i][1] = pair(p + 8 * GEMM_PITCH);
                a[i][2] = pair(p + 8);
                a[i][3] = pair(p + 8 * GEMM_PITCH + 8);
            }
            for (int j = 0; j < 4; j++) {
                const unsigned short* p = ws + (wn + 8 * j + g) * GEMM_PITCH + kk + 2 * c;
                b[j][0] = pair(p);
                b[j][1] = pair(p + 8);
            }
            for (int i = 0; i < 2; i++)
                for (int j = 0; j < 4; j++)
                    asm volatile(
                        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                        : "+f"(acc[i][j][0]), "+f"(acc[i][j][1]), "+f"(acc[i][j][2]), "+f"(acc[i][j][3])
                        : "r"(a[i][0]), "r"(a[i][1]), "r"(a[i][2]), "r"(a[i][3]), "r"(b[j][0]), "r"(b[j][1]));
        }
        __syncthreads();
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++)
            for (int r = 0; r < 4; r++) {
                const int gr = row0 + wm + 16 * i + g + (r / 2) * 8;
                const int gc = col0 + wn + 8 * j + 2 * c + (r % 2);
                if (gr < t && gc < n) y[(long long)gr * n + gc] = acc[i][j][r] + (bias ? bias[gc] : 0.0f);
            }
}
