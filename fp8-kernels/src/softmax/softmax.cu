// Log-softmax and negative log-likelihood over rows of f32 logits (see src/softmax/mod.rs). Compiled after
// cuda/common.cuh.

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
