// Layer operations for the example networks. Prepended with common.cuh.
// Elementwise kernels compute in f32 with one rounding per operation (mul_rn/add_rn) and store in the
// element type, exactly as the CPU implementations do. Reductions use fixed summation orders that the CPU
// implementations reproduce, where stated.

// ---- elementwise ----
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

template <class E>
__device__ void gelu_fwd_impl(const typename E::T* x, typename E::T* y, u64 n, int exact) {
    for (u64 i = global_thread(); i < n; i += grid_threads()) {
        const float v = E::load(x, i);
        float g;
        if (exact) {
            g = mul_rn(mul_rn(0.5f, v), add_rn(1.0f, erf_approx(mul_rn(v, INV_SQRT2))));
        } else {
            const float u = mul_rn(GELU_K0, add_rn(v, mul_rn(GELU_K1, mul_rn(mul_rn(v, v), v))));
            g = mul_rn(mul_rn(0.5f, v), add_rn(1.0f, tanhf(u)));
        }
        E::store(y, i, g);
    }
}

template <class E>
__device__ void gelu_bwd_impl(const typename E::T* x, const typename E::T* dy, typename E::T* dx, u64 n, int exact) {
    for (u64 i = global_thread(); i < n; i += grid_threads()) {
        const float v = E::load(x, i);
        float d;
        if (exact) {
            const float cdf = mul_rn(0.5f, add_rn(1.0f, erf_approx(mul_rn(v, INV_SQRT2))));
            const float pdf = mul_rn(INV_SQRT_2PI, expf(mul_rn(-0.5f, mul_rn(v, v))));
            d = add_rn(cdf, mul_rn(v, pdf));
        } else {
            const float v2 = mul_rn(v, v);
            const float u = mul_rn(GELU_K0, add_rn(v, mul_rn(GELU_K1, mul_rn(v2, v))));
            const float t = tanhf(u);
            const float du = mul_rn(GELU_K0, add_rn(1.0f, mul_rn(3.0f * GELU_K1, v2)));
            d = add_rn(mul_rn(0.5f, add_rn(1.0f, t)),
                       mul_rn(mul_rn(mul_rn(0.5f, v), add_rn(1.0f, -mul_rn(t, t))), du));
        }
        E::store(dx, i, mul_rn(d, E::load(dy, i)));
    }
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

template <class E>
__device__ void axpy_impl(const typename E::T* x, typename E::T* y, u64 n, float a) {
    u64 done = 0;
    if (aligned16(x, y, y)) {
        const u64 groups = n / 8;
        for (u64 g = global_thread(); g < groups; g += grid_threads()) {
            float xv[8], yv[8];
            E::load8(x, g * 8, xv);
            E::load8(y, g * 8, yv);
#pragma unroll
            for (int k = 0; k < 8; ++k) yv[k] = add_rn(yv[k], mul_rn(a, xv[k]));
            E::store8(y, g * 8, yv);
        }
        done = groups * 8;
    }
    for (u64 i = done + global_thread(); i < n; i += grid_threads())
        E::store(y, i, add_rn(E::load(y, i), mul_rn(a, E::load(x, i))));
}

template <class E>
__device__ void add_impl(const typename E::T* a, const typename E::T* b, typename E::T* out, u64 n) {
    u64 done = 0;
    if (aligned16(a, b, out)) {
        const u64 groups = n / 8;
        for (u64 g = global_thread(); g < groups; g += grid_threads()) {
            float av[8], bv[8];
            E::load8(a, g * 8, av);
            E::load8(b, g * 8, bv);
#pragma unroll
            for (int k = 0; k < 8; ++k) av[k] = add_rn(av[k], bv[k]);
            E::store8(out, g * 8, av);
        }
        done = groups * 8;
    }
    for (u64 i = done + global_thread(); i < n; i += grid_threads()) E::store(out, i, add_rn(E::load(a, i), E::load(b, i)));
}

// ---- reductions ----
// Column sums (sum over rows) in two fixed levels, so that no thread walks all the rows (a conv bias
// gradient has ~40k rows and only 32-64 columns): thread (k, c) sums rows [k*chunk, (k+1)*chunk) of column
// c in row order into partial[k*cols + c]; then sum_partials adds the chunk sums in chunk order, starting
// from chunk 0. With one chunk the first kernel writes the result directly. The CPU reproduces the order.
template <class E>
__device__ void sum_rows_impl(const typename E::T* x, float* partial, u64 rows, u64 cols, u64 chunk) {
    const u64 chunks = rows == 0 ? 1 : (rows + chunk - 1) / chunk;
    const u64 total = chunks * cols;
    for (u64 i = global_thread(); i < total; i += grid_threads()) {
        const u64 c = i % cols, k = i / cols;
        const u64 r0 = k * chunk, r1 = min(r0 + chunk, rows);
        float s = 0.0f;
        for (u64 r = r0; r < r1; ++r) s = add_rn(s, E::load(x, r * cols + c));
        partial[i] = s;
    }
}

extern "C" __global__ void sum_partials_f32(const float* partial, float* out, u64 chunks, u64 cols) {
    for (u64 c = global_thread(); c < cols; c += grid_threads()) {
        float s = partial[c];
        for (u64 k = 1; k < chunks; ++k) s = add_rn(s, partial[k * cols + c]);
        out[c] = s;
    }
}

// Butterfly sum over a warp: lane l ends with the same value in every lane; the CPU reproduces the order
// (32 lane-strided partial sums, then xor-pairs at distances 16, 8, 4, 2, 1).
__device__ __forceinline__ float warp_sum_butterfly(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = add_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
    return v;
}

// Row sums (sum over columns): one warp per row.
template <class E>
__device__ void sum_cols_impl(const typename E::T* x, float* out, u64 rows, u64 cols) {
    const u64 warp = global_thread() >> 5, nwarps = grid_threads() >> 5;
    const int lane = threadIdx.x & 31;
    for (u64 r = warp; r < rows; r += nwarps) {
        float s = 0.0f;
        for (u64 c = lane; c < cols; c += 32) s = add_rn(s, E::load(x, r * cols + c));
        s = warp_sum_butterfly(s);
        if (lane == 0) out[r] = s;
    }
}

// ---- log-softmax + NLL (f32) ----
// One warp per row: max, then sum of exp(x - max) in the butterfly order, lse = max + log(sum).
extern "C" __global__ void log_softmax_fwd(const float* x, float* lp, u64 rows, u64 classes) {
    const u64 warp = global_thread() >> 5, nwarps = grid_threads() >> 5;
    const int lane = threadIdx.x & 31;
    for (u64 r = warp; r < rows; r += nwarps) {
        const float* row = x + r * classes;
        float m = __int_as_float(0xFF800000);  // -inf
        for (u64 c = lane; c < classes; c += 32) m = fmaxf(m, row[c]);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
        float s = 0.0f;
        for (u64 c = lane; c < classes; c += 32) s = add_rn(s, expf(add_rn(row[c], -m)));
        s = warp_sum_butterfly(s);
        const float lse = add_rn(m, logf(s));
        for (u64 c = lane; c < classes; c += 32) lp[r * classes + c] = add_rn(row[c], -lse);
    }
}

// stats = [mean NLL over rows, number of rows whose argmax is the label, number of invalid labels].
// One block; fixed per-thread order and a fixed tree, so the result is deterministic.
#define NLL_THREADS 256
extern "C" __global__ void nll_stats(const float* lp, const int* labels, float* stats, u64 rows, u64 classes) {
    __shared__ float s_loss[NLL_THREADS];
    __shared__ u32 s_correct[NLL_THREADS];
    __shared__ u32 s_invalid[NLL_THREADS];
    float loss = 0.0f;
    u32 correct = 0, invalid = 0;
    for (u64 r = threadIdx.x; r < rows; r += blockDim.x) {
        const int label = labels[r];
        const float* row = lp + r * classes;
        if (label < 0 || (u64)label >= classes) {
            ++invalid;
            continue;
        }
        loss = add_rn(loss, -row[label]);
        u64 best = 0;
        for (u64 c = 1; c < classes; ++c)
            if (row[c] > row[best]) best = c;
        correct += best == (u64)label;
    }
    s_loss[threadIdx.x] = loss;
    s_correct[threadIdx.x] = correct;
    s_invalid[threadIdx.x] = invalid;
    __syncthreads();
    for (int w = NLL_THREADS / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) {
            s_loss[threadIdx.x] = add_rn(s_loss[threadIdx.x], s_loss[threadIdx.x + w]);
            s_correct[threadIdx.x] += s_correct[threadIdx.x + w];
            s_invalid[threadIdx.x] += s_invalid[threadIdx.x + w];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        stats[0] = rows > 0 ? div_rn(s_loss[0], (float)rows) : 0.0f;
        stats[1] = (float)s_correct[0];
        stats[2] = (float)s_invalid[0];
    }
}

// d logits = (softmax - onehot(label)) * grad_scale.
extern "C" __global__ void log_softmax_nll_bwd(const float* lp, const int* labels, float* dx, u64 rows, u64 classes,
                                               float grad_scale) {
    const u64 n = rows * classes;
    for (u64 i = global_thread(); i < n; i += grid_threads()) {
        const u64 r = i / classes, c = i % classes;
        const float p = expf(lp[i]);
        const float g = (u64)labels[r] == c && labels[r] >= 0 ? add_rn(p, -1.0f) : p;
        dx[i] = mul_rn(g, grad_scale);
    }
}

// ---- im2col / col2im (f32, NCHW) ----
// cols is row-major [batch * out_h * out_w, channels * kh * kw]: one row per output pixel (n, oy, ox), one
// column per (c, ky, kx), so a convolution is cols x W^T with W [out_channels, channels * kh * kw].
struct ConvGeom {
    int n, c, h, w, kh, kw, stride, pad, oh, ow;
};

extern "C" __global__ void im2col_f32(const float* x, float* cols, ConvGeom g) {
    const u64 patch = (u64)g.c * g.kh * g.kw;
    const u64 total = (u64)g.n * g.oh * g.ow * patch;
    for (u64 i = global_thread(); i < total; i += grid_threads()) {
        const u64 row = i / patch, col = i % patch;
        const int kx = (int)(col % g.kw), ky = (int)((col / g.kw) % g.kh), ci = (int)(col / ((u64)g.kw * g.kh));
        const int ox = (int)(row % g.ow), oy = (int)((row / g.ow) % g.oh), ni = (int)(row / ((u64)g.ow * g.oh));
        const int yy = oy * g.stride - g.pad + ky, xx = ox * g.stride - g.pad + kx;
        float v = 0.0f;
        if (yy >= 0 && yy < g.h && xx >= 0 && xx < g.w) v = x[(((u64)ni * g.c + ci) * g.h + yy) * g.w + xx];
        cols[i] = v;
    }
}

// dx[n, c, y, x] = sum over the patches that read it, ky then kx ascending (the CPU uses the same order).
extern "C" __global__ void col2im_f32(const float* cols, float* dx, ConvGeom g) {
    const u64 patch = (u64)g.c * g.kh * g.kw;
    const u64 total = (u64)g.n * g.c * g.h * g.w;
    for (u64 i = global_thread(); i < total; i += grid_threads()) {
        const int xx = (int)(i % g.w), yy = (int)((i / g.w) % g.h), ci = (int)((i / ((u64)g.w * g.h)) % g.c);
        const int ni = (int)(i / ((u64)g.w * g.h * g.c));
        float s = 0.0f;
        for (int ky = 0; ky < g.kh; ++ky) {
            const int ty = yy + g.pad - ky;
            if (ty < 0 || ty % g.stride != 0) continue;
            const int oy = ty / g.stride;
            if (oy >= g.oh) continue;
            for (int kx = 0; kx < g.kw; ++kx) {
                const int tx = xx + g.pad - kx;
                if (tx < 0 || tx % g.stride != 0) continue;
                const int ox = tx / g.stride;
                if (ox >= g.ow) continue;
                const u64 row = ((u64)ni * g.oh + oy) * g.ow + ox;
                const u64 col = ((u64)ci * g.kh + ky) * g.kw + kx;
                s = add_rn(s, cols[row * patch + col]);
            }
        }
        dx[i] = s;
    }
}

// y[b, c, r] = x[b, r, c].
template <class E>
__device__ void transpose_batched_impl(const typename E::T* x, typename E::T* y, u64 batch, u64 rows, u64 cols) {
    const u64 total = batch * rows * cols;
    for (u64 i = global_thread(); i < total; i += grid_threads()) {
        const u64 r = i % rows, c = (i / rows) % cols, b = i / (rows * cols);
        y[i] = x[(b * rows + r) * cols + c];
    }
}

// ---- max pooling (f32, NCHW, no padding) ----
struct PoolGeom {
    int n, c, h, w, k, stride, oh, ow;
};

// idx holds the flat index into x of each output's maximum (first maximum in row-major window order; a
// NaN wins, like PyTorch).
extern "C" __global__ void maxpool_fwd_f32(const float* x, float* y, u32* idx, PoolGeom g) {
    const u64 total = (u64)g.n * g.c * g.oh * g.ow;
    for (u64 i = global_thread(); i < total; i += grid_threads()) {
        const int ox = (int)(i % g.ow), oy = (int)((i / g.ow) % g.oh);
        const u64 plane = i / ((u64)g.ow * g.oh);
        const u64 base = plane * g.h * g.w;
        u64 best_i = base + (u64)(oy * g.stride) * g.w + ox * g.stride;
        float best = x[best_i];
        for (int ky = 0; ky < g.k; ++ky)
            for (int kx = 0; kx < g.k; ++kx) {
                const u64 j = base + (u64)(oy * g.stride + ky) * g.w + ox * g.stride + kx;
                const float v = x[j];
                if (v > best || (v != v && best == best)) {
                    best = v;
                    best_i = j;
                }
            }
        y[i] = best;
        idx[i] = (u32)best_i;
    }
}

// dx must be zero on entry; dx[idx[i]] += dy[i].
extern "C" __global__ void maxpool_bwd_f32(const float* dy, const u32* idx, float* dx, u64 n) {
    for (u64 i = global_thread(); i < n; i += grid_threads()) atomicAdd(dx + idx[i], dy[i]);
}

// ---- extern "C" entry points of the typed kernels ----
#define OPS_ENTRIES(NAME, E)                                                                                        \
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
    }                                                                                                               \
    extern "C" __global__ void sum_rows_##NAME(const E::T* x, float* partial, u64 rows, u64 cols, u64 chunk) {       \
        sum_rows_impl<E>(x, partial, rows, cols, chunk);                                                            \
    }                                                                                                               \
    extern "C" __global__ void sum_cols_##NAME(const E::T* x, float* out, u64 rows, u64 cols) {                      \
        sum_cols_impl<E>(x, out, rows, cols);                                                                       \
    }                                                                                                               \
    extern "C" __global__ void transpose_batched_##NAME(const E::T* x, E::T* y, u64 batch, u64 rows, u64 cols) {     \
        transpose_batched_impl<E>(x, y, batch, rows, cols);                                                         \
    }
OPS_ENTRIES(f32, TF32)
OPS_ENTRIES(bf16, TBF16)
