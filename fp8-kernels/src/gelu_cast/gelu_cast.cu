// GELU fused with the FP8 cast + transpose of its result (see src/gelu_cast/mod.rs for the definitions).
//
// Compiled after cuda/common.cuh and src/elementwise/gelu.cuh: GELU's values come from gelu.cuh, as in the
// element-wise GELU kernels, so the fused kernels equal "GELU kernel (stored in the element type), then
// cast_transpose" bit for bit.

// GeluValue and GeluGradValue (the values of the vectorised path) are in gelu.cuh.

// x [rows, cols] row-major -> y = codes [rows, cols], yt = codes of the transpose [cols, rows], amax into
// amax[slot]. dy == nullptr: value = gelu(x); otherwise value = gelu'(x) * dy. The value is rounded to the
// element type before the amax and the cast, as the unfused path stores it. Tiles and the amax are
// common.cuh's cast_transpose_values, as in the plain cast.
template <class E, int FMT>
__device__ void gelu_cast_transpose_impl(const typename E::T* x, const typename E::T* dy, u8* y, u8* yt,
                                         const float* scale, float* amax, int slot, int rows, int cols, int exact) {
    if (dy == nullptr)
        cast_transpose_values<E, FMT>(x, dy, y, yt, scale, amax, slot, rows, cols, GeluValue<E>{exact});
    else
        cast_transpose_values<E, FMT>(x, dy, y, yt, scale, amax, slot, rows, cols, GeluGradValue<E>{exact});
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
