// Activations computed inside the block-scaled tile casts (see BlockCastInput in src/block_quantize/mod.rs):
// GELU of u, GELU's gradient gelu'(u) dy, SwiGLU of gu [rows, 2 cols], SwiGLU's gradient [rows, cols] from gu
// and dh [rows, cols / 2], each rounded to bf16 as the activation's own kernel writes it, then cast in 1x128
// and/or 128x1 tiles (a null y or yt skips that layout). BF16 activations only (other element types
// compute the activation first); a module of its own, so that the plain casts compile without it.
// Compiled after cuda/common.cuh, src/elementwise/gelu.cuh, src/swiglu_cast/swiglu.cuh, blocks128.cuh and
// block_tiles.cuh.

#define BQ_ACT_ENTRY(FNAME, FMT) \
    extern "C" __global__ void bq_gelu_bf16_##FNAME(const TBF16::T* u, int gelu_exact, u8* y, float* scale,     \
                                                        float* scale_inv, u64 srs, u64 scs, u8* yt,              \
                                                        float* tscale, float* tscale_inv, u64 trs, u64 tcs,      \
                                                        float fmax, int exact, int rows, int cols) {             \
        bq_tiles_impl<TBF16, FMT>(u, u, GeluValue<TBF16>{gelu_exact}, y, scale, scale_inv, srs, scs, yt, tscale,         \
                               tscale_inv, trs, tcs, fmax, exact, rows, cols);                                  \
    }                                                                                                           \
    extern "C" __global__ void bq_gelu_grad_bf16_##FNAME(const TBF16::T* u, const TBF16::T* dy, int gelu_exact,    \
                                                             u8* y, float* scale, float* scale_inv, u64 srs,     \
                                                             u64 scs, u8* yt, float* tscale, float* tscale_inv,  \
                                                             u64 trs, u64 tcs, float fmax, int exact, int rows,  \
                                                             int cols) {                                         \
        bq_tiles_impl<TBF16, FMT>(u, dy, GeluGradValue<TBF16>{gelu_exact}, y, scale, scale_inv, srs, scs, yt, tscale,    \
                               tscale_inv, trs, tcs, fmax, exact, rows, cols);                                  \
    }                                                                                                           \
    extern "C" __global__ void bq_swiglu_bf16_##FNAME(const TBF16::T* gu, u8* y, float* scale, float* scale_inv, \
                                                          u64 srs, u64 scs, u8* yt, float* tscale,               \
                                                          float* tscale_inv, u64 trs, u64 tcs, float fmax,       \
                                                          int exact, int rows, int cols) {                       \
        bq_tiles_impl<TBF16, FMT>(gu, gu, SwigluValue<TBF16>{(u64)cols}, y, scale, scale_inv, srs, scs, yt, tscale,      \
                               tscale_inv, trs, tcs, fmax, exact, rows, cols);                                  \
    }                                                                                                           \
    extern "C" __global__ void bq_swiglu_grad_bf16_##FNAME(const TBF16::T* gu, const TBF16::T* dh, u8* y,          \
                                                               float* scale, float* scale_inv, u64 srs, u64 scs, \
                                                               u8* yt, float* tscale, float* tscale_inv,         \
                                                               u64 trs, u64 tcs, float fmax, int exact,          \
                                                               int rows, int cols) {                             \
        bq_tiles_impl<TBF16, FMT>(gu, dh, SwigluGradValue<TBF16>{(u64)(cols / 2)}, y, scale, scale_inv, srs, scs, yt,    \
                               tscale, tscale_inv, trs, tcs, fmax, exact, rows, cols);                          \
    }

BQ_ACT_ENTRY(e4m3, FP8_E4M3)
BQ_ACT_ENTRY(e5m2, FP8_E5M2)
