// Element-wise kernels (see src/elementwise/mod.rs for the definitions). Compiled after cuda/common.cuh
// and gelu.cuh. Each computes in f32 with one rounding per operation (mul_rn/add_rn) and stores in the
// element type, exactly as the CPU implementations do.

template <class E>
__device__ void bias_add_impl(typename E::T* x, const typename E::T* bias, u64 rows, u64 cols) {
    const u64 n = rows * cols;
    for (u64 i = global_thread(); i < n; i += grid_threads()) {
        const u64 c = i % cols;
        E::store(x, i, add_rn(E::load(x, i), E::load(bias, c)));
    }
}

template <class E>
__device__ void relu_fwd_impl(const typename E::T* x, typename E::T* y, u64 n) {
    for (u64 i = global_thread(); i < n; i += grid_threads()) {
        const float v = E::load(x, i);
        // NaN propagates, like PyTorch.
        E::store(y, i, (v > 0.0f || v != v) ? v : 0.0f);
    }
}

template <class E>
__device__ void relu_bwd_impl(const typename E::T* x, const typename E::T* dy, typename E::T* dx, u64 n) {
    for (u64 i = global_thread(); i < n; i += grid_threads())
        E::store(dx, i, E::load(x, i) > 0.0f ? E::load(dy, i) : 0.0f);
}

template <class E>
__device__ void gelu_fwd_impl(const typename E::T* x, typename E::T* y, u64 n, int exact) {
    for (u64 i = global_thread(); i < n; i += grid_threads()) E::store(y, i, gelu_value(E::load(x, i), exact));
}

template <class E>
__device__ void gelu_bwd_impl(const typename E::T* x, const typename E::T* dy, typename E::T* dx, u64 n, int exact) {
    for (u64 i = global_thread(); i < n; i += grid_threads())
        E::store(dx, i, mul_rn(gelu_slope(E::load(x, i), exact), E::load(dy, i)));
}

// Counter-based dropout generator: splitmix64 of (seed + counter * golden ratio); the CPU uses the same.
__device__ __forceinline__ u32 dropout_bits(u64 seed, u64 counter) {
    u64 z = seed + counter * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z = z ^ (z >> 31);
    return (u32)(z >> 32);
}

template <class E>
__device__ void dropout_fwd_impl(const typename E::T* x, typename E::T* y, u8* mask, u64 n, u64 seed, u64 offset,
                                 u32 threshold, float scale) {
    for (u64 i = global_thread(); i < n; i += grid_threads()) {
        const bool keep = dropout_bits(seed, offset + i) >= threshold;
        mask[i] = keep ? 1 : 0;
        E::store(y, i, keep ? mul_rn(E::load(x, i), scale) : 0.0f);
    }
}

template <class E>
__device__ void dropout_bwd_impl(const typename E::T* dy, const u8* mask, typename E::T* dx, u64 n, float scale) {
    for (u64 i = global_thread(); i < n; i += grid_threads())
        E::store(dx, i, mask[i] ? mul_rn(E::load(dy, i), scale) : 0.0f);
}

// The three kernels below take 8 elements per step with 16-byte accesses when every pointer is 16-byte
// aligned (the element-wise tail and unaligned inputs go one by one); the arithmetic per element is the same.
__device__ __forceinline__ bool aligned16(const void* a, const void* b, const void* c) {
    return (((unsigned long long)a | (unsigned long long)b | (unsigned long long)c) & 15) == 0;
}

template <class E>
__device__ void scale_impl(typename E::T* x, u64 n, float a) {
    u64 done = 0;
    if (aligned16(x, x, x)) {
        const u64 groups = n / 8;
        for (u64 g = global_thread(); g < groups; g += grid_threads()) {
            float v[8];
            E::load8(x, g * 8, v);
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = mul_rn(v[k], a);
            E::store8(x, g * 8, v);
        }
        done = groups * 8;
    }
    for (u64 i = done + global_thread(); i < n; i += grid_threads()) E::store(x, i, mul_rn(E::load(x, i), a));
}

// out[i] = op(a[i], b[i]) (8 elements a thread where the buffers allow 16-byte accesses).
template <class E, class Op>
__device__ __forceinline__ void zip_impl(const typename E::T* a, const typename E::T* b, typename E::T* out, u64 n,
                                         Op op) {
    u64 done = 0;
    if (aligned16(a, b, out)) {
        const u64 groups = n / 8;
        for (u64 g = global_thread(); g < groups; g += grid_threads()) {
            float av[8], bv[8];
            E::load8(a, g * 8, av);
            E::load8(b, g * 8, bv);
#pragma unroll
            for (int k = 0; k < 8; ++k) av[k] = op(av[k], bv[k]);
            E::store8(out, g * 8, av);
        }
        done = groups * 8;
    }
    for (u64 i = done + global_thread(); i < n; i += grid_threads()) E::store(out, i, op(E::load(a, i), E::load(b, i)));
}

// y = y + a * x.
template <class E>
__device__ void axpy_impl(const typename E::T* x, typename E::T* y, u64 n, float a) {
    zip_impl<E>(x, y, y, n, [a](float xv, float yv) { return add_rn(yv, mul_rn(a, xv)); });
}

template <class E>
__device__ void add_impl(const typename E::T* a, const typename E::T* b, typename E::T* out, u64 n) {
    zip_impl<E>(a, b, out, n, [](float av, float bv) { return add_rn(av, bv); });
}

// ---- dst[offset + i] += src[i]: one f32 addition (exact for an f32 destination) ----
extern "C" __global__ void add_at_f32(float* dst, u64 offset, const float* src, u64 n) {
    for (u64 i = global_thread(); i < n; i += grid_threads()) dst[offset + i] = add_rn(dst[offset + i], src[i]);
}
extern "C" __global__ void add_at_bf16(float* dst, u64 offset, const u16* src, u64 n) {
    for (u64 i = global_thread(); i < n; i += grid_threads())
        dst[offset + i] = add_rn(dst[offset + i], bf16_to_f32(src[i]));
}

// ---- BF16 destinations: dst = bf16_rne(f32(dst) + src), one f32 add, one rounding ----
template <class S>
__device__ void add_at_to_bf16_impl(u16* dst, u64 offset, const typename S::T* src, u64 n) {
    for (u64 i = global_thread(); i < n; i += grid_threads())
        dst[offset + i] = f32_to_bf16(add_rn(bf16_to_f32(dst[offset + i]), S::load(src, i)));
}
extern "C" __global__ void add_at_f32_to_bf16(u16* dst, u64 offset, const float* src, u64 n) {
    add_at_to_bf16_impl<TF32>(dst, offset, src, n);
}
extern "C" __global__ void add_at_bf16_to_bf16(u16* dst, u64 offset, const u16* src, u64 n) {
    add_at_to_bf16_impl<TBF16>(dst, offset, src, n);
}

// ---- extern "C" entry points of the typed kernels ----
#define ELEMENTWISE_ENTRIES(NAME, E)                                                                                        \
    extern "C" __global__ void bias_add_##NAME(E::T* x, const E::T* b, u64 rows, u64 cols) {                         \
        bias_add_impl<E>(x, b, rows, cols);                                                                         \
    }                                                                                                               \
    extern "C" __global__ void relu_fwd_##NAME(const E::T* x, E::T* y, u64 n) { relu_fwd_impl<E>(x, y, n); }        \
    extern "C" __global__ void relu_bwd_##NAME(const E::T* x, const E::T* dy, E::T* dx, u64 n) {                     \
        relu_bwd_impl<E>(x, dy, dx, n);                                                                             \
    }                                                                                                               \
    extern "C" __global__ void gelu_fwd_##NAME(const E::T* x, E::T* y, u64 n, int exact) {                            \
        gelu_fwd_impl<E>(x, y, n, exact);                                                                           \
    }                                                                                                               \
    extern "C" __global__ void gelu_bwd_##NAME(const E::T* x, const E::T* dy, E::T* dx, u64 n, int exact) {           \
        gelu_bwd_impl<E>(x, dy, dx, n, exact);                                                                      \
    }                                                                                                               \
    extern "C" __global__ void dropout_fwd_##NAME(const E::T* x, E::T* y, u8* mask, u64 n, u64 seed, u64 offset,     \
                                                  u32 threshold, float scale) {                                     \
        dropout_fwd_impl<E>(x, y, mask, n, seed, offset, threshold, scale);                                         \
    }                                                                                                               \
    extern "C" __global__ void dropout_bwd_##NAME(const E::T* dy, const u8* mask, E::T* dx, u64 n, float scale) {   \
        dropout_bwd_impl<E>(dy, mask, dx, n, scale);                                                                \
    }                                                                                                               \
    extern "C" __global__ void scale_##NAME(E::T* x, u64 n, float a) { scale_impl<E>(x, n, a); }                      \
    extern "C" __global__ void axpy_##NAME(const E::T* x, E::T* y, u64 n, float a) { axpy_impl<E>(x, y, n, a); }      \
    extern "C" __global__ void add_##NAME(const E::T* a, const E::T* b, E::T* out, u64 n) {                          \
        add_impl<E>(a, b, out, n);                                                                                  \
    }
ELEMENTWISE_ENTRIES(f32, TF32)
ELEMENTWISE_ENTRIES(bf16, TBF16)
ELEMENTWISE_ENTRIES(f16, TF16)
