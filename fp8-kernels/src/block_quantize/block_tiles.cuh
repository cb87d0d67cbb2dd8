// The 1x128 + 128x1 (transposed) tile cast of one input, shared by block_quantize.cu (the input's own values)
// and block_activation.cu (activations computed inside the cast). Compiled after cuda/common.cuh and
// blocks128.cuh (BQ_TILE).

// ---- 1x128 tiles and 128x1 tiles (written transposed) of one input, from one read ----
// The values are those of a [rows, cols] matrix given by a value functor (common.cuh's protocol: VAL::value
// and VAL::value8 at flat index r * cols + c of the pointers x and x2): the input itself (CastValue), or
// an activation rounded to the element type (GeluValue, GeluGradValue, SwigluValue, SwigluGradValue), so
// that a fused activation + cast equals the activation kernel into a buffer followed by the cast, bit for
// bit. Outputs: when y is not null, y [rows, cols] with scales [rows, ceil(cols/128)] (the 1x128 cast);
// when yt is not null, yt [cols, rows] with scales [cols, ceil(rows/128)] (the 128x1 cast, transposed: the
// 1x128 cast of the transpose).
// One block of 256 threads per 128 x 128 region, grid-stride: thread t covers columns 8 (t % 16) .. +7 and
// rows 8 (t / 16) .. +7 of the region, its 64 values held in the element type (16-bit types packed two to
// a register, so a block needs few enough registers for several per SM). A row tile's amax is a max over
// the 16 threads of a half-warp (shuffles), a column tile's over the 16 threads of a column group (one
// shuffle, then shared memory across the warps). Codes go out 8 bytes per store: 8 consecutive columns of
// a row (y) and 8 consecutive rows of a column (yt), byte by byte where the shape or the alignment does not
// allow that. The amaxes are order-free maxima, so the codes and scales equal the one-layout casts'.

// The kernels around bq_tiles_impl run 256 threads a block; the register cap lets several blocks share an
// SM (a memory-bound pass needs the loads of several regions in flight): for 16-bit inputs 4 blocks (64
// registers, no spills with NVRTC 13.0); for f32 inputs, whose 64 values alone take 64 registers, 2.
template <class E>
struct BqCastBlocks {
    static constexpr int value = sizeof(typename E::T) == 2 ? 4 : 2;
};
#define BQ_TILES_CAST_BOUNDS(E) __launch_bounds__(256, BqCastBlocks<E>::value)
// The activation casts (BF16) want about 120 registers; capped at 80 (3 blocks per SM) a few bytes spill
// into L1, and still they ran faster on an H100 (block_cast_bench, 2026-12-07; uncapped against capped
// builds in one call): GELU's forward 5-8 %, SwiGLU's forward 4-26 %, the norm output 1-5 %, GELU's
// gradient up to 7 % at the wide shapes (6 % slower at 8192 x 2560). The SwiGLU gradient, which computes
// one half of its output per element, has no cap (its earlier two-half form was 8-29 % slower with one).
#define BQ_TILES_ACT_BOUNDS __launch_bounds__(256, 3)

// Eight values of one row as the element type holds them (exact: every value is already rounded to it).
template <class E, int BYTES = sizeof(typename E::T)>
struct BqEight;
template <class E>
struct BqEight<E, 2> {
    u32 w[4];
    __device__ __forceinline__ void set(const float (&v)[8]) {
        typename E::T h[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) E::store(h, k, v[k]);
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = (u32)h[2 * k] | ((u32)h[2 * k + 1] << 16);
    }
    __device__ __forceinline__ float get(int k) const {
        typename E::T h[1];
        h[0] = (typename E::T)((w[k / 2] >> (16 * (k % 2))) & 0xFFFFu);
        return E::load(h, 0);
    }
};
template <class E>
struct BqEight<E, 4> {
    float v[8];
    __device__ __forceinline__ void set(const float (&x)[8]) {
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = x[k];
    }
    __device__ __forceinline__ float get(int k) const { return v[k]; }
};

template <class E, int FMT, class VAL>
__device__ void bq_tiles_impl(const typename E::T* x, const typename E::T* x2, VAL val, u8* y, float* scale,
                              float* scale_inv, u64 srs, u64 scs, u8* yt, float* tscale, float* tscale_inv, u64 trs,
                              u64 tcs, float fmax, int exact, int rows, int cols) {
    __shared__ int col_part[8][BQ_TILE];
    __shared__ float col_scale[BQ_TILE];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int g = t & 15, rl = t >> 4;  // column group, row group
    const int tiles_r = (rows + BQ_TILE - 1) / BQ_TILE, tiles_c = (cols + BQ_TILE - 1) / BQ_TILE;
    // value8 reads 8 values of one row at a multiple of 8 with 16-byte accesses (the functors' rule: a
    // width that is a multiple of 16 keeps every such access aligned and inside one half of a gate/up row).
    const bool vec_in = (cols % 16 == 0) && ((((u64)x) & 15) == 0) && ((((u64)x2) & 15) == 0);
    const bool vec_y = y != nullptr && (cols % 8 == 0) && ((((u64)y) & 7) == 0);
    const bool vec_yt = yt != nullptr && (rows % 8 == 0) && ((((u64)yt) & 7) == 0);
    for (u64 b = blockIdx.x; b < (u64)tiles_r * tiles_c; b += gridDim.x) {
        const int tr = (int)(b / tiles_c), tc = (int)(b % tiles_c);
        const int r0 = tr * BQ_TILE + 8 * rl, c0 = tc * BQ_TILE + 8 * g;
        BqEight<E> v[8];  // [row]
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int r = r0 + i;
            float f[8];
            if (r < rows && c0 < cols) {
                const u64 at = (u64)r * cols + c0;
                if (vec_in) {
                    val.value8(x, x2, at, f);
                } else {
                    const int n = min(8, cols - c0);
#pragma unroll
                    for (int q = 0; q < 8; ++q) f[q] = q < n ? val.value(x, x2, at + q) : 0.0f;
                }
            } else {
#pragma unroll
                for (int q = 0; q < 8; ++q) f[q] = 0.0f;
            }
            v[i].set(f);
        }
        if (yt != nullptr) {
            // Column tiles: this thread's 8 rows, the other half-warp's 8, then the 8 warps.
            int cm[8];
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                int m = 0;
#pragma unroll
                for (int i = 0; i < 8; ++i) m = max(m, abs_bits_no_nan(v[i].get(q)));
                cm[q] = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 16));
            }
            if (lane < 16) {
#pragma unroll
                for (int q = 0; q < 8; ++q) col_part[warp][8 * g + q] = cm[q];
            }
            __syncthreads();
            if (t < BQ_TILE) {
                int m = col_part[0][t];
#pragma unroll
                for (int w = 1; w < 8; ++w) m = max(m, col_part[w][t]);
                const float s = compute_scale_dev(__int_as_float(m), fmax, 0, exact, 1.0f);
                col_scale[t] = s;
                const int c = tc * BQ_TILE + t;
                if (c < cols) {
                    const u64 at = (u64)c * trs + (u64)tr * tcs;
                    tscale[at] = s;
                    tscale_inv[at] = div_rn(1.0f, s);
                }
            }
            __syncthreads();
            // Transposed codes: column c0 + q, rows r0 .. r0 + 7.
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                const int c = c0 + q;
                if (c >= cols || r0 >= rows) continue;
                const float s = col_scale[8 * g + q];
                u32 w[4];
#pragma unroll
                for (int i = 0; i < 8; i += 2)
                    w[i / 2] = fp8x2<FMT>(mul_rn(v[i].get(q), s), mul_rn(v[i + 1].get(q), s));
                u8* dst = yt + (u64)c * rows + r0;
                if (vec_yt) {
                    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
                } else {
                    const int n = min(8, rows - r0);
                    for (int i = 0; i < n; ++i) dst[i] = (u8)((w[i / 2] >> (8 * (i % 2))) & 0xFFu);
                }
            }
        }
        if (y != nullptr) {
            // Row tiles: row r0 + i over the 16 threads of this half-warp.
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                int m = 0;
#pragma unroll
                for (int q = 0; q < 8; ++q) m = max(m, abs_bits_no_nan(v[i].get(q)));
#pragma unroll
                for (int o = 8; o >= 1; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
                const int r = r0 + i;
                const float s = compute_scale_dev(__int_as_float(m), fmax, 0, exact, 1.0f);
                if (r >= rows) continue;
                if (g == 0) {
                    const u64 at = (u64)r * srs + (u64)tc * scs;
                    scale[at] = s;
                    scale_inv[at] = div_rn(1.0f, s);
                }
                if (c0 >= cols) continue;
                u32 w[4];
#pragma unroll
                for (int q = 0; q < 8; q += 2) w[q / 2] = fp8x2<FMT>(mul_rn(v[i].get(q), s), mul_rn(v[i].get(q + 1), s));
                u8* dst = y + (u64)r * cols + c0;
                if (vec_y) {
                    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
                } else {
                    const int n = min(8, cols - c0);
                    for (int q = 0; q < n; ++q) dst[q] = (u8)((w[q / 2] >> (8 * (q % 2))) & 0xFFu);
                }
            }
        }
        // col_part and col_scale are rewritten by the next region.
        __syncthreads();
    }
}

