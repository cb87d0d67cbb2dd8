// SwiGLU's arithmetic (see src/swiglu_cast/mod.rs for the definitions), shared by swiglu_cast.cu and the
// block-scaled casts of block_quantize.cu, so that every kernel computes the same values. Compiled after
// cuda/common.cuh. Every value is computed with f32 operations rounded once each (mul_rn/add_rn/div_rn,
// fused multiply-adds only inside swiglu_exp, as the CPU's exp_fixed has them), so CPU and CUDA agree bit
// for bit.

#define SW_F(bits) __uint_as_float(bits##u)

// exp(x) exactly as the CPU's cross_entropy::exp_fixed computes it, over the whole range: clamp to
// [-104, 89] (selects that keep NaN), k = rint(x log2 e), Cody-Waite reduction by ln 2, Cephes' degree-5
// polynomial with fused multiply-adds, then y * 2^(k -+ 64) (exact) times 2^(+-64) (one rounding). NaN
// converts to k = 0 (cvt.rzi gives 0 for NaN, as Rust's `as i32`) and propagates through y.
__device__ __forceinline__ float swiglu_exp(float x) {
    x = x < -104.0f ? -104.0f : x;
    x = x > 89.0f ? 89.0f : x;
    const float kf = rintf(mul_rn(x, SW_F(0x3FB8AA3B)));  // log2(e)
    float r = __fmaf_rn(-kf, SW_F(0x3F318000), x);         // ln2 high part
    r = __fmaf_rn(-kf, SW_F(0xB95E8083), r);               // ln2 low part
    float p = SW_F(0x39506967);
    p = __fmaf_rn(p, r, SW_F(0x3AB743CE));
    p = __fmaf_rn(p, r, SW_F(0x3C088908));
    p = __fmaf_rn(p, r, SW_F(0x3D2AA9C1));
    p = __fmaf_rn(p, r, SW_F(0x3E2AAAAA));
    p = __fmaf_rn(p, r, SW_F(0x3F000000));
    const float y = add_rn(__fmaf_rn(p, mul_rn(r, r), r), 1.0f);
    const int k = __float2int_rz(kf);
    const int k2 = k > 63 ? k - 64 : k + 64;
    const float f = k > 63 ? SW_F(0x5F800000) : SW_F(0x1F800000);  // 2^64 : 2^-64
    return mul_rn(mul_rn(y, __int_as_float((k2 + 127) << 23)), f);
}

// silu(g) * u (the CPU's swiglu_scalar).
__device__ __forceinline__ float swiglu_value(float g, float u) {
    const float silu = div_rn(g, add_rn(1.0f, swiglu_exp(-g)));
    return mul_rn(silu, u);
}

// dgate = (d * u) * silu'(g) and dup = d * silu(g) (the CPU's swiglu_grad_scalars), each alone: an
// output element is one of the two, and each needs one of the two divisions.
__device__ __forceinline__ float swiglu_dgate(float g, float u, float d) {
    const float den = add_rn(1.0f, swiglu_exp(-g));
    const float s = div_rn(1.0f, den);
    const float dsilu = mul_rn(s, add_rn(1.0f, mul_rn(g, add_rn(1.0f, -s))));
    return mul_rn(mul_rn(d, u), dsilu);
}
__device__ __forceinline__ float swiglu_dup(float g, float d) {
    const float den = add_rn(1.0f, swiglu_exp(-g));
    return mul_rn(d, div_rn(g, den));
}

// The value of output element i rounded to the element type. Forward: h [rows, f] from gu [rows, 2f].
// Backward: [dgate | dup] [rows, 2f] from gu and dh [rows, f]. value8 reads 8 consecutive outputs starting
// at a multiple of 8 (the vectorised cast path, where f is a multiple of 32, so the 8 never straddle the
// gate/up boundary and every 8-element access is 16-byte aligned).
template <class E>
struct SwigluValue {
    u64 f;
    __device__ __forceinline__ float value(const typename E::T* gu, const typename E::T*, u64 i) const {
        u64 r, c;
        divmod_u64(i, f, r, c);
        return round_through<E>(swiglu_value(E::load(gu, 2 * f * r + c), E::load(gu, 2 * f * r + f + c)));
    }
    __device__ __forceinline__ void value8(const typename E::T* gu, const typename E::T*, u64 i, float (&h)[8]) const {
        u64 r, c;
        divmod_u64(i, f, r, c);
        float u[8];
        E::load8(gu, 2 * f * r + c, h);
        E::load8(gu, 2 * f * r + f + c, u);
#pragma unroll
        for (int k = 0; k < 8; ++k) h[k] = round_through<E>(swiglu_value(h[k], u[k]));
    }
};
template <class E>
struct SwigluGradValue {
    u64 f;
    __device__ __forceinline__ float value(const typename E::T* gu, const typename E::T* dh, u64 i) const {
        u64 r, c;
        divmod_u64(i, 2 * f, r, c);
        const u64 k = c < f ? c : c - f;
        const float g = E::load(gu, 2 * f * r + k), d = E::load(dh, f * r + k);
        return round_through<E>(c < f ? swiglu_dgate(g, E::load(gu, 2 * f * r + f + k), d) : swiglu_dup(g, d));
    }
    // The 8 outputs lie in one half (see above): the gate half reads g, u and d, the up half g and d.
    __device__ __forceinline__ void value8(const typename E::T* gu, const typename E::T* dh, u64 i, float (&h)[8]) const {
        u64 r, c;
        divmod_u64(i, 2 * f, r, c);
        float g[8], d[8];
        if (c < f) {
            float u[8];
            E::load8(gu, 2 * f * r + c, g);
            E::load8(gu, 2 * f * r + f + c, u);
            E::load8(dh, f * r + c, d);
#pragma unroll
            for (int k = 0; k < 8; ++k) h[k] = round_through<E>(swiglu_dgate(g[k], u[k], d[k]));
        } else {
            E::load8(gu, 2 * f * r + c - f, g);
            E::load8(dh, f * r + c - f, d);
#pragma unroll
            for (int k = 0; k < 8; ++k) h[k] = round_through<E>(swiglu_dup(g[k], d[k]));
        }
    }
};
