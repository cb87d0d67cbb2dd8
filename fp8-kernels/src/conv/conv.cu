// im2col, col2im and the batched transpose around a convolution's GEMM (see src/conv/mod.rs). Compiled after
// cuda/common.cuh.

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

#define TRANSPOSE_ENTRY(NAME, E)                                                                               \
    extern "C" __global__ void transpose_batched_##NAME(const E::T* x, E::T* y, u64 batch, u64 rows, u64 cols) { \
        transpose_batched_impl<E>(x, y, batch, rows, cols); \
    }
TRANSPOSE_ENTRY(f32, TF32)
TRANSPOSE_ENTRY(bf16, TBF16)
