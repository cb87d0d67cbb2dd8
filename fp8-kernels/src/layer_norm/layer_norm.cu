// Layer normalisation and RMS normalisation over the rows of a [rows, d] tensor. Prepended with
// common.cuh. src/layer_norm/mod.rs states the definitions; src/layer_norm/cpu.rs performs the same
// operations in the same order, so results agree bit for bit.
//
// Row layout (every kernel): a row belongs to one warp. Element e belongs to vector e / 8; vector j is
// handled by lane j % 32, which walks its vectors in increasing order and the elements of each vector in
// increasing order. A row sum is the 32 lane sums combined by a butterfly (xor 16, 8, 4, 2, 1).
//
// Compile-time parameters, which change speed, never results:
//   NV   vectors of 8 a lane keeps in registers per row (bf16 rows whose length is a multiple of 8 and at
//        most 256 NV), or 0 to re-read the row from memory on every pass (any row). The host launches
//        NV > 0 only when d is a multiple of 8 (buffers are 256-byte aligned), so those kernels take the
//        16-byte path unconditionally; NV == 0 checks at run time.
//   RPW  rows a warp of the forward holds at once: their loads are in flight together and their sums
//        interleave, so a warp waits for memory once per RPW rows.
//   RMS  RMSNorm: no mean, and x - 0 is x, so the subtraction is left out (same values).
//   PF   backward: the next row's x and dy are loaded while the current row is computed.
//
// Built per NV: with LN_NV_ONLY defined only that NV's entries are compiled (the host loads one such module
// per row width); without it every entry is. LN_BUILD_FORWARD / LN_BUILD_BACKWARD select one direction.

#define LN_MAX_THREADS 512
// Bytes of padding per row of the shared FP8 code tile (keeps 16-byte alignment, spreads banks).
#define LN_TILE_PAD 16
// Chunks of rows per tile of the parameter sums = warps per backward block (mod.rs: ParamOrder).
#define LN_TILE_CHUNKS 8
#define LN_BWD_THREADS (32 * LN_TILE_CHUNKS)

#ifdef LN_NV_ONLY
#define LN_HAS_NV(n) (LN_NV_ONLY == (n))
#else
#define LN_HAS_NV(n) 1
#endif

template <class E>
struct LnIsBf16 {
    static constexpr bool value = false;
};
template <>
struct LnIsBf16<TBF16> {
    static constexpr bool value = true;
};
template <class E>
struct LnIsF32 {
    static constexpr bool value = false;
};
template <>
struct LnIsF32<TF32> {
    static constexpr bool value = true;
};

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
    // Each 32-bit word holds elements 2k (low half) and 2k + 1 (high half): one shift or mask each.
    __device__ __forceinline__ void get(float (&v)[8]) const {
        const u32 p[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            v[2 * k] = __uint_as_float(p[k] << 16);
            v[2 * k + 1] = __uint_as_float(p[k] & 0xFFFF0000u);
        }
    }
};

// Vector j of the row starting at `row` (16-byte loads when `vec`, else element loads, zeros past d).
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

// Valid elements of vector j: all 8 in the register-held kernels (d a multiple of 8).
template <int NV>
__device__ __forceinline__ int ln_valid(int d, int j) {
    return NV > 0 ? 8 : min(8, d - 8 * j);
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

// Butterfly sums of N values at once (their shuffles interleave); every lane gets the sums.
template <int N>
__device__ __forceinline__ void ln_warp_sums(float (&v)[N]) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] = add_rn(v[i], __shfl_xor_sync(0xFFFFFFFFu, v[i], off));
    }
}

// Each value rounded to the element type and back (bf16: pairs through one cvt.rn.bf16x2.f32, which
// rounds as f32_to_bf16 does; the value of the first operand goes to the upper half).
template <class E>
__device__ __forceinline__ void ln_round8(float (&h)[8]) {
    if constexpr (LnIsBf16<E>::value) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            u32 p;
            asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(p) : "f"(h[2 * k + 1]), "f"(h[2 * k]));
            h[2 * k] = __uint_as_float(p << 16);
            h[2 * k + 1] = __uint_as_float(p & 0xFFFF0000u);
        }
    } else if constexpr (!LnIsF32<E>::value) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            typename E::T tmp[1];
            E::store(tmp, 0, h[k]);
            h[k] = E::load(tmp, 0);
        }
    }
}

// Four E4M3 codes, a in the low byte. E4M3's NaN is the only code whose low seven bits are all set; the
// sign of such a byte is cleared, so every NaN gives 0x7F as fp8_core encodes it (a byte's low seven bits
// plus one carry into its bit 7 exactly then, never into the next byte).
__device__ __forceinline__ u32 ln_e4m3x4(float a, float b, float c, float d) {
    const u32 v = (u32)fp8x2_raw<FP8_E4M3>(a, b) | ((u32)fp8x2_raw<FP8_E4M3>(c, d) << 16);
    const u32 nan = ((v & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;
    return v & ~nan;
}

// The 4x4 byte transpose of four words (rows a..d, byte k = column k): out[k] = column k, row a first.
__device__ __forceinline__ void ln_transpose4(u32 a, u32 b, u32 c, u32 d, u32 (&out)[4]) {
    const u32 ab01 = __byte_perm(a, b, 0x5140), ab23 = __byte_perm(a, b, 0x7362);
    const u32 cd01 = __byte_perm(c, d, 0x5140), cd23 = __byte_perm(c, d, 0x7362);
    out[0] = __byte_perm(ab01, cd01, 0x5410);
    out[1] = __byte_perm(ab01, cd01, 0x7632);
    out[2] = __byte_perm(ab23, cd23, 0x5410);
    out[3] = __byte_perm(ab23, cd23, 0x7632);
}

// The codes of a tile of tr rows (shared, rows ts bytes apart) into the transposed codes [d, rows] at
// column r0: item (cw, h) takes columns 4 cw .. 4 cw + 3 of the tile's rows SEG h .. SEG h + SEG - 1 (SEG
// words read, transposed with byte permutes, four stores of SEG bytes). tr and r0 are multiples of SEG.
template <int SEG>
__device__ __forceinline__ void ln_write_transposed(const u8* tile, int ts, u8* qt, int rows, int r0, int tr, int d) {
    const int words = d >> 2, items = words * (tr / SEG);
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
        int cw = it, h = 0;
        while (cw >= words) {
            cw -= words;
            ++h;
        }
        u32 in[SEG];
#pragma unroll
        for (int rr = 0; rr < SEG; ++rr)
            in[rr] = *reinterpret_cast<const u32*>(tile + (u64)(SEG * h + rr) * ts + 4 * cw);
        u32 col[SEG / 4][4];
#pragma unroll
        for (int p = 0; p < SEG / 4; ++p) ln_transpose4(in[4 * p], in[4 * p + 1], in[4 * p + 2], in[4 * p + 3], col[p]);
        u8* dst = qt + (u64)(4 * cw) * rows + r0 + SEG * h;
#pragma unroll
        for (int bc = 0; bc < 4; ++bc) {
            if constexpr (SEG == 16) {
                *reinterpret_cast<uint4*>(dst + (u64)bc * rows) = make_uint4(col[0][bc], col[1][bc], col[2][bc], col[3][bc]);
            } else {
                *reinterpret_cast<uint2*>(dst + (u64)bc * rows) = make_uint2(col[0][bc], col[1][bc]);
            }
        }
    }
}

__device__ __forceinline__ bool ln_aligned16(const void* p) { return ((unsigned long long)p & 15) == 0; }

// mean (0 for RMSNorm) and rstd = 1 / sqrt(var + eps) of RPW rows held by one warp, every lane getting the
// same values. Each row's sums run in the warp order; the rows only interleave.
template <class E, int NV, int RPW, int RMS>
__device__ __forceinline__ void ln_rows_stats(const RowCache<E, NV> (&c)[RPW], const typename E::T* const (&row)[RPW],
                                              int lane, int d, bool vec, float eps, float (&mean)[RPW],
                                              float (&rstd)[RPW]) {
    const int nvec = (d + 7) >> 3;
    float m[RPW], v[RPW];
#pragma unroll
    for (int i = 0; i < RPW; ++i) m[i] = v[i] = 0.0f;
    if constexpr (!RMS) {
        lane_vectors<NV>(lane, nvec, [&](int k, int j) {
            const int n = ln_valid<NV>(d, j);
#pragma unroll
            for (int i = 0; i < RPW; ++i) {
                float t[8];
                c[i].get(k, row[i], j, d, vec, t);
#pragma unroll
                for (int q = 0; q < 8; ++q)
                    if (q < n) m[i] = add_rn(m[i], t[q]);
            }
        });
        ln_warp_sums<RPW>(m);
#pragma unroll
        for (int i = 0; i < RPW; ++i) m[i] = div_rn(m[i], (float)d);
    }
    lane_vectors<NV>(lane, nvec, [&](int k, int j) {
        const int n = ln_valid<NV>(d, j);
#pragma unroll
        for (int i = 0; i < RPW; ++i) {
            float t[8];
            c[i].get(k, row[i], j, d, vec, t);
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                if (q < n) {
                    const float u = RMS ? t[q] : add_rn(t[q], -m[i]);
                    v[i] = add_rn(v[i], mul_rn(u, u));
                }
            }
        }
    });
    ln_warp_sums<RPW>(v);
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
        mean[i] = m[i];
        rstd[i] = div_rn(1.0f, __fsqrt_rn(add_rn(div_rn(v[i], (float)d), eps)));
    }
}

// y = (x - mean) * rstd * w (+ b), left to right, in f32 (not yet rounded to the element type).
template <int RMS>
__device__ __forceinline__ void ln_affine8(float (&t)[8], const float (&wv)[8], const float (&bv)[8], bool bias,
                                           float mean, float rstd) {
#pragma unroll
    for (int q = 0; q < 8; ++q) {
        float y = mul_rn(mul_rn(RMS ? t[q] : add_rn(t[q], -mean), rstd), wv[q]);
        if (bias) y = add_rn(y, bv[q]);
        t[q] = y;
    }
}

// The weight (and bias) of vector j, as f32.
template <class E>
__device__ __forceinline__ void ln_params8(const typename E::T* w, const typename E::T* b, int j, int d, bool vec,
                                          float (&wv)[8], float (&bv)[8]) {
    Raw8<E> r;
    ln_load<E>(r, w, j, d, vec);
    r.get(wv);
    if (b != nullptr) {
        Raw8<E> rb;
        ln_load<E>(rb, b, j, d, vec);
        rb.get(bv);
    } else {
#pragma unroll
        for (int q = 0; q < 8; ++q) bv[q] = 0.0f;
    }
}

// ---- forward, output in the element type ----
// Blocks of W warps take groups of W * RPW consecutive rows (grid-stride); warp i holds rows RPW i ..
// RPW i + RPW - 1 of the group at once. WRITE_Y false writes the statistics only (y unused), for a
// consumer that applies them itself: the block-scaled cast of the norm's output (block_activation.cu's
// NormValue). A template parameter, not a null test, so the output variants compile as before.
template <class E, int NV, int RPW, int RMS, bool WRITE_Y = true>
__device__ void ln_fwd_rows(const typename E::T* x, const typename E::T* w, const typename E::T* b, float* mean_out,
                            float* rstd_out, typename E::T* y, int rows, int d, float eps) {
    typedef typename E::T T;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 per_block = (i64)(blockDim.x >> 5) * RPW;
    const bool vec = NV > 0 || ((d & 7) == 0 && ln_aligned16(x) && ln_aligned16(w) && ln_aligned16(y) &&
                                (b == nullptr || ln_aligned16(b)));
    const int nvec = (d + 7) >> 3;
    for (i64 g0 = (i64)blockIdx.x * per_block; g0 < rows; g0 += (i64)gridDim.x * per_block) {
        const i64 r0 = g0 + (i64)warp * RPW;
        if (r0 >= rows) continue;
        const T* row[RPW];
        RowCache<E, NV> c[RPW];
#pragma unroll
        for (int i = 0; i < RPW; ++i) {
            // Rows past the end repeat the last row (loaded, never stored).
            row[i] = x + (u64)min(r0 + i, (i64)rows - 1) * d;
            c[i].fill(row[i], lane, d, vec);
        }
        float mean[RPW], rstd[RPW];
        ln_rows_stats<E, NV, RPW, RMS>(c, row, lane, d, vec, eps, mean, rstd);
#pragma unroll
        for (int i = 0; i < RPW; ++i) {
            if (lane == 0 && r0 + i < rows) {
                mean_out[r0 + i] = mean[i];
                rstd_out[r0 + i] = rstd[i];
            }
        }
        if (!WRITE_Y) continue;
        lane_vectors<NV>(lane, nvec, [&](int k, int j) {
            float wv[8], bv[8];
            ln_params8<E>(w, b, j, d, vec, wv, bv);
#pragma unroll
            for (int i = 0; i < RPW; ++i) {
                if (r0 + i < rows) {
                    float t[8];
                    c[i].get(k, row[i], j, d, vec, t);
                    ln_affine8<RMS>(t, wv, bv, b != nullptr, mean[i], rstd[i]);
                    store_vec8<E>(y + (u64)(r0 + i) * d, j, d, vec, t);
                }
            }
        });
    }
}

// ---- forward fused with the FP8 cast: codes [rows, d], transposed codes [d, rows], amax ----
// A block of W warps owns tiles of tile_rows = W * RPW rows (all d columns), grid-stride. Warp i holds the
// tile's rows RPW i .. RPW i + RPW - 1 at once, casts each value h = (y rounded to the element type) as
// encode(h * scale), stores each row's codes and keeps them in a shared tile; after a barrier the block
// writes the tile's columns into the transposed codes (ln_write_transposed: pieces of 16 or 8 rows when
// rows and tile_rows are multiples of that and d of 8, else byte stores). The amax is a running max per thread (NaN never wins fmaxf), one atomic per block.
template <class E, int NV, int RPW, int RMS>
__device__ void ln_fwd_fp8_rows(const typename E::T* x, const typename E::T* w, const typename E::T* b,
                                float* mean_out, float* rstd_out, u8* q, u8* qt, const float* scale, float* amax,
                                int slot, int rows, int d, float eps, int tile_rows) {
    typedef typename E::T T;
    extern __shared__ __align__(16) u8 ln_tile[];
    const int ts = d + LN_TILE_PAD;
    const float s = *scale;
    float m = 0.0f;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // Either layout may be left out (null): the row-major codes when the caller recasts them later, the
    // transpose (and its shared-memory tile) when its GEMM casts its input again in the backward.
    const bool want_q = q != nullptr, want_qt = qt != nullptr;
    const bool vec = NV > 0 || ((d & 7) == 0 && ln_aligned16(x) && ln_aligned16(w) &&
                                (b == nullptr || ln_aligned16(b)) && (((unsigned long long)q & 7) == 0));
    // Rows per piece of a transposed column: 16 or 8 when rows and tile_rows are multiples of it, else bytes.
    const int seg = !vec ? 0
                    : ((rows & 15) == 0 && (tile_rows & 15) == 0 && ln_aligned16(qt))            ? 16
                    : ((rows & 7) == 0 && (tile_rows & 7) == 0 && ((unsigned long long)qt & 7) == 0) ? 8
                                                                                                     : 0;
    const int nvec = (d + 7) >> 3;
    const int tiles = (rows + tile_rows - 1) / tile_rows;
    const int i0 = warp * RPW;  // the warp's first row in the tile
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        const int r0 = t * tile_rows;
        const int tr = min(tile_rows, rows - r0);
        const T* row[RPW];
        RowCache<E, NV> c[RPW];
#pragma unroll
        for (int i = 0; i < RPW; ++i) {
            // Rows past the tile's end repeat its last row (loaded, never stored).
            row[i] = x + (u64)(r0 + min(i0 + i, tr - 1)) * d;
            c[i].fill(row[i], lane, d, vec);
        }
        float mean[RPW], rstd[RPW];
        ln_rows_stats<E, NV, RPW, RMS>(c, row, lane, d, vec, eps, mean, rstd);
#pragma unroll
        for (int i = 0; i < RPW; ++i) {
            if (lane == 0 && i0 + i < tr) {
                mean_out[r0 + i0 + i] = mean[i];
                rstd_out[r0 + i0 + i] = rstd[i];
            }
        }
        lane_vectors<NV>(lane, nvec, [&](int k, int j) {
            const int n = ln_valid<NV>(d, j);
            float wv[8], bv[8];
            ln_params8<E>(w, b, j, d, vec, wv, bv);
#pragma unroll
            for (int i = 0; i < RPW; ++i) {
                if (i0 + i < tr) {
                    float h[8];
                    c[i].get(k, row[i], j, d, vec, h);
                    ln_affine8<RMS>(h, wv, bv, b != nullptr, mean[i], rstd[i]);
                    ln_round8<E>(h);
#pragma unroll
                    for (int e = 0; e < 8; ++e)
                        if (e < n) m = fmaxf(m, fabsf(h[e]));
                    const u32 lo = ln_e4m3x4(mul_rn(h[0], s), mul_rn(h[1], s), mul_rn(h[2], s), mul_rn(h[3], s));
                    const u32 hi = ln_e4m3x4(mul_rn(h[4], s), mul_rn(h[5], s), mul_rn(h[6], s), mul_rn(h[7], s));
                    u8* qrow = want_q ? q + (u64)(r0 + i0 + i) * d + 8 * j : nullptr;
                    u8* trow = want_qt ? ln_tile + (u64)(i0 + i) * ts + 8 * j : nullptr;
                    if (vec) {
                        const uint2 pair = make_uint2(lo, hi);
                        if (want_q) *reinterpret_cast<uint2*>(qrow) = pair;
                        if (want_qt) *reinterpret_cast<uint2*>(trow) = pair;
                    } else {
#pragma unroll
                        for (int e = 0; e < 8; ++e) {
                            if (e < n) {
                                const u8 code = (u8)(((e < 4 ? lo : hi) >> (8 * (e & 3))) & 0xFFu);
                                if (want_q) qrow[e] = code;
                                if (want_qt) trow[e] = code;
                            }
                        }
                    }
                }
            }
        });
        if (!want_qt) continue;  // uniform across the block: qt is a kernel argument
        __syncthreads();
        if (seg == 16) {
            ln_write_transposed<16>(ln_tile, ts, qt, rows, r0, tr, d);
        } else if (seg == 8) {
            ln_write_transposed<8>(ln_tile, ts, qt, rows, r0, tr, d);
        } else {
            for (int it = threadIdx.x; it < d * tr; it += blockDim.x) {
                const int c = it / tr, i = it - c * tr;
                qt[(u64)c * rows + r0 + i] = ln_tile[(u64)i * ts + c];
            }
        }
        __syncthreads();
    }
    // Non-negative floats order as their bits.
    block_amax_commit(__float_as_int(m), amax == nullptr ? nullptr : amax + slot);
}

// ---- backward, fused: dx and the tile sums of dweight / dbias ----
// g = dy * w, xhat = (x - mean) * rstd (x * rstd for RMSNorm), c1 = sum(g * xhat) / d, c2 = sum(g) / d
// (0 for RMSNorm), dx = (g - c2 - xhat * c1) * rstd, optionally added to the dx already stored.
// Parameter sums (mod.rs: ParamOrder): a block of LN_TILE_CHUNKS warps takes tiles of LN_TILE_CHUNKS chunks
// (grid-stride); warp i takes chunk i of the tile and walks its rows in order, computing each row's dx and
// adding dy * xhat (and dy when there is a bias) into its own running sums of its columns, started from zero
// per chunk. After a barrier, thread t adds the tile's chunk sums of its columns c = t, t + blockDim, ... in
// chunk order from the first. x and dy are read once. With one tile the sums are the result (overwriting
// or added); otherwise they are the tile's partial sums, which ln_param_reduce combines. The running sums
// live in dynamic shared memory, or in `gacc` (a per-block slice of global memory) when the row is too wide:
// per warp and plane two arrays of nvec float4, the first halves of the lane's vectors then the second
// halves (16-byte accesses, consecutive lanes at consecutive addresses).
template <class E, class G, int NV, int RMS, int PF>
__device__ void ln_bwd_rows(const typename E::T* x, const typename E::T* w, const typename G::T* dy,
                            const float* mean_in, const float* rstd_in, typename G::T* dx, float* dw, float* db,
                            float* gacc, int rows, int d, int chunk_rows, int chunks, int acc_dx, int acc_param) {
    extern __shared__ __align__(16) float ln_acc_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool bias = db != nullptr;
    const int nvec = (d + 7) >> 3;
    const u64 plane = (u64)nvec * 8;
    const u64 per_warp = bias ? 2 * plane : plane;
    float* blk = gacc != nullptr ? gacc + (u64)blockIdx.x * LN_TILE_CHUNKS * per_warp : ln_acc_smem;
    float4* aw = reinterpret_cast<float4*>(blk + (u64)warp * per_warp);
    float4* ab = reinterpret_cast<float4*>(blk + (u64)warp * per_warp + plane);
    const bool vec =
        NV > 0 || ((d & 7) == 0 && ln_aligned16(x) && ln_aligned16(w) && ln_aligned16(dy) && ln_aligned16(dx));
    const int tiles = (chunks + LN_TILE_CHUNKS - 1) / LN_TILE_CHUNKS;

    // One row: dx, and the row's terms added into the running sums.
    auto row_pass = [&](const RowCache<E, NV>& cx, const RowCache<G, NV>& cg, i64 r, float mean, float rstd) {
        const typename E::T* xrow = x + (u64)r * d;
        const typename G::T* grow = dy + (u64)r * d;
        typename G::T* drow = dx + (u64)r * d;
        float sums[2] = {0.0f, 0.0f};  // sum(g), sum(g * xhat)
        lane_vectors<NV>(lane, nvec, [&](int k, int j) {
            const int n = ln_valid<NV>(d, j);
            float xv[8], gv[8], wv[8];
            cx.get(k, xrow, j, d, vec, xv);
            cg.get(k, grow, j, d, vec, gv);
            Raw8<E> rw;
            ln_load<E>(rw, w, j, d, vec);
            rw.get(wv);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                if (e < n) {
                    const float g = mul_rn(gv[e], wv[e]);
                    const float xh = mul_rn(RMS ? xv[e] : add_rn(xv[e], -mean), rstd);
                    if (!RMS) sums[0] = add_rn(sums[0], g);
                    sums[1] = add_rn(sums[1], mul_rn(g, xh));
                }
            }
        });
        if (RMS) {
            float one[1] = {sums[1]};
            ln_warp_sums<1>(one);
            sums[1] = one[0];
        } else {
            ln_warp_sums<2>(sums);
        }
        const float c1 = div_rn(sums[1], (float)d);
        const float c2 = RMS ? 0.0f : div_rn(sums[0], (float)d);
        lane_vectors<NV>(lane, nvec, [&](int k, int j) {
            float xv[8], gv[8], wv[8], o[8], p[8];
            cx.get(k, xrow, j, d, vec, xv);
            cg.get(k, grow, j, d, vec, gv);
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
                const float xh = mul_rn(RMS ? xv[e] : add_rn(xv[e], -mean), rstd);
                const float gc = RMS ? g : add_rn(g, -c2);
                float v = mul_rn(add_rn(gc, -mul_rn(xh, c1)), rstd);
                if (acc_dx) v = add_rn(old[e], v);
                o[e] = v;
                p[e] = mul_rn(gv[e], xh);
            }
            store_vec8<G>(drow, j, d, vec, o);
            // Entries past d (the last vector of a row that is not a multiple of 8) are never combined.
            float4 a = aw[j], a2 = aw[nvec + j];
            a.x = add_rn(a.x, p[0]); a.y = add_rn(a.y, p[1]); a.z = add_rn(a.z, p[2]); a.w = add_rn(a.w, p[3]);
            a2.x = add_rn(a2.x, p[4]); a2.y = add_rn(a2.y, p[5]); a2.z = add_rn(a2.z, p[6]); a2.w = add_rn(a2.w, p[7]);
            aw[j] = a;
            aw[nvec + j] = a2;
            if (bias) {
                float4 c = ab[j], c2v = ab[nvec + j];
                c.x = add_rn(c.x, gv[0]); c.y = add_rn(c.y, gv[1]); c.z = add_rn(c.z, gv[2]); c.w = add_rn(c.w, gv[3]);
                c2v.x = add_rn(c2v.x, gv[4]); c2v.y = add_rn(c2v.y, gv[5]);
                c2v.z = add_rn(c2v.z, gv[6]); c2v.w = add_rn(c2v.w, gv[7]);
                ab[j] = c;
                ab[nvec + j] = c2v;
            }
        });
    };
    auto row_stats = [&](i64 r, float& mean, float& rstd) {
        mean = RMS ? 0.0f : mean_in[r];
        rstd = rstd_in[r];
    };

    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        lane_vectors<NV>(lane, nvec, [&](int, int j) {
            aw[j] = zero;
            aw[nvec + j] = zero;
            if (bias) {
                ab[j] = zero;
                ab[nvec + j] = zero;
            }
        });
        const i64 chunk = (i64)t * LN_TILE_CHUNKS + warp;
        const i64 r_begin = min(chunk * chunk_rows, (i64)rows);
        const i64 r_end = min(r_begin + chunk_rows, (i64)rows);
        if constexpr (PF && NV > 0) {
            // Two row buffers in turn: row r + 1 is loaded before row r is computed.
            RowCache<E, NV> xa, xb;
            RowCache<G, NV> ga, gb;
            float ma = 0.0f, ra = 0.0f, mb = 0.0f, rb = 0.0f;
            if (r_begin < r_end) {
                xa.fill(x + (u64)r_begin * d, lane, d, vec);
                ga.fill(dy + (u64)r_begin * d, lane, d, vec);
                row_stats(r_begin, ma, ra);
            }
            for (i64 r = r_begin; r < r_end; r += 2) {
                if (r + 1 < r_end) {
                    xb.fill(x + (u64)(r + 1) * d, lane, d, vec);
                    gb.fill(dy + (u64)(r + 1) * d, lane, d, vec);
                    row_stats(r + 1, mb, rb);
                }
                row_pass(xa, ga, r, ma, ra);
                if (r + 1 >= r_end) break;
                if (r + 2 < r_end) {
                    xa.fill(x + (u64)(r + 2) * d, lane, d, vec);
                    ga.fill(dy + (u64)(r + 2) * d, lane, d, vec);
                    row_stats(r + 2, ma, ra);
                }
                row_pass(xb, gb, r + 1, mb, rb);
            }
        } else {
            for (i64 r = r_begin; r < r_end; ++r) {
                RowCache<E, NV> cx;
                RowCache<G, NV> cg;
                cx.fill(x + (u64)r * d, lane, d, vec);
                cg.fill(dy + (u64)r * d, lane, d, vec);
                float mean, rstd;
                row_stats(r, mean, rstd);
                row_pass(cx, cg, r, mean, rstd);
            }
        }
        __syncthreads();
        const int nch = min(LN_TILE_CHUNKS, chunks - t * LN_TILE_CHUNKS);
        for (int c = threadIdx.x; c < d; c += blockDim.x) {
            const int j = c >> 3, e = c & 7;
            const u64 at = ((u64)(e >> 2) * nvec + j) * 4 + (e & 3);
            float sw = blk[at], sb = bias ? blk[plane + at] : 0.0f;
            for (int i = 1; i < nch; ++i) {
                sw = add_rn(sw, blk[(u64)i * per_warp + at]);
                if (bias) sb = add_rn(sb, blk[(u64)i * per_warp + plane + at]);
            }
            if (tiles == 1) {
                dw[c] = acc_param ? add_rn(dw[c], sw) : sw;
                if (bias) db[c] = acc_param ? add_rn(db[c], sb) : sb;
            } else {
                dw[(u64)t * d + c] = sw;
                if (bias) db[(u64)t * d + c] = sb;
            }
        }
        __syncthreads();
    }
}

#if defined(LN_BUILD_BACKWARD) || !defined(LN_BUILD_FORWARD)
// Combines the tile partials [tiles][d] (mod.rs: ParamOrder): block x covers 32 columns (lane = column),
// warp i the run i: the sum of tiles [i run, (i + 1) run) in tile order from the run's first; then lane c
// of warp 0 adds the run sums in run order from the first and writes (or adds to) the result. 1024 threads
// (32 runs at most). Built into every backward module.
extern "C" __global__ void __launch_bounds__(1024)
    ln_param_reduce(const float* pw, const float* pb, float* dw, float* db, int tiles, int d, int run,
                    int accumulate) {
    __shared__ float gw[32][33], gb[32][33];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int c = blockIdx.x * 32 + lane;
    const int runs = (tiles + run - 1) / run;
    const bool bias = db != nullptr;
    if (c < d && warp < runs) {
        const int k0 = warp * run, k1 = min(tiles, k0 + run);
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
        for (int i = 1; i < runs; ++i) {
            sw = add_rn(sw, gw[i][lane]);
            sb = add_rn(sb, gb[i][lane]);
        }
        dw[c] = accumulate ? add_rn(dw[c], sw) : sw;
        if (bias) db[c] = accumulate ? add_rn(db[c], sb) : sb;
    }
}
#endif

// ---- entry points ----
// Forward: ln_fwd_<T>_nv<NV>_r<RPW>_<ln|rms>, ln_stats_<T>_nv<NV>_r<RPW>_<ln|rms> (the statistics alone)
// and ln_fwd_fp8_<T>_e4m3_nv<NV>_r<RPW>_<ln|rms>; register-held
// variants (NV > 0) for bf16, the training type; f32 rows use the re-reading variants (NV = 0), which give
// the same results. At most 512 threads per block; MINB (plain) and MINB8 (FP8) are the blocks of 512
// threads per SM each variant is built for: 2 (64 registers a thread) where that fits without spilling,
// else 1 (128).
#if defined(LN_BUILD_FORWARD) || !defined(LN_BUILD_BACKWARD)
#define LN_FWD_ENTRIES(TN, E, NV, RPW, KN, RMS, MINB, MINB8)                                                     \
    extern "C" __global__ void __launch_bounds__(LN_MAX_THREADS, MINB) ln_fwd_##TN##_nv##NV##_r##RPW##_##KN(       \
        const E::T* x, const E::T* w, const E::T* b, float* mean, float* rstd, E::T* y, int rows, int d,          \
        float eps) {                                                                                              \
        ln_fwd_rows<E, NV, RPW, RMS>(x, w, b, mean, rstd, y, rows, d, eps);                                       \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(LN_MAX_THREADS, MINB) ln_stats_##TN##_nv##NV##_r##RPW##_##KN(     \
        const E::T* x, const E::T* w, const E::T* b, float* mean, float* rstd, int rows, int d, float eps) {      \
        ln_fwd_rows<E, NV, RPW, RMS, false>(x, w, b, mean, rstd, nullptr, rows, d, eps);                          \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(LN_MAX_THREADS, MINB8)                                          \
        ln_fwd_fp8_##TN##_e4m3_nv##NV##_r##RPW##_##KN(const E::T* x, const E::T* w, const E::T* b, float* mean,   \
                                                      float* rstd, u8* q, u8* qt, const float* scale,             \
                                                      float* amax, int slot, int rows, int d, float eps,          \
                                                      int tile_rows) {                                            \
        ln_fwd_fp8_rows<E, NV, RPW, RMS>(x, w, b, mean, rstd, q, qt, scale, amax, slot, rows, d, eps, tile_rows); \
    }
#define LN_FWD_KINDS(TN, E, NV, RPW, MINB, MINB8) \
    LN_FWD_ENTRIES(TN, E, NV, RPW, ln, 0, MINB, MINB8) LN_FWD_ENTRIES(TN, E, NV, RPW, rms, 1, MINB, MINB8)

#if LN_HAS_NV(0)
LN_FWD_KINDS(f32, TF32, 0, 1, 2, 2)
LN_FWD_KINDS(f32, TF32, 0, 2, 1, 1)
LN_FWD_KINDS(f32, TF32, 0, 4, 1, 1)
LN_FWD_KINDS(bf16, TBF16, 0, 1, 2, 2)
LN_FWD_KINDS(bf16, TBF16, 0, 2, 2, 2)
LN_FWD_KINDS(bf16, TBF16, 0, 4, 1, 1)
#endif
#if LN_HAS_NV(2)
LN_FWD_KINDS(bf16, TBF16, 2, 1, 2, 2)
LN_FWD_KINDS(bf16, TBF16, 2, 2, 2, 2)
LN_FWD_KINDS(bf16, TBF16, 2, 4, 1, 1)
#endif
#if LN_HAS_NV(3)
LN_FWD_KINDS(bf16, TBF16, 3, 1, 2, 2)
LN_FWD_KINDS(bf16, TBF16, 3, 2, 1, 2)
LN_FWD_KINDS(bf16, TBF16, 3, 4, 1, 1)
#endif
#if LN_HAS_NV(4)
LN_FWD_KINDS(bf16, TBF16, 4, 1, 2, 2)
LN_FWD_KINDS(bf16, TBF16, 4, 2, 1, 1)
LN_FWD_KINDS(bf16, TBF16, 4, 4, 1, 1)
#endif
#if LN_HAS_NV(6)
LN_FWD_KINDS(bf16, TBF16, 6, 1, 2, 2)
LN_FWD_KINDS(bf16, TBF16, 6, 2, 1, 1)
#endif
#if LN_HAS_NV(8)
LN_FWD_KINDS(bf16, TBF16, 8, 1, 2, 2)
LN_FWD_KINDS(bf16, TBF16, 8, 2, 1, 1)
#endif
#if LN_HAS_NV(10)
LN_FWD_KINDS(bf16, TBF16, 10, 1, 1, 1)
#endif
#if LN_HAS_NV(12)
LN_FWD_KINDS(bf16, TBF16, 12, 1, 1, 1)
#endif
#if LN_HAS_NV(16)
LN_FWD_KINDS(bf16, TBF16, 16, 1, 1, 1)
#endif
#endif

// Backward: ln_bwd_<T>_<G>_nv<NV>_<ln|rms>_pf<0|1>, blocks of LN_BWD_THREADS threads, two per SM at least
// (128 registers per thread).
#if defined(LN_BUILD_BACKWARD) || !defined(LN_BUILD_FORWARD)
#define LN_BWD_ENTRY(XN, E, GN, G, NV, KN, RMS, PF)                                                                \
    extern "C" __global__ void __launch_bounds__(LN_BWD_THREADS, 2) ln_bwd_##XN##_##GN##_nv##NV##_##KN##_pf##PF( \
        const E::T* x, const E::T* w, const G::T* dy, const float* mean, const float* rstd, G::T* dx, float* dw,  \
        float* db, float* gacc, int rows, int d, int chunk_rows, int chunks, int acc_dx, int acc_param) {         \
        ln_bwd_rows<E, G, NV, RMS, PF>(x, w, dy, mean, rstd, dx, dw, db, gacc, rows, d, chunk_rows, chunks,        \
                                       acc_dx, acc_param);                                                       \
    }
#define LN_BWD_KINDS(XN, E, GN, G, NV, PF) \
    LN_BWD_ENTRY(XN, E, GN, G, NV, ln, 0, PF) LN_BWD_ENTRY(XN, E, GN, G, NV, rms, 1, PF)

#if LN_HAS_NV(0)
LN_BWD_KINDS(f32, TF32, f32, TF32, 0, 0)
LN_BWD_KINDS(f32, TF32, bf16, TBF16, 0, 0)
LN_BWD_KINDS(bf16, TBF16, f32, TF32, 0, 0)
LN_BWD_KINDS(bf16, TBF16, bf16, TBF16, 0, 0)
#endif
#if LN_HAS_NV(2)
LN_BWD_KINDS(bf16, TBF16, bf16, TBF16, 2, 0)
LN_BWD_KINDS(bf16, TBF16, bf16, TBF16, 2, 1)
#endif
#if LN_HAS_NV(3)
LN_BWD_KINDS(bf16, TBF16, bf16, TBF16, 3, 0)
LN_BWD_KINDS(bf16, TBF16, bf16, TBF16, 3, 1)
#endif
#if LN_HAS_NV(4)
LN_BWD_KINDS(bf16, TBF16, bf16, TBF16, 4, 0)
LN_BWD_KINDS(bf16, TBF16, bf16, TBF16, 4, 1)
#endif
#if LN_HAS_NV(6)
LN_BWD_KINDS(bf16, TBF16, bf16, TBF16, 6, 0)
#endif
#if LN_HAS_NV(8)
LN_BWD_KINDS(bf16, TBF16, bf16, TBF16, 8, 0)
#endif
#endif
