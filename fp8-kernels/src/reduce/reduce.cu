// Reductions (see src/reduce/mod.rs for the definitions). Compiled after cuda/common.cuh. Sums use fixed
// orders that the CPU implementations reproduce, except the f64 sum of squares of norm_stats (atomics).

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

#define REDUCE_ENTRIES(NAME, E)                                                                                     \
    extern "C" __global__ void sum_rows_##NAME(const E::T* x, float* partial, u64 rows, u64 cols, u64 chunk) {       \
        sum_rows_impl<E>(x, partial, rows, cols, chunk);                                                            \
    }                                                                                                               \
    extern "C" __global__ void sum_cols_##NAME(const E::T* x, float* out, u64 rows, u64 cols) {                      \
        sum_cols_impl<E>(x, out, rows, cols);                                                                       \
    }
REDUCE_ENTRIES(f32, TF32)
REDUCE_ENTRIES(bf16, TBF16)

// ---- amax of the finite values and count of the non-finite ones (a saturating cast would hide them) ----
// amax[0] = max(amax[0], max finite |x|); count[0] += number of NaN/inf.
extern "C" __global__ void finite_amax_count_f32(const float* x, float* amax, u32* count, u64 n) {
    int m = 0;
    u32 bad = 0;
    for (u64 i = global_thread(); i < n; i += grid_threads()) {
        const u32 a = __float_as_uint(x[i]) & 0x7FFFFFFFu;
        if (a >= 0x7F800000u) {
            ++bad;
        } else {
            m = max(m, (int)a);
        }
    }
    bad = __reduce_add_sync(0xFFFFFFFFu, bad);
    if ((threadIdx.x & 31) == 0 && bad != 0) atomicAdd(count, bad);
    block_amax_commit(m, amax);
}

// ---- norm statistics: acc = [f64 sum of squares of the finite values (2 words), u32 non-finite count] ----
// and the amax of the finite values into amax[slot] (with_amax != 0). G is TF32 or TBF16 (BF16 widens
// exactly to f32).
template <class G>
__device__ void norm_stats_impl(const typename G::T* g, u64 off, u64 n, float* acc, float* amax, u64 slot,
                                int with_amax) {
    double sq = 0.0;
    u32 nf = 0;
    int am = 0;
    for (u64 i = global_thread(); i < n; i += grid_threads()) {
        const float x = G::load(g, off + i);
        if (isfinite(x)) {
            sq = __dadd_rn(sq, __dmul_rn((double)x, (double)x));
            am = imax(am, abs_bits_no_nan(x));
        } else {
            nf += 1;
        }
    }
    __shared__ double wsq[32];
    __shared__ u32 wnf[32];
    for (int o = 16; o > 0; o >>= 1) {
        sq += __shfl_down_sync(0xFFFFFFFFu, sq, o);
        nf += __shfl_down_sync(0xFFFFFFFFu, nf, o);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        wsq[warp] = sq;
        wnf[warp] = nf;
    }
    block_amax_commit(am, with_amax ? amax + slot : nullptr);
    __syncthreads();
    if (threadIdx.x == 0) {
        double s = 0.0;
        u32 c = 0;
        for (int w = 0; w < (int)((blockDim.x + 31) >> 5); ++w) {
            s += wsq[w];
            c += wnf[w];
        }
        atomicAdd(reinterpret_cast<double*>(acc), s);
        atomicAdd(reinterpret_cast<u32*>(acc + 2), c);
    }
}
extern "C" __global__ void norm_stats_f32(const float* g, u64 off, u64 n, float* acc, float* amax, u64 slot,
                                          int with_amax) {
    norm_stats_impl<TF32>(g, off, n, acc, amax, slot, with_amax);
}
extern "C" __global__ void norm_stats_bf16(const u16* g, u64 off, u64 n, float* acc, float* amax, u64 slot,
                                           int with_amax) {
    norm_stats_impl<TBF16>(g, off, n, acc, amax, slot, with_amax);
}

// The accumulator's non-finite count += count[0] (wrapping); count[0] = 0.
extern "C" __global__ void norm_stats_take_count(float* acc, u32* count) {
    if (global_thread() != 0) return;
    u32* nf = reinterpret_cast<u32*>(acc + 2);
    *nf = *nf + *count;
    *count = 0u;
}

// sums[0] = non-finite count (+ extra), sums[1] = sum of squares as f32; the accumulator is cleared.
extern "C" __global__ void norm_stats_finish(float* acc, u32 extra_nonfinite, float* sums) {
    if (global_thread() != 0) return;
    const double sq = *reinterpret_cast<double*>(acc);
    const u32 nf = *reinterpret_cast<u32*>(acc + 2) + extra_nonfinite;
    sums[0] = (float)nf;
    sums[1] = __double2float_rn(sq);
    acc[0] = 0.0f;
    acc[1] = 0.0f;
    acc[2] = 0.0f;
    acc[3] = 0.0f;
}
