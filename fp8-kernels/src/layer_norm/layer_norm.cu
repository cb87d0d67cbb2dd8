// Layer normalisation and RMS normalisation over the rows of a [rows, d] tensor. Prepended with
// common.cuh. src/layer_norm/mod.rs states the definitions; src/layer_norm/cpu.rs performs the same
// operations in the same order, so results agree bit for bit.
//
// Row layout (forward and dx kernels): one warp per row. Element e belongs to vector e / 8; vector j is
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

// ---- backward, fused: dx and the chunk sums of dweight / dbias ----
// g = dy * w, xhat = (x - mean) * rstd, c1 = sum(g * xhat) / d, c2 = sum(g) / d (0 for RMSNorm),
// dx = (g - c2 - xhat * c1) * rstd, optionally added to the dx already stored.
// Parameter sums (mod.rs: ParamOrder): block-stride over chunks of LN_PARAM_CHUNK rows. The block's W warps
// take the chunk's rows in groups of W consecutive rows (warp i row g0 + i), each computing its row's dx as
// one warp per row and staging dy * xhat (and dy when there is a bias) in f32; after a barrier, thread t adds
// the group's staged rows in row order into the running sums of its columns c = t, t + blockDim, ...
// (started from zero per chunk). So each column's chunk sum runs over the chunk's rows in row order, and
// x and dy are read once. With one chunk the sums are the result (overwriting or added); otherwise they are
// the chunk's partial sums, which ln_param_reduce combines. The staging and the running sums live in
// dynamic shared memory, or in `gstage` (a per-block slice of global memory) when the row is too wide.
#define LN_PARAM_CHUNK 16

template <class E, class G, int NV>
__device__ void ln_bwd_impl(const typename E::T* x, const typename E::T* w, const typename G::T* dy,
                            const float* mean_in, const float* rstd_in, typename G::T* dx, float* dw, float* db,
                            float* gstage, int rows, int d, int rms, int acc_dx, int acc_param) {
    extern __shared__ __align__(16) float ln_stage_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const bool bias = db != nullptr;
    const int nb = bias ? 2 : 1;
    float* base = gstage != nullptr ? gstage + (u64)blockIdx.x * (u64)(nw + 1) * nb * d : ln_stage_smem;
    float* stw = base;                        // [nw][d]: dy * xhat of the group's rows
    float* stb = base + (u64)nw * d;          // [nw][d]: dy (bias only)
    float* accw = base + (u64)nb * nw * d;    // [d]: running chunk sums of dweight
    float* accb = accw + d;                   // [d]: of dbias (bias only)
    const bool vec =
        NV > 0 || ((d & 7) == 0 && ln_aligned16(x) && ln_aligned16(w) && ln_aligned16(dy) && ln_aligned16(dx));
    const int nvec = (d + 7) >> 3;
    const int chunks = rows == 0 ? 1 : (rows + LN_PARAM_CHUNK - 1) / LN_PARAM_CHUNK;
    for (int k = blockIdx.x; k < chunks; k += gridDim.x) {
        const int r0 = k * LN_PARAM_CHUNK, r1 = min(rows, r0 + LN_PARAM_CHUNK);
        for (int c = threadIdx.x; c < d; c += blockDim.x) {
            accw[c] = 0.0f;
            if (bias) accb[c] = 0.0f;
        }
        for (int g0 = r0; g0 < r1; g0 += nw) {
            const int gn = min(nw, r1 - g0);
            if (warp < gn) {
                const u64 r = (u64)(g0 + warp);
                const typename E::T* xrow = x + r * d;
                const typename G::T* grow = dy + r * d;
                RowCache<E, NV> cx;
                RowCache<G, NV> cg;
                cx.fill(xrow, lane, d, vec);
                cg.fill(grow, lane, d, vec);
                const float mean = mean_in[r], rstd = rstd_in[r];
                float sa = 0.0f, sb = 0.0f;
                lane_vectors<NV>(lane, nvec, [&](int kk, int j) {
                    float xv[8], gv[8], wv[8];
                    cx.get(kk, xrow, j, d, vec, xv);
                    cg.get(kk, grow, j, d, vec, gv);
                    Raw8<E> rw;
                    ln_load<E>(rw, w, j, d, vec);
                    rw.get(wv);
                    const int n = min(8, d - 8 * j);
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        if (e < n) {
                            const float g = mul_rn(gv[e], wv[e]);
                            const float xh = mul_rn(add_rn(xv[e], -mean), rstd);
                            sa = add_rn(sa, g);
                            sb = add_rn(sb, mul_rn(g, xh));
                        }
                    }
                });
                const float c1 = div_rn(ln_warp_sum(sb), (float)d);
                const float suma = ln_warp_sum(sa);
                const float c2 = rms ? 0.0f : div_rn(suma, (float)d);
                typename G::T* drow = dx + r * d;
                float* sw = stw + (u64)warp * d;
                float* sbias = stb + (u64)warp * d;
                lane_vectors<NV>(lane, nvec, [&](int kk, int j) {
                    float xv[8], gv[8], wv[8], o[8], p[8];
                    cx.get(kk, xrow, j, d, vec, xv);
                    cg.get(kk, grow, j, d, vec, gv);
                    Raw8<E> rw;
                    ln_load<E>(rw, w, j, d, vec);
                    rw.get(wv);
                    float old[8];
                    if (acc_dx) {
                        Raw8<G> ro;
                        ln_load<G>(ro, drow, j, d, vec);
                        ro.get(old);
                    }
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        const float g = mul_rn(gv[e], wv[e]);
                        const float xh = mul_rn(add_rn(xv[e], -mean), rstd);
                        float v = mul_rn(add_rn(add_rn(g, -c2), -mul_rn(xh, c1)), rstd);
                        if (acc_dx) v = add_rn(old[e], v);
                        o[e] = v;
                        p[e] = mul_rn(gv[e], xh);
                    }
                    store_vec8<G>(drow, j, d, vec, o);
                    if (vec) {
                        *reinterpret_cast<float4*>(sw + 8 * j) = make_float4(p[0], p[1], p[2], p[3]);
                        *reinterpret_cast<float4*>(sw + 8 * j + 4) = make_float4(p[4], p[5], p[6], p[7]);
                        if (bias) {
                            *reinterpret_cast<float4*>(sbias + 8 * j) = make_float4(gv[0], gv[1], gv[2], gv[3]);
                            *reinterpret_cast<float4*>(sbias + 8 * j + 4) = make_float4(gv[4], gv[5], gv[6], gv[7]);
                        }
                    } else {
                        const int n = min(8, d - 8 * j);
#pragma unroll
                        for (int e = 0; e < 8; ++e) {
                            if (e < n) {
                                sw[8 * j + e] = p[e];
                                if (bias) sbias[8 * j + e] = gv[e];
                            }
                        }
                    }
                });
            }
            __syncthreads();
            for (int c = threadIdx.x; c < d; c += blockDim.x) {
                float a = accw[c];
                for (int i = 0; i < gn; ++i) a = add_rn(a, stw[(u64)i * d + c]);
                accw[c] = a;
                if (bias) {
                    float b = accb[c];
                    for (int i = 0; i < gn; ++i) b = add_rn(b, stb[(u64)i * d + c]);
                    accb[c] = b;
                }
            }
            __syncthreads();
        }
        // Each thread writes the columns it summed (no barrier needed before the next chunk's reset).
        for (int c = threadIdx.x; c < d; c += blockDim.x) {
            if (chunks == 1) {
                dw[c] = acc_param ? add_rn(dw[c], accw[c]) : accw[c];
                if (bias) db[c] = acc_param ? add_rn(db[c], accb[c]) : accb[c];
            } else {
                dw[(u64)k * d + c] = accw[c];
                if (bias) db[(u64)k * d + c] = accb[c];
            }
        }
    }
}

#ifndef LN_BUILD_FORWARD
// Combines the chunk partials [chunks][d] (mod.rs: ParamOrder): block x covers 32 columns (lane = column),
// warp i the group i: the sum of chunks [i group, (i + 1) group) in chunk order from the group's first; then
// lane c of warp 0 adds the group sums in group order from the first and writes (or adds to) the result.
// 1024 threads (32 groups at most).
extern "C" __global__ void __launch_bounds__(1024)
    ln_param_reduce(const float* pw, const float* pb, float* dw, float* db, int chunks, int d, int group,
                    int accumulate) {
    __shared__ float gw[32][33], gb[32][33];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int c = blockIdx.x * 32 + lane;
    const int groups = (chunks + group - 1) / group;
    const bool bias = db != nullptr;
    if (c < d && warp < groups) {
        const int k0 = warp * group, k1 = min(chunks, k0 + group);
        float sw = pw[(u64)k0 * d + c], sb = bias ? pb[(u64)k0 * d + c] : 0.0f;
#pragma unroll 8
        for (int k = k0 + 1; k < k1; ++k) {
            sw = add_rn(sw, pw[(u64)k * d + c]);
            if (bias) sb = add_rn(sb, pb[(u64)k * d + c]);
        }
        gw[warp][lane] = sw;
        gb[warp][lane] = sb;
    }
    __syncthreads();
    if (warp == 0 && c < d) {
        float sw = gw[0][lane], sb = gb[0][lane];
        for (int i = 1; i < groups; ++i) {
            sw = add_rn(sw, gw[i][lane]);
            sb = add_rn(sb, gb[i][lane]);
        }
        dw[c] = accumulate ? add_rn(dw[c], sw) : sw;
        if (bias) db[c] = accumulate ? add_rn(db[c], sb) : sb;
    }
}
#endif

// Entry points. The register-held variants (NV = 4, 8, 12, 16) exist for bf16, the training type; f32 and mixed
// types use the re-reading variant (NV = 0), which gives the same results. The crate builds two modules
// from this file: LN_BUILD_FORWARD (forward entries only) and LN_BUILD_BACKWARD (backward only), so a
// process compiles only what it uses; with neither defined, everything is compiled.
#ifndef LN_BUILD_BACKWARD
#define LN_FWD_ENTRIES(NAME, E, NV)                                                                                  \
    extern "C" __global__ void __launch_bounds__(LN_THREADS) ln_fwd_##NAME##_nv##NV(                               \
        const E::T* x, const E::T* w, const E::T* b, float* mean, float* rstd, E::T* y, int rows, int d, float eps, \
        int rms) {                                                                                                  \
        ln_fwd_impl<E, NV>(x, w, b, mean, rstd, y, rows, d, eps, rms);                                              \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(LN_THREADS) ln_fwd_fp8_##NAME##_e4m3_nv##NV(                      \
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
#endif

#ifndef LN_BUILD_FORWARD
#define LN_BWD_ENTRY(XN, E, GN, G, NV)                                                                               \
    extern "C" __global__ void __launch_bounds__(LN_THREADS) ln_bwd_##XN##_##GN##_nv##NV(                          \
        const E::T* x, const E::T* w, const G::T* dy, const float* mean, const float* rstd, G::T* dx, float* dw,    \
        float* db, float* gstage, int rows, int d, int rms, int acc_dx, int acc_param) {                          \
        ln_bwd_impl<E, G, NV>(x, w, dy, mean, rstd, dx, dw, db, gstage, rows, d, rms, acc_dx, acc_param);          \
    }
LN_BWD_ENTRY(f32, TF32, f32, TF32, 0)
LN_BWD_ENTRY(f32, TF32, bf16, TBF16, 0)
LN_BWD_ENTRY(bf16, TBF16, f32, TF32, 0)
LN_BWD_ENTRY(bf16, TBF16, bf16, TBF16, 0)
LN_BWD_ENTRY(bf16, TBF16, bf16, TBF16, 4)
LN_BWD_ENTRY(bf16, TBF16, bf16, TBF16, 8)
LN_BWD_ENTRY(bf16, TBF16, bf16, TBF16, 12)
LN_BWD_ENTRY(bf16, TBF16, bf16, TBF16, 16)
#endif
