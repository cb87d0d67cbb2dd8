// SwiGLU of a fused gate/up projection output, alone or fused with the FP8 cast + transpose of its result
// (see src/swiglu_cast/mod.rs for the definitions). Compiled after cuda/common.cuh. Every value is computed
// with f32 operations rounded once each (mul_rn/add_rn/div_rn, fused multiply-adds only inside swiglu_exp,
// as the CPU's exp_fixed has them), so CPU and CUDA agree bit for bit.

// swiglu_exp, swiglu_value, swiglu_dgate / swiglu_dup and the value functors SwigluValue / SwigluGradValue are in
// swiglu.cuh (shared with the block-scaled casts of block_quantize.cu).

// Element-wise outputs in the element type: h = T(value) over rows * f (forward) or rows * 2f (backward).
template <class E>
__device__ void swiglu_fwd_impl(const typename E::T* gu, typename E::T* h, u64 rows, u64 f) {
    const SwigluValue<E> val{f};
    for (u64 i = global_thread(); i < rows * f; i += grid_threads()) E::store(h, i, val.value(gu, nullptr, i));
}
template <class E>
__device__ void swiglu_bwd_impl(const typename E::T* gu, const typename E::T* dh, typename E::T* dgu, u64 rows,
                                u64 f) {
    const SwigluGradValue<E> val{f};
    for (u64 i = global_thread(); i < rows * 2 * f; i += grid_threads()) E::store(dgu, i, val.value(gu, dh, i));
}

#define SWIGLU_ENTRY(NAME, E)                                                                                     \
    extern "C" __global__ void swiglu_fwd_##NAME(const E::T* gu, E::T* h, u64 rows, u64 f) {                       \
        swiglu_fwd_impl<E>(gu, h, rows, f);                                                                         \
    }                                                                                                               \
    extern "C" __global__ void swiglu_bwd_##NAME(const E::T* gu, const E::T* dh, E::T* dgu, u64 rows, u64 f) {     \
        swiglu_bwd_impl<E>(gu, dh, dgu, rows, f);                                                                   \
    }
SWIGLU_ENTRY(f32, TF32)
SWIGLU_ENTRY(bf16, TBF16)
SWIGLU_ENTRY(f16, TF16)

// The fused casts: common.cuh's cast_transpose_values over the output [rows, cols] (cols = f forward,
// 2f backward) with the values above; codes row-major into y, transposed into yt, amax into amax[slot].
#define SWIGLU_CAST_ENTRY(NAME, E, FNAME, FMT)                                                                    \
    extern "C" __global__ void swiglu_cast_transpose_##NAME##_##FNAME(const E::T* gu, u8* y, u8* yt,                \
                                                                      const float* scale, float* amax, int slot,    \
                                                                      int rows, int f) {                            \
        cast_transpose_values<E, FMT>(gu, nullptr, y, yt, scale, amax, slot, rows, f, SwigluValue<E>{(u64)f});      \
    }                                                                                                               \
    extern "C" __global__ void swiglu_bwd_cast_transpose_##NAME##_##FNAME(                                         \
        const E::T* gu, const E::T* dh, u8* y, u8* yt, const float* scale, float* amax, int slot, int rows, int f) { \
        cast_transpose_values<E, FMT>(gu, dh, y, yt, scale, amax, slot, rows, 2 * f,                                \
                                      SwigluGradValue<E>{(u64)f});                                                  \
    }
SWIGLU_CAST_ENTRY(f32, TF32, e4m3, FP8_E4M3)
SWIGLU_CAST_ENTRY(f32, TF32, e5m2, FP8_E5M2)
SWIGLU_CAST_ENTRY(bf16, TBF16, e4m3, FP8_E4M3)
SWIGLU_CAST_ENTRY(bf16, TBF16, e5m2, FP8_E5M2)
SWIGLU_CAST_ENTRY(f16, TF16, e4m3, FP8_E4M3)
SWIGLU_CAST_ENTRY(f16, TF16, e5m2, FP8_E5M2)
