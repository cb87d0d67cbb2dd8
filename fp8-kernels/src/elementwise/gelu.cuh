// GELU's arithmetic, shared by the element-wise GELU kernels (elementwise.cu) and the fused GELU casts
// (gelu_cast.cu), so both compute every value with the same operations in the same order. Compiled after
// cuda/common.cuh.

#define GELU_K0 0.7978845608028654f  // sqrt(2/pi)
#define GELU_K1 0.044715f
#define INV_SQRT2 0.7071067811865476f
#define INV_SQRT_2PI 0.3989422804014327f

// erf from the Chebyshev erfc fit of Numerical Recipes (fractional error < 1.2e-7); the CPU uses the
// same expression. The reciprocal is the correctly rounded one (__frcp_rn equals 1.0f / x exactly, in
// fewer instructions than a division: the fused GELU casts are bound by this arithmetic).
__device__ __forceinline__ float erf_approx(float x) {
    const float z = fabsf(x);
    const float t = __frcp_rn(add_rn(1.0f, mul_rn(0.5f, z)));
    float p = 0.17087277f;
    p = add_rn(mul_rn(t, p), -0.82215223f);
    p = add_rn(mul_rn(t, p), 1.48851587f);
    p = add_rn(mul_rn(t, p), -1.13520398f);
    p = add_rn(mul_rn(t, p), 0.27886807f);
    p = add_rn(mul_rn(t, p), -0.18628806f);
    p = add_rn(mul_rn(t, p), 0.09678418f);
    p = add_rn(mul_rn(t, p), 0.37409196f);
    p = add_rn(mul_rn(t, p), 1.00002368f);
    p = add_rn(mul_rn(t, p), -1.26551223f);
    const float ans = mul_rn(t, expf(add_rn(-mul_rn(z, z), p)));
    return x >= 0.0f ? add_rn(1.0f, -ans) : add_rn(ans, -1.0f);
}

// GELU of one value (the CPU's `gelu_scalar`).
__device__ __forceinline__ float gelu_value(float v, int exact) {
    if (exact) return mul_rn(mul_rn(0.5f, v), add_rn(1.0f, erf_approx(mul_rn(v, INV_SQRT2))));
    const float u = mul_rn(GELU_K0, add_rn(v, mul_rn(GELU_K1, mul_rn(mul_rn(v, v), v))));
    return mul_rn(mul_rn(0.5f, v), add_rn(1.0f, tanhf(u)));
}

// d GELU / dx at one value (the CPU's `gelu_grad_scalar`), before the multiplication by dy.
__device__ __forceinline__ float gelu_slope(float v, int exact) {
    if (exact) {
        const float cdf = mul_rn(0.5f, add_rn(1.0f, erf_approx(mul_rn(v, INV_SQRT2))));
        const float pdf = mul_rn(INV_SQRT_2PI, expf(mul_rn(-0.5f, mul_rn(v, v))));
        return add_rn(cdf, mul_rn(v, pdf));
    }
    const float v2 = mul_rn(v, v);
    const float u = mul_rn(GELU_K0, add_rn(v, mul_rn(GELU_K1, mul_rn(v2, v))));
    const float t = tanhf(u);
    const float du = mul_rn(GELU_K0, add_rn(1.0f, mul_rn(3.0f * GELU_K1, v2)));
    return add_rn(mul_rn(0.5f, add_rn(1.0f, t)), mul_rn(mul_rn(mul_rn(0.5f, v), add_rn(1.0f, -mul_rn(t, t))), du));
}

// The value functors (common.cuh's protocol) of the fused casts (gelu_cast.cu, block_quantize.cu): gelu(x), or gelu'(x) * dy, rounded to the element type.
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

