// Activations computed inside the block-scaled tile casts (see BlockCastInput in src/block_quantize/mod.rs):
// GELU of u, GELU's gradient gelu'(u) dy, SwiGLU of gu [rows, 2 cols], SwiGLU's gradient [rows, cols] from gu
// and dh [rows, cols / 2], each rounded to bf16 as the activation's own kernel writes it, then cast in 1x128
// and/or 128x1 tiles (a null y or yt skips that layout). BF16 activations only (other element types
// compute the activation first); a module of its own, so that the plain casts compile without it.
// Compiled after cuda/common.cuh, src/elementwise/gelu.cuh, src/swiglu_cast/swiglu.cuh, blocks128.cuh and
// block_tiles.cuh.

// A norm's output h = T((x - mean) * rstd * w (+ b)) of x [rows, d], from the row statistics the norm's
// forward wrote (layer_norm.cu: ln_affine8 then the rounding to T, the same operations in the same order,
// so the same bits; RMSNorm's statistics hold mean 0, and x - 0 is x). The weight comes in as the tile
// cast's second input, so its 16-byte alignment is part of the cast's vector check; the bias is read
// with 16-byte loads only where it is aligned.
template <class E>
struct NormValue {
    const typename E::T* b;
    const float* mean;
    const float* rstd;
    u64 d;
    __device__ __forceinline__ float affine(float x, float w, float bv, float m, float rs) const {
        float y = mul_rn(mul_rn(add_rn(x, -m), rs), w);
        if (b != nullptr) y = add_rn(y, bv);
        return round_through<E>(y);
    }
    __device__ __forceinline__ float value(const typename E::T* x, const typename E::T* w, u64 i) const {
        u64 r, c;
        divmod_u64(i, d, r, c);
        return affine(E::load(x, i), E::load(w, c), b != nullptr ? E::load(b, c) : 0.0f, mean[r], rstd[r]);
    }
    __device__ __forceinline__ void value8(const typename E::T* x, const typename E::T* w, u64 i,
                                           float (&h)[8]) const {
        u64 r, c;
        divmod_u64(i, d, r, c);
        float wv[8], bv[8];
        E::load8(x, i, h);
        E::load8(w, c, wv);
        if (b != nullptr && (((u64)(b + c)) & 15) == 0) {
            E::load8(b, c, bv);
        } else {
#pragma unroll
            for (int q = 0; q < 8; ++q) bv[q] = b != nullptr ? E::load(b, c + q) : 0.0f;
        }
        const float m = mean[r], rs = rstd[r];
#pragma unroll
        for (int q = 0; q < 8; ++q) h[q] = affine(h[q], wv[q], bv[q], m, rs);
    }
};

#define BQ_ACT_ENTRY(FNAME, FMT) \
    extern "C" __global__ void BQ_TILES_ACT_BOUNDS bq_gelu_bf16_##FNAME(const TBF16::T* u, int gelu_exact, u8* y, float* scale,     \
                                                        float* scale_inv, u64 srs, u64 scs, u8* yt,              \
                                                        float* tscale, float* tscale_inv, u64 trs, u64 tcs,      \
                                                        float fmax, int exact, int rows, int cols) {             \
        bq_tiles_impl<TBF16, FMT>(u, u, GeluValue<TBF16>{gelu_exact}, y, scale, scale_inv, srs, scs, yt, tscale,         \
                               tscale_inv, trs, tcs, fmax, exact, rows, cols);                                  \
    }                                                                                                           \
    extern "C" __global__ void BQ_TILES_ACT_BOUNDS bq_gelu_grad_bf16_##FNAME(const TBF16::T* u, const TBF16::T* dy, int gelu_exact,    \
                                                             u8* y, float* scale, float* scale_inv, u64 srs,     \
                                                             u64 scs, u8* yt, float* tscale, float* tscale_inv,  \
                                                             u64 trs, u64 tcs, float fmax, int exact, int rows,  \
                                                             int cols) {                                         \
        bq_tiles_impl<TBF16, FMT>(u, dy, GeluGradValue<TBF16>{gelu_exact}, y, scale, scale_inv, srs, scs, yt, tscale,    \
                               tscale_inv, trs, tcs, fmax, exact, rows, cols);                                  \
    }                                                                                                           \
    extern "C" __global__ void BQ_TILES_ACT_BOUNDS bq_swiglu_bf16_##FNAME(const TBF16::T* gu, u8* y, float* scale, float* scale_inv, \
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

#define BQ_NORM_ENTRY(FNAME, FMT)                                                                                \
    extern "C" __global__ void BQ_TILES_ACT_BOUNDS bq_norm_bf16_##FNAME(                                         \
        const TBF16::T* x, const TBF16::T* w, const TBF16::T* b, const float* mean, const float* rstd, u8* y,     \
        float* scale, float* scale_inv, u64 srs, u64 scs, u8* yt, float* tscale, float* tscale_inv, u64 trs,     \
        u64 tcs, float fmax, int exact, int rows, int cols) {                                                    \
        bq_tiles_impl<TBF16, FMT>(x, w, NormValue<TBF16>{b, mean, rstd, (u64)cols}, y, scale, scale_inv, srs,    \
                                  scs, yt, tscale, tscale_inv, trs, tcs, fmax, exact, rows, cols);               \
    }

BQ_ACT_ENTRY(e4m3, FP8_E4M3)
BQ_ACT_ENTRY(e5m2, FP8_E5M2)
BQ_NORM_ENTRY(e4m3, FP8_E4M3)
BQ_NORM_ENTRY(e5m2, FP8_E5M2)
