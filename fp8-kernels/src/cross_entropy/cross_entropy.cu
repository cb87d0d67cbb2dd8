// Cross-entropy over the rows of a chunk of logits [rows, vocab], with the gradient written over the logits
// in place. Prepended with common.cuh. src/cross_entropy/mod.rs states the definitions; cpu.rs performs
// the same operations in the same order (exp and log included: they are fixed polynomial evaluations of
// IEEE operations here and there), so results agree bit for bit.
//
// One block of CE_THREADS threads per row. Element e belongs to vector e / 8; vector j to thread j % CE_THREADS,
// which walks its vectors in increasing order. A thread keeps an online (max, sum) pair: per vector, the
// vector's max vm (first the comparisons x > vm from the lowest finite float), if vm > m the sum is rescaled
// s = s * exp(m - vm) and m = vm, then s = s + exp(x - m) for each element in order. Pairs are combined by
// (m, s) + (m2, s2) = (M, s exp(m - M) + s2 exp(m2 - M)), M = m2 > m ? m2 : m: a butterfly (xor 16 .. 1)
// within each warp, then every warp combines the 16 warp results (lanes 16..31 holding the identity
// (lowest, 0)) with the same butterfly. lse = M + log(S). The second pass writes
// (exp(x - lse) - [e == target]) * grad_scale over the row.
//
// Register variants (template NV > 0, bf16 rows of a multiple of 8 at a 16-byte aligned address): a thread
// loads its first NV vectors (j = tid + k * CE_THREADS, k < NV) as raw 16-byte words up front, all loads in
// flight, unpacks them in order in the first pass and again in the second, so those vectors are read from
// memory once; vectors beyond NV * CE_THREADS (and every vector when NV = 0 or the row is not vectorisable)
// are read in each pass as before. The arithmetic and its order are the same in every variant.
//
// Code variants (template CODES = FP8_E4M3 or FP8_E5M2, entries cross_entropy_<T>_<format>): the gradient goes
// to a separate buffer of FP8 codes [rows, vocab], encode(round_T(g) * code_scale[0]), and the logits stay as
// they are: the value an in-place pass followed by the plain cast would give, without the gradient's round
// trip through memory in the logits' type. Eight codes go out as one 8-byte store when the row is vectorisable.

#define CE_THREADS 512
#define CE_WARPS (CE_THREADS / 32)
#define CE_LOWEST (-3.40282347e+38f)

// The constants of ce_exp / ce_log as f32 bit patterns (Cephes' expf and logf coefficients; the CPU uses the
// same patterns).
#define CE_F(bits) __uint_as_float(bits##u)
#define CE_LOG2E CE_F(0x3FB8AA3B)   // 1.44269504
#define CE_LN2_HI CE_F(0x3F318000)  // 0.693359375
#define CE_LN2_LO CE_F(0xB95E8083)  // -2.12194440e-4
#define CE_SQRTH CE_F(0x3F3504F3)   // 0.70710678

// exp(x) for x <= 0 (or NaN), the only arguments the kernel takes: differences to a running max, or to
// lse >= max. Cody-Waite reduction by ln 2 (k = rint(x log2 e)), Cephes' degree-5 polynomial on
// [-ln2/2, ln2/2] (about 1 ulp), then y * 2^k rounded once: y * 2^(k + 64) is exact and the multiplication
// by 2^-64 rounds (k is in -150..0 after the clamp). Only fma/mul/add with round-to-nearest. On x <= 0 this
// is exactly cpu.rs's ce_exp, which also handles x > 0 (its upper clamp and 2^(k - 64) branch never apply
// here, so the kernel leaves them out). The clamp is a select that keeps NaN; a NaN makes y NaN, and so the
// result, whatever k comes out as.
// rint(t) is (t + 1.5 * 2^23) - 1.5 * 2^23 (exact, ties to even, for |t| < 2^22; here |t| <= 151) and k is
// read from the bits of the shifted sum: the same values as rintf and a float-to-int conversion, without
// the conversion instructions, which run at a quarter of the FMA rate and dominated this compute-bound
// kernel (two per exp, two exps per logit).
__device__ __forceinline__ float ce_exp(float x) {
    x = x < -104.0f ? -104.0f : x;
    const float shifted = __fadd_rn(__fmul_rn(x, CE_LOG2E), 12582912.0f);
    const float kf = __fadd_rn(shifted, -12582912.0f);
    float r = __fmaf_rn(-kf, CE_LN2_HI, x);
    r = __fmaf_rn(-kf, CE_LN2_LO, r);
    float p = CE_F(0x39506967);          // 1.9875691500e-4
    p = __fmaf_rn(p, r, CE_F(0x3AB743CE));  // 1.3981999507e-3
    p = __fmaf_rn(p, r, CE_F(0x3C088908));  // 8.3334519073e-3
    p = __fmaf_rn(p, r, CE_F(0x3D2AA9C1));  // 4.1665795894e-2
    p = __fmaf_rn(p, r, CE_F(0x3E2AAAAA));  // 1.6666665459e-1
    p = __fmaf_rn(p, r, CE_F(0x3F000000));  // 5.0000001201e-1
    const float y = __fadd_rn(__fmaf_rn(p, __fmul_rn(r, r), r), 1.0f);
    const int k = __float_as_int(shifted) - 0x4B400000;
    const float scale = __int_as_float((int)((unsigned)(k + 64 + 127) << 23));
    return __fmul_rn(__fmul_rn(y, scale), CE_F(0x1F800000));
}

// log(x): x = m 2^e with m in [sqrt(1/2), sqrt(2)), Cephes' logf polynomial in m - 1.
__device__ __forceinline__ float ce_log(float x) {
    if (x != x || x < 0.0f) return __int_as_float(0x7FC00000);
    if (x == 0.0f) return __int_as_float(0xFF800000);
    if (x == __int_as_float(0x7F800000)) return x;
    u32 bits = __float_as_uint(x);
    int e = 0;
    if (bits < 0x00800000u) {
        bits = __float_as_uint(__fmul_rn(x, 8388608.0f));  // 2^23
        e = -23;
    }
    e += (int)(bits >> 23) - 126;
    float m = __uint_as_float((bits & 0x007FFFFFu) | 0x3F000000u);
    if (m < CE_SQRTH) {
        e -= 1;
        m = __fadd_rn(__fadd_rn(m, m), -1.0f);
    } else {
        m = __fadd_rn(m, -1.0f);
    }
    const float z = __fmul_rn(m, m);
    float y = CE_F(0x3D9021BB);             // 7.0376836292e-2
    y = __fmaf_rn(y, m, CE_F(0xBDEBD1B8));  // -1.1514610310e-1
    y = __fmaf_rn(y, m, CE_F(0x3DEF251A));  // 1.1676998740e-1
    y = __fmaf_rn(y, m, CE_F(0xBDFE5D4F));  // -1.2420140846e-1
    y = __fmaf_rn(y, m, CE_F(0x3E11E9BF));  // 1.4249322787e-1
    y = __fmaf_rn(y, m, CE_F(0xBE2AAE50));  // -1.6668057665e-1
    y = __fmaf_rn(y, m, CE_F(0x3E4CCEAC));  // 2.0000714765e-1
    y = __fmaf_rn(y, m, CE_F(0xBE7FFFFC));  // -2.4999993993e-1
    y = __fmaf_rn(y, m, CE_F(0x3EAAAAAA));  // 3.3333331174e-1
    y = __fmul_rn(__fmul_rn(y, m), z);
    const float fe = (float)e;
    y = __fmaf_rn(fe, CE_LN2_LO, y);
    y = __fmaf_rn(-0.5f, z, y);
    return __fmaf_rn(fe, CE_LN2_HI, __fadd_rn(m, y));
}

__device__ __forceinline__ void ce_combine(float& m, float& s, float m2, float s2) {
    const float big = m2 > m ? m2 : m;
    s = __fadd_rn(__fmul_rn(s, ce_exp(__fadd_rn(m, -big))), __fmul_rn(s2, ce_exp(__fadd_rn(m2, -big))));
    m = big;
}

__device__ __forceinline__ void ce_butterfly(float& m, float& s) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float m2 = __shfl_xor_sync(0xFFFFFFFFu, m, off);
        const float s2 = __shfl_xor_sync(0xFFFFFFFFu, s, off);
        ce_combine(m, s, m2, s2);
    }
}

// The raw 16-byte words of vector j of a row (8 bf16), loaded once and unpacked on use: 4 registers per
// cached vector instead of 8.
__device__ __forceinline__ void ce_unpack_bf16(const uint4& w, float (&v)[8]) {
    u16 h[8];
    unpack_u16x8(w, h);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = bf16_to_f32(h[k]);
}

template <class E, int NV, int CODES>
__device__ void ce_impl(typename E::T* logits, const int* targets, float* lse_out, float* loss_out, u32* invalid,
                        int offset, int rows, int vocab, float grad_scale, int ignore_index, int has_ignore,
                        int write_grad, u8* codes, const float* code_scale) {
    __shared__ float warp_m[CE_WARPS], warp_s[CE_WARPS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nvec = (vocab + 7) >> 3;
    // Vectors re-read per step beyond the cached ones: fewer when the cache holds the registers.
    constexpr int U = NV == 0 ? 4 : 1;
    const bool vec = (vocab & 7) == 0 && (((unsigned long long)logits & 15) == 0);
    const bool codes_vec = CODES >= 0 && (vocab & 7) == 0 && (((unsigned long long)codes & 7) == 0);
    const float cscale = CODES >= 0 ? code_scale[0] : 0.0f;
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        typename E::T* row = logits + (u64)r * vocab;
        const int t = targets[offset + r];
        const bool ignored = has_ignore && t == ignore_index;
        const bool valid = !ignored && t >= 0 && t < vocab;
        // Read before the barrier below, so before any thread overwrites the row.
        const float xt = (tid == 0 && valid) ? E::load(row, (u64)t) : 0.0f;
        float m = CE_LOWEST, s = 0.0f;
        auto consume = [&](const float (&v)[8], int n) {
            float vm = CE_LOWEST;
#pragma unroll
            for (int q = 0; q < 8; ++q)
                if (q < n && v[q] > vm) vm = v[q];
            if (vm > m) {
                s = __fmul_rn(s, ce_exp(__fadd_rn(m, -vm)));
                m = vm;
            }
#pragma unroll
            for (int q = 0; q < 8; ++q)
                if (q < n) s = __fadd_rn(s, ce_exp(__fadd_rn(v[q], -m)));
        };
        // The thread's first NV vectors (bf16 only), all loads issued before any is consumed.
        uint4 raw[NV > 0 ? NV : 1];
        int j = tid;
        if constexpr (NV > 0) {
            static_assert(sizeof(typename E::T) == 2, "the register variants hold bf16 words");
            if (vec) {
#pragma unroll
                for (int k = 0; k < NV; ++k) {
                    const int jk = tid + k * CE_THREADS;
                    if (jk < nvec) raw[k] = *reinterpret_cast<const uint4*>(row + (u64)8 * jk);
                }
#pragma unroll
                for (int k = 0; k < NV; ++k) {
                    const int jk = tid + k * CE_THREADS;
                    if (jk < nvec) {
                        float v[8];
                        ce_unpack_bf16(raw[k], v);
                        consume(v, 8);
                    }
                }
                j = tid + NV * CE_THREADS;
            }
        }
        if (vec) {
            // U 16-byte loads in flight per thread; the vectors are then consumed in order.
            for (; j + (U - 1) * CE_THREADS < nvec; j += U * CE_THREADS) {
                float v[U][8];
#pragma unroll
                for (int u = 0; u < U; ++u) E::load8(row, (u64)8 * (j + u * CE_THREADS), v[u]);
#pragma unroll
                for (int u = 0; u < U; ++u) consume(v[u], 8);
            }
        }
        for (; j < nvec; j += CE_THREADS) {
            float v[8];
            load_vec8<E>(row, j, vocab, vec, v);
            consume(v, min(8, vocab - 8 * j));
        }
        ce_butterfly(m, s);
        if (lane == 0) {
            warp_m[warp] = m;
            warp_s[warp] = s;
        }
        __syncthreads();
        m = lane < CE_WARPS ? warp_m[lane] : CE_LOWEST;
        s = lane < CE_WARPS ? warp_s[lane] : 0.0f;
        ce_butterfly(m, s);
        const float lse = __fadd_rn(m, ce_log(s));
        if (tid == 0) {
            lse_out[offset + r] = lse;
            loss_out[offset + r] = ignored ? 0.0f : (valid ? __fadd_rn(lse, -xt) : __int_as_float(0x7FC00000));
            if (!ignored && !valid) atomicAdd(invalid, 1u);
        }
        if (write_grad) {
            auto gradient = [&](int jj, const float (&v)[8]) {
                float g[8];
#pragma unroll
                for (int q = 0; q < 8; ++q) {
                    float p = ce_exp(__fadd_rn(v[q], -lse));
                    if (8 * jj + q == t) p = __fadd_rn(p, -1.0f);
                    g[q] = valid ? __fmul_rn(p, grad_scale) : 0.0f;
                }
                if constexpr (CODES < 0) {
                    store_vec8<E>(row, jj, vocab, vec, g);
                } else {
                    u8* crow = codes + (u64)r * vocab + (u64)8 * jj;
                    float h[8];
#pragma unroll
                    for (int q = 0; q < 8; ++q) h[q] = mul_rn(round_through<E>(g[q]), cscale);
                    if (codes_vec) {
                        u32 w[2];
#pragma unroll
                        for (int k = 0; k < 2; ++k)
                            w[k] = (u32)fp8x2<CODES>(h[4 * k], h[4 * k + 1]) |
                                   ((u32)fp8x2<CODES>(h[4 * k + 2], h[4 * k + 3]) << 16);
                        *reinterpret_cast<uint2*>(crow) = make_uint2(w[0], w[1]);
                    } else {
                        const int n = min(8, vocab - 8 * jj);
#pragma unroll
                        for (int q = 0; q < 8; ++q)
                            if (q < n) crow[q] = (u8)(fp8x2<CODES>(h[q], 0.0f) & 0xFFu);
                    }
                }
            };
            int jj = tid;
            if constexpr (NV > 0) {
                if (vec) {
#pragma unroll
                    for (int k = 0; k < NV; ++k) {
                        const int jk = tid + k * CE_THREADS;
                        if (jk < nvec) {
                            float v[8];
                            ce_unpack_bf16(raw[k], v);
                            gradient(jk, v);
                        }
                    }
                    jj = tid + NV * CE_THREADS;
                }
            }
            if (vec) {
                for (; jj + (U - 1) * CE_THREADS < nvec; jj += U * CE_THREADS) {
                    float v[U][8];
#pragma unroll
                    for (int u = 0; u < U; ++u) E::load8(row, (u64)8 * (jj + u * CE_THREADS), v[u]);
#pragma unroll
                    for (int u = 0; u < U; ++u) gradient(jj + u * CE_THREADS, v[u]);
                }
            }
            for (; jj < nvec; jj += CE_THREADS) {
                float v[8];
                load_vec8<E>(row, jj, vocab, vec, v);
                gradient(jj, v);
            }
        }
        __syncthreads();  // warp_m / warp_s are reused by the next row
    }
}

#define CE_ARGS                                                                                                 \
    const int *targets, float *lse, float *loss, u32 *invalid, int offset, int rows, int vocab, float grad_scale, \
        int ignore_index, int has_ignore, int write_grad
#define CE_PASS targets, lse, loss, invalid, offset, rows, vocab, grad_scale, ignore_index, has_ignore, write_grad

// Re-reading entries: at most 4 blocks of 512 per SM (32 registers).
extern "C" __global__ void __launch_bounds__(CE_THREADS) cross_entropy_f32(float* logits, CE_ARGS) {
    ce_impl<TF32, 0, -1>(logits, CE_PASS, nullptr, nullptr);
}
extern "C" __global__ void __launch_bounds__(CE_THREADS) cross_entropy_bf16(u16* logits, CE_ARGS) {
    ce_impl<TBF16, 0, -1>(logits, CE_PASS, nullptr, nullptr);
}
// The code variants read the logits only (write_grad must be 1).
#define CE_CODES_ENTRY(TNAME, E, FNAME, FMT)                                                                   \
    extern "C" __global__ void __launch_bounds__(CE_THREADS)                                                   \
        cross_entropy_##TNAME##_##FNAME(const E::T* logits, CE_ARGS, u8* codes, const float* code_scale,         \
                                        int scale_index) {                                                     \
        ce_impl<E, 0, FMT>(const_cast<E::T*>(logits), CE_PASS, codes, code_scale + scale_index);               \
    }
CE_CODES_ENTRY(f32, TF32, e4m3, FP8_E4M3)
CE_CODES_ENTRY(f32, TF32, e5m2, FP8_E5M2)
CE_CODES_ENTRY(bf16, TBF16, e4m3, FP8_E4M3)
CE_CODES_ENTRY(bf16, TBF16, e5m2, FP8_E5M2)
// Register entries (bf16): 8 vectors per thread (rows up to 32768 cached whole, longer ones in part) at 2 blocks
// per SM, 16 vectors (rows up to 65536) at 1 block per SM.
extern "C" __global__ void __launch_bounds__(CE_THREADS, 2) cross_entropy_bf16_nv8(u16* logits, CE_ARGS) {
    ce_impl<TBF16, 8, -1>(logits, CE_PASS, nullptr, nullptr);
}
extern "C" __global__ void __launch_bounds__(CE_THREADS, 1) cross_entropy_bf16_nv16(u16* logits, CE_ARGS) {
    ce_impl<TBF16, 16, -1>(logits, CE_PASS, nullptr, nullptr);
}

// acc[0] += the sum of loss[offset .. offset + n]: thread t adds loss[t], loss[t + 256], ... from zero, warps combine by a
// butterfly, then warp 0 combines the 8 warp sums (lanes 8..31 holding 0) by a butterfly. One block of
// CE_SUM_THREADS threads; successive calls on one stream add in call order.
#define CE_SUM_THREADS 256
extern "C" __global__ void __launch_bounds__(CE_SUM_THREADS)
    cross_entropy_loss_sum(const float* loss, int offset, int n, float* acc) {
    __shared__ float part[CE_SUM_THREADS / 32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float s = 0.0f;
    for (int i = tid; i < n; i += CE_SUM_THREADS) s = __fadd_rn(s, loss[offset + i]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xFFFFFFFFu, s, off));
    if (lane == 0) part[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = lane < CE_SUM_THREADS / 32 ? part[lane] : 0.0f;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xFFFFFFFFu, s, off));
        if (lane == 0) acc[0] = __fadd_rn(acc[0], s);
    }
}
