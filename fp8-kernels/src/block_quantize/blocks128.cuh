// The 128x128-block cast, shared by block_quantize.cu (bq_128x128_<type>_<fmt>) and the Adam step's cast of
// block-scaled FP8 weights from their masters (cast_weight_blocks in src/adam/control.cu), so that both
// compute every amax, scale and code the same way. Compiled after cuda/common.cuh.
//
// Rules (fp8_core::block_scale, as on the CPU): a block's scale is compute_scale_dev(amax, fmax, 0, exact, 1.0f)
// (margin 0; scale 1 for a zero or non-finite amax) from the amax of its real elements (NaN ignored); the code of
// x is fp8(x * scale) with one f32 multiply; scale_inv = 1 / scale (one f32 division). Partial blocks at the
// edges read only their real elements.

#define BQ_TILE 128

// One lane's part of a block's amax, the warp's maximum in every lane.
__device__ __forceinline__ int warp_max_bits(int m) { return __reduce_max_sync(0xFFFFFFFFu, m); }

// Blocks of 128 along a side of n > 0 elements (no int overflow for n up to INT_MAX).
__device__ __forceinline__ int bq_blocks(int n) { return n / BQ_TILE + (n % BQ_TILE != 0 ? 1 : 0); }

// An input array of element type In as a source of f32 values.
template <class In>
struct BqArray {
    const typename In::T* x;
    __device__ __forceinline__ float operator()(u64 i) const { return In::load(x, i); }
};

// ---- 128x128 blocks: src [rows, cols] -> y [rows, cols], scales [ceil(rows/128), ceil(cols/128)] ----
// `src(i)` is element i of the row-major input (read twice: once for the amax, once for the codes). Block (i, j)'s
// scale goes to scale[i * srs + j * scs] (skipped when scale is null) and its inverse to scale_inv[...].
// One block of 256 threads per scale block, grid-stride over blocks: thread (lane, warp) covers columns
// lane + 32q and rows warp + 8k; a first pass takes the amax, a second (from cache) encodes.
template <int FMT, class Src>
__device__ void bq_128x128_impl(Src src, u8* y, float* scale, float* scale_inv, u64 srs, u64 scs, float fmax,
                                int exact, int rows, int cols) {
    __shared__ int warp_max[8];
    __shared__ float s_scale;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int grid_r = bq_blocks(rows), grid_c = bq_blocks(cols);
    for (u64 b = blockIdx.x; b < (u64)grid_r * grid_c; b += gridDim.x) {
        const int r0 = (int)(b / grid_c) * BQ_TILE, c0 = (int)(b % grid_c) * BQ_TILE;
        const int h = min(BQ_TILE, rows - r0), w = min(BQ_TILE, cols - c0);
        int m = 0;
        for (int k = warp; k < h; k += 8) {
            const u64 row = (u64)(r0 + k) * cols + c0;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int cc = lane + 32 * q;
                if (cc < w) m = max(m, abs_bits_no_nan(src(row + cc)));
            }
        }
        m = warp_max_bits(m);
        if (lane == 0) warp_max[warp] = m;
        __syncthreads();
        if (threadIdx.x == 0) {
            int mm = warp_max[0];
#pragma unroll
            for (int j = 1; j < 8; ++j) mm = max(mm, warp_max[j]);
            const float s = compute_scale_dev(__int_as_float(mm), fmax, 0, exact, 1.0f);
            s_scale = s;
            const u64 at = (b / grid_c) * srs + (b % grid_c) * scs;
            if (scale != nullptr) scale[at] = s;
            scale_inv[at] = div_rn(1.0f, s);
        }
        __syncthreads();
        const float s = s_scale;
        for (int k = warp; k < h; k += 8) {
            const u64 row = (u64)(r0 + k) * cols + c0;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int cc = lane + 32 * q;
                if (cc < w) y[row + cc] = (u8)(fp8x2<FMT>(mul_rn(src(row + cc), s), 0.0f) & 0xFF);
            }
        }
        // warp_max and s_scale are rewritten by the next block.
        __syncthreads();
    }
}
