// Block-scaled FP8 casts (see src/block_quantize/mod.rs). Compiled after cuda/common.cuh, blocks128.cuh (the
// 128x128-block cast, BQ_TILE, warp_max_bits) and block_tiles.cuh (the 1x128 + 128x1 tile cast). Kernel names:
// bq_<layout>_<input type>_<fp8 format>, bq_both_<input type>_<fp8 format> (1x128 and 128x1 transposed from
// one read), bqp_1x128_<input type>_<fp8 format> (packed row records),
// bdq_<fp8 format>_<output type>, bdqs_<fp8 format>_<output type> (dequantize packed pieces and sum).
//
// Every block's scale is compute_scale_dev(amax, fmax, 0, exact, 1.0f) (fp8_core::block_scale: margin 0,
// scale 1 for a zero or non-finite amax), from the amax of the block's real elements (NaN ignored); the
// code of x is fp8(x * scale) with one f32 multiply, and scale_inv = 1 / scale (one f32 division), as
// on the CPU. Partial blocks at the edges read only their real elements. The scale of block (i, j) of the
// output grid is stored at i * srs + j * scs (ScaleOrder: row-major or the GEMM's order).

// ---- 1x128 tiles along the last dimension: x [rows, cols] -> y [rows, cols], scales [rows, ceil(cols/128)] ----
// One warp per tile, grid-stride over tiles; lane l holds elements l, l + 32, l + 64, l + 96 of its tile
// (coalesced loads and stores whatever the alignment). Block size: a multiple of 32. Where the codes and
// scales go is the sink's business: separate arrays (BqRowsSink) or packed row records (BqPackedSink).
// The separate scale arrays are strided: tile j of row r at r * srs + j * scs (the ScaleOrder).
struct BqRowsSink {
    u8* y;
    float* scale;
    float* scale_inv;
    int cols;
    u64 srs, scs;
    __device__ __forceinline__ u8* codes(u64 r, int c0) const { return y + r * (u64)cols + c0; }
    // Tile t (tile j of row r) has scale s.
    __device__ __forceinline__ void scales(u64, u64 r, int j, float s) const {
        const u64 at = r * srs + (u64)j * scs;
        scale[at] = s;
        scale_inv[at] = div_rn(1.0f, s);
    }
};
// Record r = [codes of row r | pad | scale_inv of its tiles] (PackedRows1x128 in src/block_quantize/mod.rs).
struct BqPackedSink {
    u8* p;
    u64 row_bytes;
    u64 scales_offset;
    __device__ __forceinline__ u8* codes(u64 r, int c0) const { return p + r * row_bytes + c0; }
    __device__ __forceinline__ void scales(u64, u64 r, int j, float s) const {
        reinterpret_cast<float*>(p + r * row_bytes + scales_offset)[j] = div_rn(1.0f, s);
    }
};
template <class In, int FMT, class Sink>
__device__ void bq_1x128_impl(const typename In::T* x, Sink out, float fmax, int exact, int rows, int cols) {
    const int lane = threadIdx.x & 31;
    const u64 warp = global_thread() >> 5, warps = grid_threads() >> 5;
    const u64 per_row = (u64)((cols + BQ_TILE - 1) / BQ_TILE);
    const u64 tiles = (u64)rows * per_row;
    for (u64 t = warp; t < tiles; t += warps) {
        const u64 r = t / per_row;
        const int j = (int)(t % per_row);
        const int c0 = j * BQ_TILE;
        const int len = min(BQ_TILE, cols - c0);
        const u64 base = r * (u64)cols + c0;
        u8* y = out.codes(r, c0);
        float v[4];
        int m = 0;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int k = lane + 32 * q;
            v[q] = k < len ? In::load(x, base + k) : 0.0f;
            m = max(m, abs_bits_no_nan(v[q]));
        }
        m = warp_max_bits(m);
        const float s = compute_scale_dev(__int_as_float(m), fmax, 0, exact, 1.0f);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int k = lane + 32 * q;
            if (k < len) y[k] = (u8)(fp8x2<FMT>(mul_rn(v[q], s), 0.0f) & 0xFF);
        }
        if (lane == 0) out.scales(t, r, j, s);
    }
}

// ---- 1x128 tiles and 128x1 tiles (written transposed) of one input, from one read: bq_tiles_impl in
// block_tiles.cuh ----

// ---- dequantize any block layout: y[i] = decode(q[i]) * scale_inv[block of i] ----
// q, y [rows, cols]; blocks of block_rows x block_cols, block (i, j)'s scale at i * srs + j * scs.
template <class Out, int FMT>
__device__ void bdq_impl(const u8* q, typename Out::T* y, const float* scale_inv, u64 srs, u64 scs, int rows,
                         int cols, int block_rows, int block_cols) {
    const u64 n = (u64)rows * cols;
    for (u64 i = global_thread(); i < n; i += grid_threads()) {
        const u64 r = i / cols, c = i % cols;
        const u64 b = (r / block_rows) * srs + (c / block_cols) * scs;
        float lo, hi;
        fp8x2_decode<FMT>((u16)q[i], lo, hi);
        Out::store(y, i, mul_rn(lo, scale_inv[b]));
    }
}

// ---- dequantize packed pieces and sum them in piece order ----
// out[i] = Out(f32(out[i]) + alpha * (((d_0 + d_1) + d_2) + ...)), d_r = decode(code_r[i]) * scale_inv_r[i / 128],
// from the `pieces` records of `p` (PackedRows1x128). Each thread takes 8 consecutive elements (of one tile,
// since 128 % 8 == 0): one 8-byte load of codes per record when the records allow it, 16-byte accesses to out
// when it is aligned; element accesses otherwise and for the tail.
template <class Out, int FMT>
__device__ void bdqs_impl(const u8* p, typename Out::T* out, float alpha, int pieces, int cols, u64 row_bytes,
                          u64 scales_offset) {
    const u64 groups = ((u64)cols + 7) / 8;
    const bool vec_codes = ((row_bytes & 7) == 0) && ((((u64)p) & 7) == 0);
    const bool vec_out = ((((u64)out) & 15) == 0);
    for (u64 g = global_thread(); g < groups; g += grid_threads()) {
        const u64 i0 = g * 8;
        const int n = (int)min((u64)8, (u64)cols - i0);
        const u64 tile = i0 / BQ_TILE;
        float acc[8];
        for (int r = 0; r < pieces; ++r) {
            const u8* rec = p + (u64)r * row_bytes;
            const float si = reinterpret_cast<const float*>(rec + scales_offset)[tile];
            u8 c[8];
            if (n == 8 && vec_codes) {
                const uint2 w = *reinterpret_cast<const uint2*>(rec + i0);
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    c[k] = (u8)((w.x >> (8 * k)) & 0xFFu);
                    c[k + 4] = (u8)((w.y >> (8 * k)) & 0xFFu);
                }
            } else {
#pragma unroll
                for (int k = 0; k < 8; ++k) c[k] = k < n ? rec[i0 + k] : (u8)0;
            }
#pragma unroll
            for (int k = 0; k < 8; k += 2) {
                float lo, hi;
                fp8x2_decode<FMT>((u16)(c[k] | ((u16)c[k + 1] << 8)), lo, hi);
                const float dlo = mul_rn(lo, si), dhi = mul_rn(hi, si);
                // Piece 0 starts the sum (0 + d would turn -0 into +0).
                acc[k] = r == 0 ? dlo : add_rn(acc[k], dlo);
                acc[k + 1] = r == 0 ? dhi : add_rn(acc[k + 1], dhi);
            }
        }
        if (n == 8 && vec_out) {
            float v[8];
            Out::load8(out, i0, v);
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = add_rn(v[k], mul_rn(alpha, acc[k]));
            Out::store8(out, i0, v);
        } else {
            for (int k = 0; k < n; ++k) Out::store(out, i0 + k, add_rn(Out::load(out, i0 + k), mul_rn(alpha, acc[k])));
        }
    }
}

// ---- extern "C" entry points ----
#define BQ_ENTRY(NAME, IN, FNAME, FMT)                                                                          \
    extern "C" __global__ void bq_1x128_##NAME##_##FNAME(const IN::T* x, u8* y, float* scale, float* scale_inv,   \
                                                         u64 srs, u64 scs, float fmax, int exact, int rows,     \
                                                         int cols) {                                            \
        bq_1x128_impl<IN, FMT>(x, BqRowsSink{y, scale, scale_inv, cols, srs, scs}, fmax, exact, rows, cols);    \
    }                                                                                                           \
    extern "C" __global__ void bqp_1x128_##NAME##_##FNAME(const IN::T* x, u8* p, u64 row_bytes,                  \
                                                          u64 scales_offset, float fmax, int exact, int rows,    \
                                                          int cols) {                                           \
        bq_1x128_impl<IN, FMT>(x, BqPackedSink{p, row_bytes, scales_offset}, fmax, exact, rows, cols);           \
    }                                                                                                           \
    extern "C" __global__ void BQ_TILES_CAST_BOUNDS(IN) bq_128x1t_##NAME##_##FNAME(const IN::T* x, u8* yt, float* scale, float* scale_inv, \
                                                          u64 srs, u64 scs, float fmax, int exact, int rows,    \
                                                          int cols) {                                           \
        bq_tiles_impl<IN, FMT>(x, x, CastValue<IN>{}, nullptr, nullptr, nullptr, 0, 0, yt, scale, scale_inv, srs,  \
                               scs, fmax, exact, rows, cols);                                                   \
    }                                                                                                           \
    extern "C" __global__ void BQ_TILES_CAST_BOUNDS(IN) bq_both_##NAME##_##FNAME(const IN::T* x, u8* y, float* scale, float* scale_inv,    \
                                                        u64 srs, u64 scs, u8* yt, float* tscale,                 \
                                                        float* tscale_inv, u64 trs, u64 tcs, float fmax,         \
                                                        int exact, int rows, int cols) {                         \
        bq_tiles_impl<IN, FMT>(x, x, CastValue<IN>{}, y, scale, scale_inv, srs, scs, yt, tscale, tscale_inv, trs, \
                               tcs, fmax, exact, rows, cols);                                                   \
    }                                                                                                           \
    extern "C" __global__ void bq_128x128_##NAME##_##FNAME(const IN::T* x, u8* y, float* scale, float* scale_inv, \
                                                           u64 srs, u64 scs, float fmax, int exact, int rows,   \
                                                           int cols) {                                          \
        bq_128x128_impl<FMT>(BqArray<IN>{x}, y, scale, scale_inv, srs, scs, fmax, exact, rows, cols);             \
    }
BQ_ENTRY(f32, TF32, e4m3, FP8_E4M3)
BQ_ENTRY(f32, TF32, e5m2, FP8_E5M2)
BQ_ENTRY(bf16, TBF16, e4m3, FP8_E4M3)
BQ_ENTRY(bf16, TBF16, e5m2, FP8_E5M2)
BQ_ENTRY(f16, TF16, e4m3, FP8_E4M3)
BQ_ENTRY(f16, TF16, e5m2, FP8_E5M2)

#define BDQ_ENTRY(FNAME, FMT, NAME, OUT)                                                                         \
    extern "C" __global__ void bdq_##FNAME##_##NAME(const u8* q, OUT::T* y, const float* scale_inv, u64 srs,     \
                                                    u64 scs, int rows, int cols, int block_rows,                 \
                                                    int block_cols) {                                            \
        bdq_impl<OUT, FMT>(q, y, scale_inv, srs, scs, rows, cols, block_rows, block_cols);                       \
    }
BDQ_ENTRY(e4m3, FP8_E4M3, f32, TF32)
BDQ_ENTRY(e4m3, FP8_E4M3, bf16, TBF16)
BDQ_ENTRY(e4m3, FP8_E4M3, f16, TF16)
BDQ_ENTRY(e5m2, FP8_E5M2, f32, TF32)
BDQ_ENTRY(e5m2, FP8_E5M2, bf16, TBF16)
BDQ_ENTRY(e5m2, FP8_E5M2, f16, TF16)

#define BDQS_ENTRY(FNAME, FMT, NAME, OUT)                                                                        \
    extern "C" __global__ void bdqs_##FNAME##_##NAME(const u8* p, OUT::T* out, float alpha, int pieces,          \
                                                     int cols, u64 row_bytes, u64 scales_offset) {               \
        bdqs_impl<OUT, FMT>(p, out, alpha, pieces, cols, row_bytes, scales_offset);                              \
    }
BDQS_ENTRY(e4m3, FP8_E4M3, f32, TF32)
BDQS_ENTRY(e4m3, FP8_E4M3, bf16, TBF16)
BDQS_ENTRY(e4m3, FP8_E4M3, f16, TF16)
BDQS_ENTRY(e5m2, FP8_E5M2, f32, TF32)
BDQS_ENTRY(e5m2, FP8_E5M2, bf16, TBF16)
BDQS_ENTRY(e5m2, FP8_E5M2, f16, TF16)
