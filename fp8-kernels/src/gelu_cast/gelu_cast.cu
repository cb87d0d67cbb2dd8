// GELU fused with the FP8 cast + transpose of its result (see src/gelu_cast/mod.rs for the definitions).
//
// Compiled after cuda/common.cuh and src/elementwise/gelu.cuh: GELU's values come from gelu.cuh, as in the
// element-wise GELU kernels, so the fused kernels equal "GELU kernel (stored in the element type), then
// cast_transpose" bit for bit.

// The element type's rounding of an f32 (what storing the unfused GELU output and reloading it does).
template <class E>
__device__ __forceinline__ float round_through(float v) {
    typename E::T tmp[1];
    E::store(tmp, 0, v);
    return E::load(tmp, 0);
}

// The values of the vectorised path (cast_transpose64): gelu(x), or gelu'(x) * dy, rounded to the element type.
template <class E>
struct GeluValue {
    int exact;
    __device__ __forceinline__ float value(const typename E::T* x, const typename E::T*, u64 i) const {
        return round_through<E>(gelu_value(E::load(x, i), exact));
    }
    __device__ __forceinline__ void value8(const typename E::T* x, const typename E::T*, u64 i, float (&h)[8]) const {
        E::load8(x, i, h);
#pragma unroll
        for (int k = 0; k < 8; ++k) h[k] = round_through<E>(gelu_value(h[k], exact));
    }
};
template <class E>
struct GeluGradValue {
    int exact;
    __device__ __forceinline__ float value(const typename E::T* x, const typename E::T* dy, u64 i) const {
        return round_through<E>(mul_rn(gelu_slope(E::load(x, i), exact), E::load(dy, i)));
    }
    __device__ __forceinline__ void value8(const typename E::T* x, const typename E::T* dy, u64 i, float (&h)[8]) const {
        float d[8];
        E::load8(x, i, h);
        E::load8(dy, i, d);
#pragma unroll
        for (int k = 0; k < 8; ++k) h[k] = round_through<E>(mul_rn(gelu_slope(h[k], exact), d[k]));
    }
};

// x [rows, cols] row-major -> y = codes [rows, cols], yt = codes of the transpose [cols, rows], amax into
// amax[slot]. dy == nullptr: value = gelu(x); otherwise value = gelu'(x) * dy. The value is rounded to the
// element type before the amax and the cast, as the unfused path stores it. Tiles and the amax reduction
// are those of cast_transpose_impl (block (32, 8)).
#define FG_TILE 32
template <class E, int FMT>
__device__ void gelu_cast_transpose_impl(const typename E::T* x, const typename E::T* dy, u8* y, u8* yt,
                                         const float* scale, float* amax, int slot, int rows, int cols, int exact) {
    __shared__ u8 tile[FG_TILE][FG_TILE + 4];
    const float s = *scale;
    int m = 0;
    const int tiles_c = (cols + FG_TILE - 1) / FG_TILE;
    const int tiles_r = (rows + FG_TILE - 1) / FG_TILE;
    // A one-dimensional block selects the vectorised 64x64 path of common.cuh (shapes in multiples of 64).
    if (blockDim.y == 1) {
        if (dy == nullptr) cast_transpose64<E, FMT>(x, dy, y, yt, s, m, rows, cols, GeluValue<E>{exact});
        else cast_transpose64<E, FMT>(x, dy, y, yt, s, m, rows, cols, GeluGradValue<E>{exact});
    } else {
    for (int t = blockIdx.x; t < tiles_r * tiles_c; t += gridDim.x) {
        const int r0 = (t / tiles_c) * FG_TILE, c0 = (t % tiles_c) * FG_TILE;
        for (int k = threadIdx.y; k < FG_TILE; k += blockDim.y) {
            const int r = r0 + k, c = c0 + threadIdx.x;
            u8 code = 0;
            if (r < rows && c < cols) {
                const u64 i = (u64)r * cols + c;
                const float v = E::load(x, i);
                const float h = dy == nullptr ? round_through<E>(gelu_value(v, exact))
                                              : round_through<E>(mul_rn(gelu_slope(v, exact), E::load(dy, i)));
                m = max(m, abs_bits_no_nan(h));
                code = (u8)(fp8x2<FMT>(mul_rn(h, s), 0.0f) & 0xFF);
                y[i] = code;
            }
            tile[k][threadIdx.x] = code;
        }
        __syncthreads();
        for (int k = threadIdx.y; k < FG_TILE; k += blockDim.y) {
            const int c = c0 + k, r = r0 + threadIdx.x;
            if (r < rows && c < cols) yt[(u64)c * rows + r] = tile[threadIdx.x][k];
        }
        __syncthreads();
    }
    }
    const int flat = threadIdx.y * blockDim.x + threadIdx.x;
    __shared__ int wm[32];
    m = __reduce_max_sync(0xFFFFFFFFu, m);
    if ((flat & 31) == 0) wm[flat >> 5] = m;
    __syncthreads();
    if (flat < 32) {
        const int nw = (blockDim.x * blockDim.y + 31) >> 5;
        int v = flat < nw ? wm[flat] : 0;
        v = __reduce_max_sync(0xFFFFFFFFu, v);
        if (flat == 0 && amax != nullptr) atomicMax(reinterpret_cast<int*>(amax + slot), v);
    }
}

#define GELU_CAST_ENTRY(NAME, E, FNAME, FMT)                                                                      \
    extern "C" __global__ void gelu_cast_transpose_##NAME##_##FNAME(const E::T* x, u8* y, u8* yt,                   \
                                                                    const float* scale, float* amax, int slot,      \
                                                                    int rows, int cols, int exact) {                \
        gelu_cast_transpose_impl<E, FMT>(x, nullptr, y, yt, scale, amax, slot, rows, cols, exact);                  \
    }                                                                                                               \
    extern "C" __global__ void gelu_bwd_cast_transpose_##NAME##_##FNAME(const E::T* x, const E::T* dy, u8* y,       \
                                                                        u8* yt, const float* scale, float* amax,    \
                                                                        int slot, int rows, int cols, int exact) {  \
        gelu_cast_transpose_impl<E, FMT>(x, dy, y, yt, scale, amax, slot, rows, cols, exact);                       \
    }
GELU_CAST_ENTRY(f32, TF32, e4m3, FP8_E4M3)
GELU_CAST_ENTRY(f32, TF32, e5m2, FP8_E5M2)
GELU_CAST_ENTRY(bf16, TBF16, e4m3, FP8_E4M3)
GELU_CAST_ENTRY(bf16, TBF16, e5m2, FP8_E5M2)
GELU_CAST_ENTRY(f16, TF16, e4m3, FP8_E4M3)
GELU_CAST_ENTRY(f16, TF16, e5m2, FP8_E5M2)
