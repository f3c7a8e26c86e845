// The model forward's small ops on f32 activations (row-major), for the
// CUDA path of te-models (crates/te-models/src/cuda/ops.rs launches them).
//
// Shapes: x, y [rows, dim]; w [dim] f32 (RMSNorm multipliers, Gemma's 1 + w
// already applied); table [vocab, hidden] bf16; logits [rows, vocab].
//   rmsnorm:   y = x / sqrt(mean(x^2) + eps) * w       one block per row
//   gated_act: g = act(g) * u, act = SiLU (0) or GELU-tanh (1)
//   add:       x = x + y
//   add_bias:  y[r, j] += bias[j]
//   embed:     x[i, :] = table[tokens[i], :] * scale   one block per token
//   gather:    out[i, :] = x[rows[i], :]               one block per row
//   softcap:   x = cap * tanh(x / cap)
//   to_bf16:   out = bf16(x), round to nearest even
//   argmax:    ids[r] = the largest non-NaN logit of row r, lowest id on
//              ties, 0 when none (te-models' greedy rule)  one block per row
// Elementwise kernels: grid-stride loops over 64-bit indices.
//
// Order: device helpers, kernels; each launch lives in ops.rs.

#include "common.cuh"

#define OPS_THREADS 256

// Block-wide sum of `v` (OPS_THREADS threads); every thread gets the sum.
__device__ __forceinline__ float block_sum(float v, float* shared) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    float s = 0.0f;
    if (threadIdx.x < 32) {
        s = threadIdx.x < OPS_THREADS / 32 ? shared[threadIdx.x] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (threadIdx.x == 0) shared[0] = s;
    }
    __syncthreads();
    s = shared[0];
    __syncthreads();
    return s;
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }

// 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3).
__device__ __forceinline__ float gelu_tanh(float x) {
    const float u = 0.7978846f * (x + 0.044715f * x * x * x);
    return x / (1.0f + __expf(-2.0f * u));
}

extern "C" __global__ void rmsnorm_f32(float* y, const float* x, const float* w, int dim, float eps) {
    __shared__ float shared[OPS_THREADS / 32];
    const long long row = blockIdx.x;
    const float* xr = x + row * dim;
    float* yr = y + row * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    const float inv = rsqrtf(block_sum(ss, shared) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = xr[i] * inv * w[i];
}

extern "C" __global__ void gated_act_f32(float* g, const float* u, long long n, int gelu) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float a = gelu ? gelu_tanh(g[i]) : silu(g[i]);
        g[i] = a * u[i];
    }
}

extern "C" __global__ void add_f32(float* x, const float* y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        x[i] += y[i];
}

extern "C" __global__ void add_bias_f32(float* y, const float* bias, long long n, int cols) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        y[i] += bias[i % cols];
}

extern "C" __global__ void embed_bf16(float* x, const Bf16* table, const unsigned int* tokens,
                                      int hidden, float scale) {
    const long long src = (long long)tokens[blockIdx.x] * hidden;
    const long long dst = (long long)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) x[dst + i] = to_f32(table[src + i]) * scale;
}

extern "C" __global__ void gather_rows_f32(float* out, const float* x, const unsigned long long* rows,
                                           int width) {
    const long long src = (long long)rows[blockIdx.x] * width;
    const long long dst = (long long)blockIdx.x * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) out[dst + i] = x[src + i];
}

extern "C" __global__ void softcap_f32(float* x, long long n, float cap) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        x[i] = cap * tanhf(x[i] / cap);
}

extern "C" __global__ void to_bf16_f32(Bf16* out, const float* x, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = from_f32<Bf16>(x[i]);
}

// Whether (v, i) beats (best, bi): larger, or equal with a lower id; NaN never wins.
__device__ __forceinline__ bool better(float v, int i, float best, int bi) {
    if (v != v) return false;
    if (bi < 0) return true;
    return v > best || (v == best && i < bi);
}

extern "C" __global__ void argmax_f32(unsigned int* ids, const float* logits, int vocab) {
    __shared__ float sv[OPS_THREADS];
    __shared__ int si[OPS_THREADS];
    const float* row = logits + (long long)blockIdx.x * vocab;
    float best = 0.0f;
    int bi = -1;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x)
        if (better(row[i], i, best, bi)) { best = row[i]; bi = i; }
    sv[threadIdx.x] = best;
    si[threadIdx.x] = bi;
    __syncthreads();
    for (int s = OPS_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            const int j = threadIdx.x + s;
            if (si[j] >= 0 && better(sv[j], si[j], sv[threadIdx.x], si[threadIdx.x])) {
                sv[threadIdx.x] = sv[j];
                si[threadIdx.x] = si[j];
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) ids[blockIdx.x] = si[0] < 0 ? 0u : (unsigned int)si[0];
}
