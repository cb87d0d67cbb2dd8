// The previous LayerNorm / RMSNorm forward kernels (one warp per row and one row at a time, the FP8 codes
// of a tile of rows transposed through shared memory), kept as a launch choice to compare with layer_norm.cu
// (NormLaunch::legacy_forward). Same definitions, so the same results bit for bit. Prepended with
// common.cuh.
//
// Row layout: one warp per row. Element e belongs to vector e / 8; vector j is
// handled by lane j % 32, which walks its vectors in increasing order and the elements of each vector in
// increasing order. A row sum is the 32 lane sums combined by a butterfly (xor 16, 8, 4, 2, 1).
// A lane keeps its vectors in registers (NV = vectors per lane, a template bound chosen from d by the
// host), or re-reads them from memory when NV == 0 (very wide rows, or d not a multiple of 8). The host
// launches NV > 0 only when d is a multiple of 8 (buffers are 256-byte aligned), so those kernels take the
// 16-byte path unconditionally; NV == 0 checks at run time. NV changes speed, never results.

#define LN_THREADS 256
#define LN_WARPS (LN_THREADS / 32)
// Bytes of padding per row of the shared FP8 code tile (keeps 16-byte alignment, spreads banks).
#define LN_TILE_PAD 16

// Eight consecutive elements in their storage type: bf16 as one uint4, f32 as two float4.
template <class E>
struct Raw8;
template <>
struct Raw8<TF32> {
    float4 a, b;
    __device__ __forceinline__ void load(const float* p, u64 i) {
        a = *reinterpret_cast<const float4*>(p + i);
        b = *reinterpret_cast<const float4*>(p + i + 4);
    }
    __device__ __forceinline__ void load_n(const float* p, u64 i, int n) {
        float v[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) v[q] = q < n ? p[i + q] : 0.0f;
        a = make_float4(v[0], v[1], v[2], v[3]);
        b = make_float4(v[4], v[5], v[6], v[7]);
    }
    __device__ __forceinline__ void get(float (&v)[8]) const {
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    }
};
template <>
struct Raw8<TBF16> {
    uint4 w;
    __device__ __forceinline__ void load(const u16* p, u64 i) { w = *reinterpret_cast<const uint4*>(p + i); }
    __device__ __forceinline__ void load_n(const u16* p, u64 i, int n) {
        u16 h[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) h[q] = q < n ? p[i + q] : (u16)0;
        w = pack_u16x8(h);
    }
    __device__ __forceinline__ void get(float (&v)[8]) const {
        u16 h[8];
        unpack_u16x8(w, h);
#pragma unroll
        for (int q = 0; q < 8; ++q) v[q] = bf16_to_f32(h[q]);
    }
};

// Vector j of the row starting at `row` (16-byte loads when `vec`, else element loads).
template <class E>
__device__ __forceinline__ void ln_load(Raw8<E>& r, const typename E::T* row, int j, int d, bool vec) {
    if (vec) r.load(row, (u64)8 * j);
    else r.load_n(row, (u64)8 * j, min(8, d - 8 * j));
}

// Calls f(k, j) for this lane's vectors j = lane + 32 k (j < nvec), in increasing order.
template <int NV, class F>
__device__ __forceinline__ void lane_vectors(int lane, int nvec, F f) {
    if constexpr (NV > 0) {
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const int j = lane + 32 * k;
            if (j < nvec) f(k, j);
        }
    } else {
        for (int j = lane, k = 0; j < nvec; j += 32, ++k) f(k, j);
    }
}

// A lane's vectors of one row: held in registers (NV > 0) or re-read on every use (NV == 0).
template <class E, int NV>
struct RowCache {
    Raw8<E> v[NV > 0 ? NV : 1];
    __device__ __forceinline__ void fill(const typename E::T* row, int lane, int d, bool vec) {
        if constexpr (NV > 0) {
            lane_vectors<NV>(lane, (d + 7) >> 3, [&](int k, int j) { ln_load<E>(v[k], row, j, d, vec); });
        }
    }
    __device__ __forceinline__ void get(int k, const typename E::T* row, int j, int d, bool vec,
                                        float (&t)[8]) const {
        if constexpr (NV > 0) {
            v[k].get(t);
        } else {
            Raw8<E> r;
            ln_load<E>(r, row, j, d, vec);
            r.get(t);
        }
    }
};

__device__ __forceinline__ float ln_warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = add_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
    return v;
}

// What storing v in the element type and reading it back gives.
template <class E>
__device__ __forceinline__ float ln_round(float v) {
    typename E::T tmp[1];
    E::store(tmp, 0, v);
    return E::load(tmp, 0);
}

__device__ __forceinline__ bool ln_aligned16(const void* p) { return ((unsigned long long)p & 15) == 0; }

// mean (0 for RMSNorm) and rstd = 1 / sqrt(var + eps) of one row, every lane getting the same values.
template <class E, int NV>
__device__ __forceinline__ void ln_row_stats(const RowCache<E, NV>& c, const typename E::T* row, int lane, int d,
                                             bool vec, int rms, float eps, float& mean, float& rstd) {
    const int nvec = (d + 7) >> 3;
    float m = 0.0f;
    if (!rms) {
        float s = 0.0f;
        lane_vectors<NV>(lane, nvec, [&](int k, int j) {
            float t[8];
            c.get(k, row, j, d, vec, t);
            const int n = min(8, d - 8 * j);
#pragma unroll
            for (int q = 0; q < 8; ++q)
                if (q < n) s = add_rn(s, t[q]);
        });
        m = div_rn(ln_warp_sum(s), (float)d);
    }
    float v = 0.0f;
    lane_vectors<NV>(lane, nvec, [&](int k, int j) {
        float t[8];
        c.get(k, row, j, d, vec, t);
        const int n = min(8, d - 8 * j);
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            if (q < n) {
                const float u = add_rn(t[q], -m);
                v = add_rn(v, mul_rn(u, u));
            }
        }
    });
    const float var = div_rn(ln_warp_sum(v), (float)d);
    mean = m;
    rstd = div_rn(1.0f, __fsqrt_rn(add_rn(var, eps)));
}

// y = (x - mean) * rstd * w (+ b) for the vector j of a row, in f32 (not yet rounded to the element type).
template <class E>
__device__ __forceinline__ void ln_affine(const float (&t)[8], const typename E::T* w, const typename E::T* b, int j,
                                          int d, bool vec, float mean, float rstd, float (&y)[8]) {
    Raw8<E> rw;
    ln_load<E>(rw, w, j, d, vec);
    float wv[8];
    rw.get(wv);
    float bv[8];
    if (b != nullptr) {
        Raw8<E> rb;
        ln_load<E>(rb, b, j, d, vec);
        rb.get(bv);
    }
#pragma unroll
    for (int q = 0; q < 8; ++q) {
        float v = mul_rn(mul_rn(add_rn(t[q], -mean), rstd), wv[q]);
        if (b != nullptr) v = add_rn(v, bv[q]);
        y[q] = v;
    }
}

// ---- forward, output in the element type: one warp per row, grid-stride over rows ----
template <class E, int NV>
__device__ void ln_fwd_impl(const typename E::T* x, const typename E::T* w, const typename E::T* b, float* mean_out,
                            float* rstd_out, typename E::T* y, int rows, int d, float eps, int rms) {
    const int lane = threadIdx.x & 31;
    const u64 warp = global_thread() >> 5, nwarps = grid_threads() >> 5;
    const bool vec = NV > 0 || ((d & 7) == 0 && ln_aligned16(x) && ln_aligned16(w) && ln_aligned16(y) &&
                                (b == nullptr || ln_aligned16(b)));
    const int nvec = (d + 7) >> 3;
    for (u64 r = warp; r < (u64)rows; r += nwarps) {
        const typename E::T* row = x + r * d;
        RowCache<E, NV> c;
        c.fill(row, lane, d, vec);
        float mean, rstd;
        ln_row_stats<E, NV>(c, row, lane, d, vec, rms, eps, mean, rstd);
        if (lane == 0) {
            mean_out[r] = mean;
            rstd_out[r] = rstd;
        }
        lane_vectors<NV>(lane, nvec, [&](int k, int j) {
            float t[8], o[8];
            c.get(k, row, j, d, vec, t);
            ln_affine<E>(t, w, b, j, d, vec, mean, rstd, o);
            store_vec8<E>(y + r * d, j, d, vec, o);
        });
    }
}

// ---- forward fused with the FP8 cast: codes [rows, d], transposed codes [d, rows], amax ----
// A block owns tiles of `tile_rows` rows (all d columns); its warps normalise the tile's rows (one warp per
// row), cast each value h = (y rounded to the element type) as encode(h * scale), store the row's codes and
// keep them in a shared tile, then the block writes the tile's columns into the transposed codes: 16-byte
// stores of 16 rows when rows and tile_rows are multiples of 16 and d of 8, else byte stores.
template <class E, int FMT, int NV>
__device__ void ln_fwd_fp8_impl(const typename E::T* x, const typename E::T* w, const typename E::T* b, float* mean_out,
                                float* rstd_out, u8* q, u8* qt, const float* scale, float* amax, int slot, int rows,
                                int d, float eps, int rms, int tile_rows) {
    extern __shared__ __align__(16) u8 ln_tile[];
    const int ts = d + LN_TILE_PAD;
    const float s = *scale;
    int mbits = 0;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool vec = NV > 0 || ((d & 7) == 0 && ln_aligned16(x) && ln_aligned16(w) &&
                                (b == nullptr || ln_aligned16(b)) && (((unsigned long long)q & 7) == 0));
    const bool tvec = vec && (rows & 15) == 0 && (tile_rows & 15) == 0 && ln_aligned16(qt);
    const int nvec = (d + 7) >> 3;
    const int tiles = (rows + tile_rows - 1) / tile_rows;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        const int r0 = t * tile_rows;
        const int tr = min(tile_rows, rows - r0);
        for (int i = warp; i < tr; i += LN_WARPS) {
            const u64 r = (u64)(r0 + i);
            const typename E::T* row = x + r * d;
            RowCache<E, NV> c;
            c.fill(row, lane, d, vec);
            float mean, rstd;
            ln_row_stats<E, NV>(c, row, lane, d, vec, rms, eps, mean, rstd);
            if (lane == 0) {
                mean_out[r] = mean;
                rstd_out[r] = rstd;
            }
            u8* trow = ln_tile + (u64)i * ts;
            lane_vectors<NV>(lane, nvec, [&](int k, int j) {
                float v[8], h[8];
                c.get(k, row, j, d, vec, v);
                ln_affine<E>(v, w, b, j, d, vec, mean, rstd, h);
                const int n = min(8, d - 8 * j);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    h[e] = ln_round<E>(h[e]);
                    if (e < n) mbits = max(mbits, abs_bits_no_nan(h[e]));
                }
                u32 wd[2];
#pragma unroll
                for (int p = 0; p < 2; ++p) {
                    const u32 lo = fp8x2<FMT>(mul_rn(h[4 * p], s), mul_rn(h[4 * p + 1], s));
                    const u32 hi = fp8x2<FMT>(mul_rn(h[4 * p + 2], s), mul_rn(h[4 * p + 3], s));
                    wd[p] = lo | (hi << 16);
                }
                if (vec) {
                    const uint2 pair = make_uint2(wd[0], wd[1]);
                    *reinterpret_cast<uint2*>(q + r * d + 8 * j) = pair;
                    *reinterpret_cast<uint2*>(trow + 8 * j) = pair;
                } else {
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        if (e < n) {
                            const u8 code = (u8)((wd[e >> 2] >> (8 * (e & 3))) & 0xFFu);
                            q[r * d + 8 * j + e] = code;
                            trow[8 * j + e] = code;
                        }
                    }
                }
            });
        }
        __syncthreads();
        if (tvec) {
            // Item = (word column cw, 16-row half h): read 16 words (4 columns x 16 rows), write 4 x 16 bytes.
            const int words = d >> 2, halves = tr >> 4;
            for (int it = threadIdx.x; it < words * halves; it += blockDim.x) {
                const int cw = it % words, h = it / words;
                u32 in[16];
#pragma unroll
                for (int rr = 0; rr < 16; ++rr)
                    in[rr] = *reinterpret_cast<const u32*>(ln_tile + (u64)(16 * h + rr) * ts + 4 * cw);
#pragma unroll
                for (int bcol = 0; bcol < 4; ++bcol) {
                    u32 o[4];
#pragma unroll
                    for (int p = 0; p < 4; ++p) {
                        u32 v = 0;
#pragma unroll
                        for (int bb = 0; bb < 4; ++bb) v |= ((in[4 * p + bb] >> (8 * bcol)) & 0xFFu) << (8 * bb);
                        o[p] = v;
                    }
                    *reinterpret_cast<uint4*>(qt + (u64)(4 * cw + bcol) * rows + r0 + 16 * h) =
                        make_uint4(o[0], o[1], o[2], o[3]);
                }
            }
        } else {
            for (int it = threadIdx.x; it < d * tr; it += blockDim.x) {
                const int c = it / tr, i = it - c * tr;
                qt[(u64)c * rows + r0 + i] = ln_tile[(u64)i * ts + c];
            }
        }
        __syncthreads();
    }
    block_amax_commit(mbits, amax == nullptr ? nullptr : amax + slot);
}

#define LN_FWD_ENTRIES(NAME, E, NV)                                                                                  \
    extern "C" __global__ void __launch_bounds__(LN_THREADS) ln_legacy_fwd_##NAME##_nv##NV(                               \
        const E::T* x, const E::T* w, const E::T* b, float* mean, float* rstd, E::T* y, int rows, int d, float eps, \
        int rms) {                                                                                                  \
        ln_fwd_impl<E, NV>(x, w, b, mean, rstd, y, rows, d, eps, rms);                                              \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(LN_THREADS) ln_legacy_fwd_fp8_##NAME##_e4m3_nv##NV(                      \
        const E::T* x, const E::T* w, const E::T* b, float* mean, float* rstd, u8* q, u8* qt, const float* scale,   \
        float* amax, int slot, int rows, int d, float eps, int rms, int tile_rows) {                                \
        ln_fwd_fp8_impl<E, FP8_E4M3, NV>(x, w, b, mean, rstd, q, qt, scale, amax, slot, rows, d, eps, rms,          \
                                         tile_rows);                                                                \
    }
LN_FWD_ENTRIES(f32, TF32, 0)
LN_FWD_ENTRIES(bf16, TBF16, 0)
LN_FWD_ENTRIES(bf16, TBF16, 4)
LN_FWD_ENTRIES(bf16, TBF16, 8)
LN_FWD_ENTRIES(bf16, TBF16, 12)
LN_FWD_ENTRIES(bf16, TBF16, 16)
