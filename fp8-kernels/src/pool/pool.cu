// Max pooling over NCHW f32 images (see src/pool/mod.rs). Compiled after cuda/common.cuh.

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
