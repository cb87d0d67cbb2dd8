// The separate (two-kernel) tensor-core backward: a dK/dV kernel over key blocks and a dQ kernel over
// query blocks, each recomputing P from the forward's lse (FlashAttention-2's deterministic scheme).
// Appended to attention.cu in every module (it uses attention_mma.cuh's PTX wrappers, tile loaders and
// warp products, and attention.cu's entry-point macros); its entry points are listed at the end.
//
// Against the fused kernel (attention.cu, which adds dQ into F32 accumulators from the key-block loop):
// S and dP are computed twice (7 matrix products per tile pair instead of 5), but there are no dQ
// accumulators (no workspace beyond D, no memset, no reduction), no global atomics and no
// shared-memory round trip of dS, every output element is written once by one thread (deterministic by
// construction, whatever the launch), and both grids have one block per 16 * NW * MT rows, which keeps
// the GPU evenly loaded without split tuning.

// =====================================================================================================
// dK, dV: grid (B*H, ceil(T / BN)), NW warps, each warp owning WK = 16 * MT keys, BN = WK * NW keys per
// block; key block 0 first (it sees every query: the most work). The block keeps its K and V tiles in
// shared memory (or, for small head dims, the warps' K and V fragments in registers) and walks the query
// blocks of BM rows from the one holding its first key to the end, double-buffering Q, dO, lse and D:
//   S^T  = K Q^T,  P^T = 2^(S^T * scale * log2e - lse * log2e), 0 where key > query or query >= T
//   dV  += P^T dO
//   dP^T = V dO^T, dS^T = P^T * (dP^T - D)
//   dK  += dS^T Q                (times scale at the end)
// Shared memory: K, V [BN][HD+8]; Q, dO [2][BM][HD+8] bf16; lse, D [2][BM] f32. Rows of sK and sV are
// read only by the warp owning those keys, which also stages its dK and dV there at the end.
template <int HD, int NW, int MT, int BM>
__device__ __forceinline__ void attn_bwd_dkdv(const u16* __restrict__ qkv, const u16* __restrict__ dout,
                                              const float* __restrict__ lse, const float* __restrict__ dvec,
                                              u16* __restrict__ dqkv, int T, int H, int KV, float scale,
                                              float scale_log2) {
    constexpr int WK = 16 * MT, BN = WK * NW, S = HD + 8, NT = 32 * NW;
    // K and V fragments in registers when they are small (16 registers per 16 x 64 tile each).
    constexpr bool KV_REGS = MT * HD <= 64;
    u16* sK = reinterpret_cast<u16*>(att_smem);
    u16* sV = sK + BN * S;
    u16* sQ = sV + BN * S;       // [2][BM][S]
    u16* sdO = sQ + 2 * BM * S;  // [2][BM][S]
    float* sL = reinterpret_cast<float*>(sdO + 2 * BM * S);  // [2][BM]
    float* sD = sL + 2 * BM;                                 // [2][BM]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, q = lane & 3;
    const int bkv = blockIdx.x, b = bkv / KV, kvh = bkv - (bkv / KV) * KV;  // (batch, key/value head)
    const int G = H / KV;  // query heads kvh * G .. kvh * G + G - 1 read this key/value head
    const u64 rs = (u64)(H + 2 * KV) * HD, ors = (u64)H * HD;
    const u16* gK = qkv + (u64)b * T * rs + (u64)(H + kvh) * HD;
    const u16* gV = gK + (u64)KV * HD;
    u16* gdK = dqkv + (u64)b * T * rs + (u64)(H + kvh) * HD;
    u16* gdV = gdK + (u64)KV * HD;
    const int nqb = (T + BM - 1) / BM;
    const int k0 = blockIdx.y * BN;
    const int i0 = k0 / BM;          // the first query block holding a query >= k0
    const int kw = k0 + warp * WK;   // the warp's first key; keys kw + 16 m + g (+ 8)
    const bool active = kw < T;      // a warp of the last block may hold no valid key

    att_load_tile<HD, BN, NT>(sK, gK, rs, k0, T, tid);  // committed with the first head's tiles
    att_load_tile<HD, BN, NT>(sV, gV, rs, k0, T, tid);

    float dk[MT][HD / 8][4], dv[MT][HD / 8][4];
    att_zero_mt<MT, HD / 8>(dk);
    att_zero_mt<MT, HD / 8>(dv);
    u32 kf[KV_REGS ? MT : 1][KV_REGS ? HD / 16 : 1][4], vf[KV_REGS ? MT : 1][KV_REGS ? HD / 16 : 1][4];

    // The group's query heads in increasing order, all adding into dk and dv: the group sum of
    // grouped-query attention, in a fixed order (the same bits on every run).
    for (int hg = 0; hg < G; ++hg) {
        const int h = kvh * G + hg, bh = b * H + h;
        const u16* gQ = qkv + (u64)b * T * rs + (u64)h * HD;
        const u16* gdO = dout + (u64)b * T * ors + (u64)h * HD;
        const float* gL = lse + (u64)bh * T;
        const float* gD = dvec + (u64)bh * T;
        if (hg > 0) __syncthreads();  // every warp is done with the previous head's tiles (warps may skip)
        att_load_tile<HD, BM, NT>(sQ, gQ, rs, i0 * BM, T, tid);
        att_load_tile<HD, BM, NT>(sdO, gdO, ors, i0 * BM, T, tid);
        att_load_vec<BM, NT>(sL, gL, i0 * BM, T, tid);
        att_load_vec<BM, NT>(sD, gD, i0 * BM, T, tid);
        att_cp_commit();

        for (int i = i0; i < nqb; ++i) {
            const int buf = (i - i0) & 1;
            att_cp_wait<0>();
            __syncthreads();  // block i is in buffer `buf` for every thread; every warp is done with block i-1
            if (i + 1 < nqb) {
                const int nb = buf ^ 1;
                att_load_tile<HD, BM, NT>(sQ + nb * BM * S, gQ, rs, (i + 1) * BM, T, tid);
                att_load_tile<HD, BM, NT>(sdO + nb * BM * S, gdO, ors, (i + 1) * BM, T, tid);
                att_load_vec<BM, NT>(sL + nb * BM, gL, (i + 1) * BM, T, tid);
                att_load_vec<BM, NT>(sD + nb * BM, gD, (i + 1) * BM, T, tid);
                att_cp_commit();
            }
            if constexpr (KV_REGS) {
                if (hg == 0 && i == i0) {
                    att_load_a_mt<HD, MT>(kf, sK, warp * WK, lane);
                    att_load_a_mt<HD, MT>(vf, sV, warp * WK, lane);
                }
            }
            const int q0 = i * BM;
            if (!active || kw > q0 + BM - 1) continue;  // every query of the block is before the warp's keys
            const u16* cQ = sQ + buf * BM * S;
            const u16* cdO = sdO + buf * BM * S;
            const float* cL = sL + buf * BM;
            const float* cD = sD + buf * BM;

            // P^T
            float pt[MT][BM / 8][4];
            att_zero_mt<MT, BM / 8>(pt);
            if constexpr (KV_REGS)
                att_warp_abt_mt_ra<HD, BM, MT>(pt, kf, cQ, lane);
            else
                att_warp_abt_mt<HD, BM, MT>(pt, sK, warp * WK, cQ, lane);
#pragma unroll
            for (int nt = 0; nt < BM / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float ml = cL[nt * 8 + 2 * q + e] * ATT_LOG2E;
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                        for (int hr = 0; hr < 2; ++hr)
                            pt[mt][nt][2 * hr + e] = att_ex2(__fmaf_rn(pt[mt][nt][2 * hr + e], scale_log2, -ml));
                }
            // The causal mask and the rows past T, in a separate warp-uniform branch: inline, the compiler
            // evaluates the conditions on every tile.
            if ((q0 < kw + WK - 1) || (q0 + BM > T)) {
#pragma unroll
                for (int nt = 0; nt < BM / 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int query = q0 + nt * 8 + 2 * q + e;
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                            for (int hr = 0; hr < 2; ++hr)
                                if (kw + 16 * mt + g + 8 * hr > query || query >= T) pt[mt][nt][2 * hr + e] = 0.0f;
                    }
            }

            // dV += P^T dO
            att_warp_pb_mt<BM, HD, S, MT>(dv, pt, cdO, 0, lane);

            // dS^T = P^T * (V dO^T - D)
            float ds[MT][BM / 8][4];
            att_zero_mt<MT, BM / 8>(ds);
            if constexpr (KV_REGS)
                att_warp_abt_mt_ra<HD, BM, MT>(ds, vf, cdO, lane);
            else
                att_warp_abt_mt<HD, BM, MT>(ds, sV, warp * WK, cdO, lane);
#pragma unroll
            for (int nt = 0; nt < BM / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float dd = cD[nt * 8 + 2 * q + e];
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        ds[mt][nt][e] = pt[mt][nt][e] * (ds[mt][nt][e] - dd);
                        ds[mt][nt][2 + e] = pt[mt][nt][2 + e] * (ds[mt][nt][2 + e] - dd);
                    }
                }

            // dK += dS^T Q
            att_warp_pb_mt<BM, HD, S, MT>(dk, ds, cQ, 0, lane);
        }
    }  // query heads of the group

    // dK (times scale) and dV to dqkv, staged through the warp's own rows of sK / sV.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        att_store_c_bf16<HD, S>(sK, warp * WK + 16 * mt, dk[mt], scale, lane);
        att_store_c_bf16<HD, S>(sV, warp * WK + 16 * mt, dv[mt], 1.0f, lane);
    }
    __syncwarp();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        att_warp_store_rows<HD>(gdK, rs, sK, warp * WK + 16 * mt, kw + 16 * mt, T, lane);
        att_warp_store_rows<HD>(gdV, rs, sV, warp * WK + 16 * mt, kw + 16 * mt, T, lane);
    }
}

// =====================================================================================================
// dK, dV with warp pairs: grid (B*H, ceil(T / BN)), NW = 2 * NP warps; pair p owns the 32 keys
// kp = k0 + 32 p .. kp + 31 (two 16-key tiles per warp), BN = 32 * NP keys per block; key block 0 first.
// The pair splits the four products: warp 0 of the pair computes P^T = exp(K Q^T ...) (masked), hands
// it to its partner through shared memory (F32, in the C-fragment layout both warps share, so lane l
// reads what lane l wrote) and accumulates dV += P^T dO; warp 1 computes dP^T = V dO^T, takes P^T, forms
// dS^T = P^T (dP^T - D) and accumulates dK += dS^T Q. A warp so holds one 32-key accumulator (what two
// 16-key tiles of dK and dV take in the one-warp kernel) and each B fragment it loads feeds four mma
// instead of two: about 80 ldmatrix.x4 per 256 mma against 144 (the limit of the one-warp kernel at
// HD = 128, where its four 16-key products read 74 KB of shared memory per 64 x 64 tile pair and warp).
// Per query block: one block barrier (buffers, as above) and one pair barrier (bar.arrive by warp 0
// after its P^T store, bar.sync by warp 1 before its load; the next block barrier keeps warp 0 from
// overwriting P^T before warp 1 has read it).
// Shared memory: K, V [BN][HD+8]; Q, dO [2][BM][HD+8] bf16; lse, D [2][BM] f32; P^T [NP][16 BM] f32.
// The named barrier 1 + pair over the pair's 64 threads: bar.sync (`wait`) or bar.arrive. The ids are
// literals (a switch), so ptxas reserves NP + 1 barriers instead of all 16.
template <int NP, bool wait>
__device__ __forceinline__ void att_pair_barrier(int pair) {
    static_assert(NP >= 1 && NP <= 4, "pair barriers 1..4");
#pragma unroll
    for (int p = 0; p < NP; ++p)
        if (pair == p) {
            if (wait)
                att_bar_sync(1 + p, 64);
            else
                att_bar_arrive(1 + p, 64);
        }
}

template <int HD, int NP, int BM>
__device__ __forceinline__ void attn_bwd_dkdv_pairs(const u16* __restrict__ qkv, const u16* __restrict__ dout,
                                                    const float* __restrict__ lse,
                                                    const float* __restrict__ dvec, u16* __restrict__ dqkv,
                                                    int T, int H, int KV, float scale, float scale_log2) {
    constexpr int MT = 2, WK = 16 * MT, BN = WK * NP, NW = 2 * NP, S = HD + 8, NT = 32 * NW;
    constexpr int XC = MT * BM / 8;  // float4 chunks of P^T per lane
    u16* sK = reinterpret_cast<u16*>(att_smem);
    u16* sV = sK + BN * S;
    u16* sQ = sV + BN * S;       // [2][BM][S]
    u16* sdO = sQ + 2 * BM * S;  // [2][BM][S]
    float* sL = reinterpret_cast<float*>(sdO + 2 * BM * S);  // [2][BM]
    float* sD = sL + 2 * BM;                                 // [2][BM]
    float4* sX = reinterpret_cast<float4*>(sD + 2 * BM);     // [NP][XC][32]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, q = lane & 3;
    const int pair = warp >> 1, role = warp & 1;
    const int bkv = blockIdx.x, b = bkv / KV, kvh = bkv - (bkv / KV) * KV;  // (batch, key/value head)
    const int G = H / KV;  // query heads kvh * G .. kvh * G + G - 1 read this key/value head
    const u64 rs = (u64)(H + 2 * KV) * HD, ors = (u64)H * HD;
    const u16* gK = qkv + (u64)b * T * rs + (u64)(H + kvh) * HD;
    const u16* gV = gK + (u64)KV * HD;
    u16* gdK = dqkv + (u64)b * T * rs + (u64)(H + kvh) * HD;
    u16* gdV = gdK + (u64)KV * HD;
    const int nqb = (T + BM - 1) / BM;
    const int k0 = blockIdx.y * BN;
    const int i0 = k0 / BM;
    const int kp = k0 + pair * WK;  // the pair's first key; keys kp + 16 m + g (+ 8)
    const bool active = kp < T;
    float4* xp = sX + pair * XC * 32 + lane;

    att_load_tile<HD, BN, NT>(sK, gK, rs, k0, T, tid);  // committed with the first head's tiles
    att_load_tile<HD, BN, NT>(sV, gV, rs, k0, T, tid);

    float acc[MT][HD / 8][4];  // dV (warp 0 of the pair) or dK / scale (warp 1), summed over the group
    att_zero_mt<MT, HD / 8>(acc);

    // The group's query heads in increasing order (the group sum in a fixed order, as above); the
    // pointers step to the next head at the end of each (fewer live registers than recomputing them).
    const u16* gQ = qkv + (u64)b * T * rs + (u64)kvh * G * HD;
    const u16* gdO = dout + (u64)b * T * ors + (u64)kvh * G * HD;
    const float* gL = lse + ((u64)b * H + (u64)kvh * G) * T;
    const float* gD = dvec + ((u64)b * H + (u64)kvh * G) * T;
#pragma unroll 1
    for (int hg = 0; hg < G; ++hg, gQ += HD, gdO += HD, gL += T, gD += T) {
        // Every warp is done with the previous head's tiles, and warp 1 of each pair with its P^T.
        if (hg > 0) __syncthreads();
        att_load_tile<HD, BM, NT>(sQ, gQ, rs, i0 * BM, T, tid);
        att_load_tile<HD, BM, NT>(sdO, gdO, ors, i0 * BM, T, tid);
        att_load_vec<BM, NT>(sL, gL, i0 * BM, T, tid);
        att_load_vec<BM, NT>(sD, gD, i0 * BM, T, tid);
        att_cp_commit();

        for (int i = i0; i < nqb; ++i) {
            const int buf = (i - i0) & 1;
            att_cp_wait<0>();
            __syncthreads();  // block i is in buffer `buf` for every thread; every warp is done with block i-1
            if (i + 1 < nqb) {
                const int nb = buf ^ 1;
                att_load_tile<HD, BM, NT>(sQ + nb * BM * S, gQ, rs, (i + 1) * BM, T, tid);
                att_load_tile<HD, BM, NT>(sdO + nb * BM * S, gdO, ors, (i + 1) * BM, T, tid);
                att_load_vec<BM, NT>(sL + nb * BM, gL, (i + 1) * BM, T, tid);
                att_load_vec<BM, NT>(sD + nb * BM, gD, (i + 1) * BM, T, tid);
                att_cp_commit();
            }
            const int q0 = i * BM;
            // Both warps of a pair take the same branch, so the pair barrier below always has its 64 threads.
            if (!active || kp > q0 + BM - 1) continue;
            const u16* cQ = sQ + buf * BM * S;
            const u16* cdO = sdO + buf * BM * S;
            const float* cL = sL + buf * BM;
            const float* cD = sD + buf * BM;

            float x[MT][BM / 8][4];
            att_zero_mt<MT, BM / 8>(x);
            if (role == 0) {
                // P^T
                att_warp_abt_mt<HD, BM, MT>(x, sK, pair * WK, cQ, lane);
#pragma unroll
                for (int nt = 0; nt < BM / 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float ml = cL[nt * 8 + 2 * q + e] * ATT_LOG2E;
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                            for (int hr = 0; hr < 2; ++hr)
                                x[mt][nt][2 * hr + e] = att_ex2(__fmaf_rn(x[mt][nt][2 * hr + e], scale_log2, -ml));
                    }
                if ((q0 < kp + WK - 1) || (q0 + BM > T)) {  // causal mask and rows past T (see above)
#pragma unroll
                    for (int nt = 0; nt < BM / 8; ++nt)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int query = q0 + nt * 8 + 2 * q + e;
#pragma unroll
                            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                                for (int hr = 0; hr < 2; ++hr)
                                    if (kp + 16 * mt + g + 8 * hr > query || query >= T) x[mt][nt][2 * hr + e] = 0.0f;
                        }
                }
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int nt = 0; nt < BM / 8; ++nt)
                        xp[(mt * (BM / 8) + nt) * 32] = make_float4(x[mt][nt][0], x[mt][nt][1], x[mt][nt][2], x[mt][nt][3]);
                att_pair_barrier<NP, false>(pair);
                // dV += P^T dO
                att_warp_pb_mt<BM, HD, S, MT>(acc, x, cdO, 0, lane);
            } else {
                // dP^T, then dS^T = P^T * (dP^T - D) with P^T from the partner
                att_warp_abt_mt<HD, BM, MT>(x, sV, pair * WK, cdO, lane);
                att_pair_barrier<NP, true>(pair);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int nt = 0; nt < BM / 8; ++nt) {
                        const float4 p = xp[(mt * (BM / 8) + nt) * 32];
                        const float d0 = cD[nt * 8 + 2 * q], d1 = cD[nt * 8 + 2 * q + 1];
                        x[mt][nt][0] = p.x * (x[mt][nt][0] - d0);
                        x[mt][nt][1] = p.y * (x[mt][nt][1] - d1);
                        x[mt][nt][2] = p.z * (x[mt][nt][2] - d0);
                        x[mt][nt][3] = p.w * (x[mt][nt][3] - d1);
                    }
                // dK += dS^T Q
                att_warp_pb_mt<BM, HD, S, MT>(acc, x, cQ, 0, lane);
            }
        }
    }  // query heads of the group

    // dV (warp 0) and dK times scale (warp 1) to dqkv, staged through the pair's rows of sV / sK once
    // every warp is done reading them (warp 1 read the pair's V rows, warp 0 its K rows).
    __syncthreads();
    u16* stage = role == 0 ? sV : sK;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        att_store_c_bf16<HD, S>(stage, pair * WK + 16 * mt, acc[mt], role == 0 ? 1.0f : scale, lane);
    __syncwarp();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        att_warp_store_rows<HD>(role == 0 ? gdV : gdK, rs, stage, pair * WK + 16 * mt, kp + 16 * mt, T, lane);
}

// =====================================================================================================
// dQ: grid (B*H, ceil(T / BM)), NW warps, each warp owning WR = 16 * MT query rows, BM = WR * NW per
// block; the last query block first. The block keeps Q and dO (or, for small head dims, the warps' Q
// and dO fragments in registers) and each thread its rows' lse and D in registers, and streams the key
// and value blocks of BN rows up to its last row, double-buffered:
//   S  = Q K^T,   P = 2^(S * scale * log2e - lse * log2e), 0 where key > query
//   dP = dO V^T,  dS = P * (dP - D)
//   dQ += dS K    (dS straight from the registers as the A operand, as P in the forward)
// and writes dq = scale * dQ as BF16. Shared memory: Q, dO [BM][HD+8]; K, V [2][BN][HD+8] bf16. Rows of
// sQ and sdO are read only by their warp, which stages its dq rows in sQ at the end.
template <int HD, int NW, int MT, int BN>
__device__ __forceinline__ void attn_bwd_dq(const u16* __restrict__ qkv, const u16* __restrict__ dout,
                                            const float* __restrict__ lse, const float* __restrict__ dvec,
                                            u16* __restrict__ dqkv, int T, int H, int KV, float scale,
                                            float scale_log2) {
    constexpr int WR = 16 * MT, BM = WR * NW, S = HD + 8, NT = 32 * NW;
    // The warp's Q and dO fragments stay in registers (MT * HD / 2 of them: a seventh less shared-memory
    // traffic per key block) when dQ, P, dS and they take at most 192 registers per thread (at HD = 128,
    // MT = 1, BN = 64 the kernel then uses all 255 without spilling); more spills (ptxas, sm_90).
    constexpr bool QD_REGS = MT * (HD + BN) <= 192;
    u16* sQ = reinterpret_cast<u16*>(att_smem);
    u16* sdO = sQ + BM * S;
    u16* sK = sdO + BM * S;      // [2][BN][S]
    u16* sV = sK + 2 * BN * S;   // [2][BN][S]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, q = lane & 3;
    const int bh = blockIdx.x, b = bh / H, h = bh - (bh / H) * H;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BM;
    const u64 rs = (u64)(H + 2 * KV) * HD, ors = (u64)H * HD;
    const int kvh = h / (H / KV);  // the key/value head of query head h
    const u16* gQ = qkv + (u64)b * T * rs + (u64)h * HD;
    const u16* gK = qkv + (u64)b * T * rs + (u64)(H + kvh) * HD;
    const u16* gV = gK + (u64)KV * HD;
    const u16* gdO = dout + (u64)b * T * ors + (u64)h * HD;
    const int q_end = min(q0 + BM, T);
    const int nkb = (q_end - 1) / BN + 1;
    const int w0 = q0 + warp * WR;
    const bool active = w0 < T;

    att_load_tile<HD, BM, NT>(sQ, gQ, rs, q0, T, tid);
    att_load_tile<HD, BM, NT>(sdO, gdO, ors, q0, T, tid);
    att_load_tile<HD, BN, NT>(sK, gK, rs, 0, T, tid);
    att_load_tile<HD, BN, NT>(sV, gV, rs, 0, T, tid);
    att_cp_commit();

    // This thread's rows' lse (log2 domain) and D; rows >= T get lse = +inf, so P = 0 there.
    float ml[MT][2], dd[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int row = w0 + 16 * mt + g + 8 * hr;
            const bool ok = row < T;
            ml[mt][hr] = ok ? lse[(u64)bh * T + row] * ATT_LOG2E : -ATT_NEG_INF;
            dd[mt][hr] = ok ? dvec[(u64)bh * T + row] : 0.0f;
        }

    float dq[MT][HD / 8][4];
    att_zero_mt<MT, HD / 8>(dq);
    u32 qf[QD_REGS ? MT : 1][QD_REGS ? HD / 16 : 1][4], of[QD_REGS ? MT : 1][QD_REGS ? HD / 16 : 1][4];

    for (int j = 0; j < nkb; ++j) {
        const int buf = j & 1;
        att_cp_wait<0>();
        __syncthreads();  // block j is in buffer `buf` for every thread; every warp is done with block j-1
        if (j + 1 < nkb) {
            att_load_tile<HD, BN, NT>(sK + (buf ^ 1) * BN * S, gK, rs, (j + 1) * BN, T, tid);
            att_load_tile<HD, BN, NT>(sV + (buf ^ 1) * BN * S, gV, rs, (j + 1) * BN, T, tid);
            att_cp_commit();
        }
        if constexpr (QD_REGS) {
            if (j == 0) {
                att_load_a_mt<HD, MT>(qf, sQ, warp * WR, lane);
                att_load_a_mt<HD, MT>(of, sdO, warp * WR, lane);
            }
        }
        const int k0 = j * BN;
        if (!active || k0 > w0 + WR - 1) continue;  // every key of the block is after the warp's rows
        const u16* cK = sK + buf * BN * S;
        const u16* cV = sV + buf * BN * S;

        float p[MT][BN / 8][4];
        att_zero_mt<MT, BN / 8>(p);
        if constexpr (QD_REGS)
            att_warp_abt_mt_ra<HD, BN, MT>(p, qf, cK, lane);
        else
            att_warp_abt_mt<HD, BN, MT>(p, sQ, warp * WR, cK, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
                for (int hr = 0; hr < 2; ++hr)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        p[mt][nt][2 * hr + e] = att_ex2(__fmaf_rn(p[mt][nt][2 * hr + e], scale_log2, -ml[mt][hr]));
        if (k0 + BN - 1 > w0) {  // the causal mask, in a warp-uniform branch (see the dK/dV kernel)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int key = k0 + nt * 8 + 2 * q + e, row = w0 + 16 * mt + g;
                        if (key > row) p[mt][nt][e] = 0.0f;
                        if (key > row + 8) p[mt][nt][2 + e] = 0.0f;
                    }
        }

        float ds[MT][BN / 8][4];
        att_zero_mt<MT, BN / 8>(ds);
        if constexpr (QD_REGS)
            att_warp_abt_mt_ra<HD, BN, MT>(ds, of, cV, lane);
        else
            att_warp_abt_mt<HD, BN, MT>(ds, sdO, warp * WR, cV, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
                for (int hr = 0; hr < 2; ++hr)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        ds[mt][nt][2 * hr + e] = p[mt][nt][2 * hr + e] * (ds[mt][nt][2 * hr + e] - dd[mt][hr]);

        // dQ += dS K: K [BN keys][HD] is the B operand [k = key][n = d], as V in the forward's P V.
        att_warp_pb_mt<BN, HD, S, MT>(dq, ds, cK, 0, lane);
    }

    // dq = scale * dQ, staged through the warp's own rows of sQ.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) att_store_c_bf16<HD, S>(sQ, warp * WR + 16 * mt, dq[mt], scale, lane);
    __syncwarp();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        att_warp_store_rows<HD>(dqkv + (u64)b * T * rs + (u64)h * HD, rs, sQ, warp * WR + 16 * mt, w0 + 16 * mt,
                                T, lane);
}

// =====================================================================================================
// Entry points: attn_bwd_dkdv_w<NW>m<MT>q<BM>_hd<HD> (NW warps of 16 * MT keys, query blocks of BM) and
// attn_bwd_dq_w<NW>m<MT>n<BN>_hd<HD> (NW warps of 16 * MT query rows, key blocks of BN). Register
// budgets (F32 accumulators per thread: dK + dV = 2 * MT * HD / 2 + P^T and dS^T = 2 * MT * BM / 2; dQ =
// MT * HD / 2 + P and dS = 2 * MT * BN / 2) keep every variant under 255 registers without spills.
// =====================================================================================================
#define ATT_DKDV_VARIANTS_32(X) X(32, 4, 1, 64) X(32, 8, 1, 64) X(32, 4, 2, 64) X(32, 4, 2, 32)
#define ATT_DKDV_VARIANTS_64(X) X(64, 4, 1, 64) X(64, 8, 1, 64) X(64, 4, 1, 32) X(64, 4, 2, 32)
#define ATT_DKDV_VARIANTS_128(X) X(128, 4, 1, 64) X(128, 8, 1, 64) X(128, 4, 1, 32) X(128, 8, 1, 32)
#define ATT_DQ_VARIANTS_32(X) X(32, 4, 1, 64) X(32, 8, 1, 64) X(32, 4, 2, 64) X(32, 4, 1, 128)
#define ATT_DQ_VARIANTS_64(X) X(64, 4, 1, 64) X(64, 8, 1, 64) X(64, 4, 2, 64) X(64, 4, 1, 128)
#define ATT_DQ_VARIANTS_128(X) X(128, 4, 1, 64) X(128, 8, 1, 64) X(128, 4, 1, 128) X(128, 8, 1, 128)

// Warp-pair dK/dV variants (HD, NP pairs, BM): attn_bwd_dkdv_p<NP>q<BM>_hd<HD>, 2 * NP warps.
#define ATT_DKDV_PAIR_VARIANTS_32(X) X(32, 4, 64) X(32, 2, 64)
#define ATT_DKDV_PAIR_VARIANTS_64(X) X(64, 4, 64) X(64, 2, 64)
#define ATT_DKDV_PAIR_VARIANTS_128(X) X(128, 4, 64) X(128, 2, 32) X(128, 4, 32)
#define ATT_DKDV_PAIR_ENTRY(HD, NP, BM)                                                                        \
    extern "C" __global__ void __launch_bounds__(64 * NP) attn_bwd_dkdv_p##NP##q##BM##_hd##HD(                 \
        const u16* qkv, const u16* dout, const float* lse, const float* dvec, u16* dqkv, int T, int H,         \
        int KV, float scale, float scale_log2) {                                                               \
        attn_bwd_dkdv_pairs<HD, NP, BM>(qkv, dout, lse, dvec, dqkv, T, H, KV, scale, scale_log2);                      \
    }

#define ATT_DKDV_ENTRY(HD, NW, MT, BM)                                                                         \
    extern "C" __global__ void __launch_bounds__(32 * NW) attn_bwd_dkdv_w##NW##m##MT##q##BM##_hd##HD(         \
        const u16* qkv, const u16* dout, const float* lse, const float* dvec, u16* dqkv, int T, int H,         \
        int KV, float scale, float scale_log2) {                                                               \
        attn_bwd_dkdv<HD, NW, MT, BM>(qkv, dout, lse, dvec, dqkv, T, H, KV, scale, scale_log2);                        \
    }
#define ATT_DQ_ENTRY(HD, NW, MT, BN)                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * NW) attn_bwd_dq_w##NW##m##MT##n##BN##_hd##HD(           \
        const u16* qkv, const u16* dout, const float* lse, const float* dvec, u16* dqkv, int T, int H,         \
        int KV, float scale, float scale_log2) {                                                               \
        attn_bwd_dq<HD, NW, MT, BN>(qkv, dout, lse, dvec, dqkv, T, H, KV, scale, scale_log2);                          \
    }

#if defined(ATT_ONLY_KIND)
#if ATT_ONLY_KIND == 3
ATT_APPLY4(ATT_DKDV_ENTRY, ATT_HD, ATT_ONLY_A, ATT_ONLY_B, ATT_ONLY_C)
#elif ATT_ONLY_KIND == 4
ATT_APPLY3(ATT_DKDV_PAIR_ENTRY, ATT_HD, ATT_ONLY_A, ATT_ONLY_B)
#elif ATT_ONLY_KIND == 5
ATT_APPLY4(ATT_DQ_ENTRY, ATT_HD, ATT_ONLY_A, ATT_ONLY_B, ATT_ONLY_C)
#endif
#elif ATT_WANT(ATT_FAM_SEPARATE)
ATT_FOR_VARIANTS(ATT_DKDV_VARIANTS_, ATT_DKDV_ENTRY)
ATT_FOR_VARIANTS(ATT_DKDV_PAIR_VARIANTS_, ATT_DKDV_PAIR_ENTRY)
ATT_FOR_VARIANTS(ATT_DQ_VARIANTS_, ATT_DQ_ENTRY)
#endif
