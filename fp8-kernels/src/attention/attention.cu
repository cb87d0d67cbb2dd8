// Causal flash attention, forward and backward, BF16 in and out, F32 accumulation. Prepended with
// common.cuh (u16/u32/u64 typedefs, bf16 conversions) and attention_mma.cuh. Compiled by NVRTC with the crate's precise options
// (--fmad=false, no fast math): the fast kernels therefore spell out their fused multiply-adds (__fmaf_rn)
// and exponentials (ex2.approx) where they want them.
//
// Layouts (row-major, element offsets):
//   qkv  [B, T, H + 2*KV, HD] bf16: KV key/value heads serve the H query heads (KV divides H; query head h
//        reads key/value head h / (H/KV), grouped-query attention; KV = H is multi-head attention);
//        q(b,t,h,d) at ((b*T + t)*(H + 2*KV) + h)*HD + d, k(b,t,j,d) at ((b*T + t)*(H + 2*KV) + H + j)*HD + d,
//        v(b,t,j,d) at ((b*T + t)*(H + 2*KV) + H + KV + j)*HD + d
//   out  [B, T, H, HD]    bf16: ((b*T + t)*H + h)*HD + d              (also dout)
//   lse  [B, H, T]        f32:  (b*H + h)*T + t, natural-log log-sum-exp of the scaled scores of row t
//   dqkv [B, T, H + 2*KV, HD] bf16, as qkv; dk and dv of head j sum over its group's query heads
//   D    [B, H, T]        f32:  rowsum(dout * out) (backward workspace)
//   dq_acc [nbuf][B, T, H, HD] f32: dQ / scale accumulated by the backward (workspace)
//
// Two families of kernels:
//   attn_fwd_w*, attn_bwd_fused_*: FlashAttention-2 style tiles on tensor cores (mma.sync m16n8k16 bf16,
//               ldmatrix, cp.async).
//   *_simple_*: one block per row, plain f32 dot products, no tensor cores, no shared tiles beyond one row.
//               Obviously correct and slow: the fallback that separates a fragment-layout bug in the mma
//               kernels from a problem elsewhere (launch, layout of the buffers, the host code).
// And the probe kernels at the end, which run one building block of the mma kernels on one tile so a test
// can check each fragment mapping in isolation.
//
// The PTX wrappers, tile loaders and fragment helpers are in attention_mma.cuh (prepended); the separate
// backward (dK/dV and dQ kernels) is in attention_separate.cu (appended).

// =====================================================================================================
// Forward (tensor cores)
// =====================================================================================================
// Grid (B*H, ceil(T / BM)); block NW warps; each warp owns WR = 16 * MT query rows, BM = WR * NW per
// block; the last query block first (blockIdx.y = 0 is the most work under the causal mask, so it is
// scheduled first). Key and value blocks of BN rows are double-buffered through shared memory with
// cp.async: iteration j waits for block j, passes one barrier (after which every warp is done with
// block j-1, so its buffers can take block j+1) and issues the copy of block j+1, which then overlaps
// the products of block j.
// Thread (lane, g = lane/4, q = lane%4) holds rows g and g+8 of each of its warp's row tiles m:
// S[m][nt][0,1] / O[m][dt][0,1] for row g, [2,3] for row g+8; the row max and sum are reduced over the
// 4 lanes of a quad (xor 1, 2). Scores are kept in the log2 domain: x = s * scale * log2(e),
// p = 2^(x - m). A warp skips key blocks that lie entirely after its last row (all masked).
// Shared memory: Q [BM][HD+8], K [2][BN][HD+8], V [2][BN][HD+8] bf16. Rows of sQ are read only by the
// warp that owns them, which also stages its output there at the end.
template <int HD, int NW, int MT, int BN>
__device__ __forceinline__ void attn_fwd_mma(const u16* __restrict__ qkv, u16* __restrict__ out,
                                             float* __restrict__ lse, int T, int H, int KV, float scale_log2) {
    constexpr int WR = 16 * MT, BM = WR * NW, S = HD + 8, NT = 32 * NW;
    // The warp's Q fragments stay in registers (MT * HD / 4 of them: an eighth less shared-memory traffic
    // per key block) when O, S and they take at most 160 registers per thread; more spills (ptxas, sm_90).
    constexpr bool Q_REGS = MT * (HD / 2 + BN / 2 + HD / 4) <= 160;
    u16* sQ = reinterpret_cast<u16*>(att_smem);
    u16* sK = sQ + BM * S;
    u16* sV = sK + 2 * BN * S;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, q = lane & 3;
    const int bh = blockIdx.x, b = bh / H, h = bh - (bh / H) * H;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BM;
    const u64 rs = (u64)(H + 2 * KV) * HD;  // qkv row stride
    const int kvh = h / (H / KV);           // the key/value head of query head h
    const u16* gQ = qkv + (u64)b * T * rs + (u64)h * HD;
    const u16* gK = qkv + (u64)b * T * rs + (u64)(H + kvh) * HD;
    const u16* gV = gK + (u64)KV * HD;
    // Keys 0 .. q_end-1 are all any valid row of this block can see.
    const int q_end = min(q0 + BM, T);
    const int nkb = (q_end - 1) / BN + 1;
    const int w0 = q0 + warp * WR;  // the warp's first query row; rows w0 + 16 m + g (+ 8)
    const bool active = w0 < T;     // a warp of the last block may hold no valid row

    att_load_tile<HD, BM, NT>(sQ, gQ, rs, q0, T, tid);
    att_load_tile<HD, BN, NT>(sK, gK, rs, 0, T, tid);
    att_load_tile<HD, BN, NT>(sV, gV, rs, 0, T, tid);
    att_cp_commit();

    float o[MT][HD / 8][4];
    att_zero_mt<MT, HD / 8>(o);
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = ATT_NEG_INF, l[mt][0] = l[mt][1] = 0.0f;
    u32 qf[Q_REGS ? MT : 1][Q_REGS ? HD / 16 : 1][4];

    for (int j = 0; j < nkb; ++j) {
        const int buf = j & 1;
        att_cp_wait<0>();
        __syncthreads();  // block j is in buffer `buf` for every thread; every warp is done with block j-1
        if (j + 1 < nkb) {
            att_load_tile<HD, BN, NT>(sK + (buf ^ 1) * BN * S, gK, rs, (j + 1) * BN, T, tid);
            att_load_tile<HD, BN, NT>(sV + (buf ^ 1) * BN * S, gV, rs, (j + 1) * BN, T, tid);
            att_cp_commit();
        }
        if constexpr (Q_REGS) {
            if (j == 0) att_load_a_mt<HD, MT>(qf, sQ, warp * WR, lane);
        }
        const int k0 = j * BN;
        if (!active || k0 > w0 + WR - 1) continue;  // no barrier below: warps may skip
        const u16* cK = sK + buf * BN * S;
        const u16* cV = sV + buf * BN * S;

        float s[MT][BN / 8][4];
        att_zero_mt<MT, BN / 8>(s);
        if constexpr (Q_REGS)
            att_warp_abt_mt_ra<HD, BN, MT>(s, qf, cK, lane);
        else
            att_warp_abt_mt<HD, BN, MT>(s, sQ, warp * WR, cK, lane);

        if (k0 + BN - 1 > w0) {  // the block reaches past some row of this warp: causal mask
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int key = k0 + nt * 8 + 2 * q + e, row = w0 + 16 * mt + g;
                        if (key > row) s[mt][nt][e] = ATT_NEG_INF;
                        if (key > row + 8) s[mt][nt][2 + e] = ATT_NEG_INF;
                    }
        }

        // Online softmax. Every row sees key 0 in block 0, so m is finite from the first block on; the
        // guard only keeps a fully masked row (impossible here) from producing inf - inf.
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                float mx = ATT_NEG_INF;
#pragma unroll
                for (int nt = 0; nt < BN / 8; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hr], s[mt][nt][2 * hr + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_new = fmaxf(m[mt][hr], mx * scale_log2);
                const float mb = m_new == ATT_NEG_INF ? 0.0f : m_new;
                const float alpha = att_ex2(m[mt][hr] - mb);
                m[mt][hr] = m_new;
                float rsum = 0.0f;
#pragma unroll
                for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float p = att_ex2(__fmaf_rn(s[mt][nt][2 * hr + e], scale_log2, -mb));
                        s[mt][nt][2 * hr + e] = p;
                        rsum += p;
                    }
                l[mt][hr] = __fmaf_rn(l[mt][hr], alpha, rsum);
#pragma unroll
                for (int dt = 0; dt < HD / 8; ++dt) {
                    o[mt][dt][2 * hr] *= alpha;
                    o[mt][dt][2 * hr + 1] *= alpha;
                }
            }

        att_warp_pb_mt<BN, HD, S, MT>(o, s, cV, 0, lane);
    }

    // Normalise; lse in natural log: (m + log2 l) * ln 2. (A warp without valid rows computes garbage
    // here and stores none of it.)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            float lt = l[mt][hr];
            lt += __shfl_xor_sync(0xffffffffu, lt, 1);
            lt += __shfl_xor_sync(0xffffffffu, lt, 2);
            const float inv = 1.0f / lt;
#pragma unroll
            for (int dt = 0; dt < HD / 8; ++dt) {
                o[mt][dt][2 * hr] *= inv;
                o[mt][dt][2 * hr + 1] *= inv;
            }
            const int row = w0 + 16 * mt + g + 8 * hr;
            if (q == 0 && row < T) lse[(u64)bh * T + row] = (m[mt][hr] + log2f(lt)) * ATT_LN2;
        }
        // Stage the tile's 16 rows of O in the warp's own rows of sQ (only this warp ever read them),
        // then write them out with 16-byte stores.
        att_store_c_bf16<HD, S>(sQ, warp * WR + 16 * mt, o[mt], 1.0f, lane);
    }
    __syncwarp();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        att_warp_store_rows<HD>(out + (u64)b * T * H * HD + (u64)h * HD, (u64)H * HD, sQ, warp * WR + 16 * mt,
                                w0 + 16 * mt, T, lane);
}

// =====================================================================================================
// Backward (tensor cores)
// =====================================================================================================
// Grid (B*KV, nsplit), one block row per (batch, key/value head); 4 warps; each block processes key
// blocks of BN = 64 rows (warp w owns keys 16w..16w+15), taking key block j = r*nsplit + (r even ? split
// : nsplit-1-split) for r = 0, 1, ... (a snake order that evens out the causal work between splits). For
// one key block it loops over the query heads of its group (H / KV of them, in increasing order) and for
// each over the query blocks of BM rows from the diagonal on, double-buffering Q, dO, lse and D with
// cp.async, and keeps dK and dV, summed over the group, in registers:
//   S^T  = K Q^T         (16 keys x BM queries per warp)
//   P^T  = 2^(S^T * scale * log2e - lse * log2e), 0 where key > query or query >= T
//   dV  += P^T dO
//   dP^T = V dO^T
//   dS^T = P^T * (dP^T - D)
//   dK  += dS^T Q                      (times scale at the end)
//   dS^T -> shared (bf16); dQ(BM x HD) += dS K, added into dq_acc with vector reductions (dQ / scale).
// dq_acc + split * dq_split_stride is this block's accumulator. Deterministic mode gives every split its
// own buffer (dq_split_stride = B*T*H*HD): each address (a query head belongs to one key/value head's
// group, so to one block row) is then updated by one thread of one block only,
// in program order, so the sums are the same bits on every run. Atomic mode passes stride 0 and nsplit =
// number of key blocks: all blocks of a head add into one buffer, in a varying order.
// Shared memory: K, V [BN][HD+8]; Q, dO [2][BM][HD+8]; dS^T [BN][BM+8] bf16; lse, D [2][BM] f32.
template <int HD, int BM>
__device__ __forceinline__ void attn_bwd_mma(const u16* __restrict__ qkv, const u16* __restrict__ dout,
                                             const float* __restrict__ lse, const float* __restrict__ dvec,
                                             float* __restrict__ dq_acc, u64 dq_split_stride,
                                             u16* __restrict__ dqkv, int T, int H, int KV, float scale,
                                             float scale_log2) {
    constexpr int BN = 64, S = HD + 8, SD = BM + 8, NT = 128;
    constexpr int RG = BM / 16, DG = 4 / RG, DW = HD / DG;  // dQ step: row groups x column groups of warps
    static_assert(BM == 32 || BM == 64, "BM must be 32 or 64");
    u16* sK = reinterpret_cast<u16*>(att_smem);
    u16* sV = sK + BN * S;
    u16* sQ = sV + BN * S;       // [2][BM][S]
    u16* sdO = sQ + 2 * BM * S;  // [2][BM][S]
    u16* sdS = sdO + 2 * BM * S; // [BN][SD]
    float* sL = reinterpret_cast<float*>(sdS + BN * SD);  // [2][BM]
    float* sD = sL + 2 * BM;                             // [2][BM]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, q = lane & 3;
    const int bkv = blockIdx.x, b = bkv / KV, kvh = bkv - (bkv / KV) * KV;  // (batch, key/value head)
    const int G = H / KV;  // query heads kvh * G .. kvh * G + G - 1 read this key/value head
    const int split = blockIdx.y, nsplit = gridDim.y;
    const u64 rs = (u64)(H + 2 * KV) * HD, ors = (u64)H * HD;
    // k and v of this key/value head (and dk, dv) at qkv (dqkv) + kv_off and + kv_off + KV * HD: an
    // offset from the parameters, where four pointers would stay live in registers.
    const u64 kv_off = (u64)b * T * rs + (u64)(H + kvh) * HD;
    const int nkb = (T + BN - 1) / BN, nqb = (T + BM - 1) / BM;
    // Q, dO, lse, D and the dQ accumulator of the group's first query head.
    // Offsets of the current query head in qkv, in dout (and the dQ accumulator) and in lse (and D): three
    // offsets from the parameters, where five pointers would stay live in registers.
    u64 q_off = (u64)b * T * rs + (u64)kvh * G * HD, o_off = (u64)b * T * ors + (u64)kvh * G * HD;
    u64 l_off = ((u64)b * H + (u64)kvh * G) * T;

    for (int round = 0;; ++round) {
        const int j = round * nsplit + ((round & 1) ? nsplit - 1 - split : split);
        if (j >= nkb) break;  // j grows with the round
        const int k0 = j * BN;
        const int i0 = k0 / BM;  // first query block holding a query >= k0 (BM divides BN)

        att_load_tile<HD, BN, NT>(sK, qkv + kv_off, rs, k0, T, tid);  // committed with the first head's tiles
        att_load_tile<HD, BN, NT>(sV, qkv + kv_off + (u64)KV * HD, rs, k0, T, tid);

        float dk[HD / 8][4], dv[HD / 8][4];
#pragma unroll
        for (int i = 0; i < HD / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.0f;
        const int key_a = k0 + warp * 16 + g;  // key of rows [.][0,1] of the S^T fragments; +8 for [2,3]

        // The group's query heads in increasing order, each over the query blocks i0 .. nqb-1, as one
        // pipeline of G * (nqb - i0) tiles (the prefetch crosses from one head to the next), all adding
        // into dk and dv: the group sum of grouped-query attention in a fixed order (the same bits on every
        // run). One loop rather than two nested keeps the kernel within its registers.
        att_load_tile<HD, BM, NT>(sQ, qkv + q_off, rs, i0 * BM, T, tid);
        att_load_tile<HD, BM, NT>(sdO, dout + o_off, ors, i0 * BM, T, tid);
        att_load_vec<BM, NT>(sL, lse + l_off, i0 * BM, T, tid);
        att_load_vec<BM, NT>(sD, dvec + l_off, i0 * BM, T, tid);
        att_cp_commit();
        // The query block and buffer of the current tile, of the head at q_off, o_off, l_off; query heads
        // of the group after that one.
        int i = i0, buf = 0, heads_after = G - 1;
        for (;; buf ^= 1) {
            att_cp_wait<0>();
            __syncthreads();  // the tile is in buffer `buf`; every warp is done with the previous one
            if (i + 1 < nqb || heads_after > 0) {
                const int nb = buf ^ 1;
                const bool next_head = i + 1 == nqb;  // the next tile is the next head's block i0
                const int ni = next_head ? i0 : i + 1;
                const u64 hs = next_head ? (u64)HD : 0, ls = next_head ? (u64)T : 0;
                att_load_tile<HD, BM, NT>(sQ + nb * BM * S, qkv + q_off + hs, rs, ni * BM, T, tid);
                att_load_tile<HD, BM, NT>(sdO + nb * BM * S, dout + o_off + hs, ors, ni * BM, T, tid);
                att_load_vec<BM, NT>(sL + nb * BM, lse + l_off + ls, ni * BM, T, tid);
                att_load_vec<BM, NT>(sD + nb * BM, dvec + l_off + ls, ni * BM, T, tid);
                att_cp_commit();
            }
            const u16* cQ = sQ + buf * BM * S;
            const u16* cdO = sdO + buf * BM * S;
            const float* cL = sL + buf * BM;
            const float* cD = sD + buf * BM;
            const int q0 = i * BM;

            // P^T
            float pt[BM / 8][4];
#pragma unroll
            for (int n = 0; n < BM / 8; ++n) pt[n][0] = pt[n][1] = pt[n][2] = pt[n][3] = 0.0f;
            att_warp_abt<HD, BM>(pt, sK, warp * 16, cQ, lane);
#pragma unroll
            for (int nt = 0; nt < BM / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float ml = cL[nt * 8 + 2 * q + e] * ATT_LOG2E;
#pragma unroll
                    for (int hr = 0; hr < 2; ++hr)
                        pt[nt][2 * hr + e] = att_ex2(__fmaf_rn(pt[nt][2 * hr + e], scale_log2, -ml));
                }
            // The causal mask, in a warp-uniform branch (inline, the compiler evaluates the conditions on
            // every tile). query >= T is defensive: those rows of Q, dO, lse and D are zero-filled, so
            // their contributions vanish anyway.
            if ((q0 < k0 + BN - 1) || (q0 + BM > T)) {
#pragma unroll
                for (int nt = 0; nt < BM / 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int query = q0 + nt * 8 + 2 * q + e;
#pragma unroll
                        for (int hr = 0; hr < 2; ++hr)
                            if (key_a + 8 * hr > query || query >= T) pt[nt][2 * hr + e] = 0.0f;
                    }
            }

            // dV += P^T dO
            att_warp_pb<BM, HD, S>(dv, pt, cdO, 0, lane);

            // dS^T = P^T * (V dO^T - D)
            float ds[BM / 8][4];
#pragma unroll
            for (int n = 0; n < BM / 8; ++n) ds[n][0] = ds[n][1] = ds[n][2] = ds[n][3] = 0.0f;
            att_warp_abt<HD, BM>(ds, sV, warp * 16, cdO, lane);
#pragma unroll
            for (int nt = 0; nt < BM / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float dd = cD[nt * 8 + 2 * q + e];
                    ds[nt][e] = pt[nt][e] * (ds[nt][e] - dd);
                    ds[nt][2 + e] = pt[nt][2 + e] * (ds[nt][2 + e] - dd);
                }

            // dK += dS^T Q
            att_warp_pb<BM, HD, S>(dk, ds, cQ, 0, lane);

            // dS^T to shared memory (rows: keys, columns: queries), then dQ = dS K across the block.
            att_store_c_bf16<BM, SD>(sdS, warp * 16, ds, 1.0f, lane);
            __syncthreads();
            {
                const int rg = warp % RG, cg = warp / RG;
                u32 af[BN / 16][4];
                att_load_at<BN, SD>(af, sdS, rg * 16, lane);
                const int row = q0 + rg * 16 + g;
#pragma unroll
                for (int dp = 0; dp < DW / 16; ++dp) {
                    float c[2][4];
#pragma unroll
                    for (int n = 0; n < 2; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;
                    const int col0 = cg * DW + dp * 16;
                    att_warp_ab<BN, 16, S>(c, af, sK, col0, lane);
#pragma unroll
                    for (int n = 0; n < 2; ++n) {
                        const int col = col0 + n * 8 + 2 * q;
                        float* acc = dq_acc + (u64)split * dq_split_stride + o_off;
                        if (row < T) att_red_add2(acc + (u64)row * ors + col, c[n][0], c[n][1]);
                        if (row + 8 < T) att_red_add2(acc + (u64)(row + 8) * ors + col, c[n][2], c[n][3]);
                    }
                }
            }
            if (++i == nqb) {  // on to the next head, if any (past the last: undone after the loop)
                q_off += HD, o_off += HD, l_off += T;
                if (heads_after-- == 0) break;
                i = i0;
            }
        }
        // Back to the group's first head for the next key block.
        q_off -= (u64)G * HD, o_off -= (u64)G * HD, l_off -= (u64)G * T;

        // dK (times scale) and dV to dqkv, staged through sK / sV once every warp is done reading them.
        __syncthreads();
        att_store_c_bf16<HD, S>(sK, warp * 16, dk, scale, lane);
        att_store_c_bf16<HD, S>(sV, warp * 16, dv, 1.0f, lane);
        __syncwarp();
        att_warp_store_rows<HD>(dqkv + kv_off, rs, sK, warp * 16, k0 + warp * 16, T, lane);
        att_warp_store_rows<HD>(dqkv + kv_off + (u64)KV * HD, rs, sV, warp * 16, k0 + warp * 16, T, lane);
        __syncthreads();  // before the next key block overwrites the tiles
    }
}

// =====================================================================================================
// Simple kernels (no tensor cores): one block of 128 threads per row, f32 throughout
// =====================================================================================================

__device__ __forceinline__ float att_block_max128(float v, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    const float r = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
    __syncthreads();
    return r;
}
__device__ __forceinline__ float att_block_sum128(float v, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    const float r = (red[0] + red[1]) + (red[2] + red[3]);
    __syncthreads();
    return r;
}
template <int HD>
__device__ __forceinline__ float att_dot_row(const float* s, const u16* g) {
    float d = 0.0f;
#pragma unroll 8
    for (int x = 0; x < HD; ++x) d = __fmaf_rn(s[x], bf16_to_f32(g[x]), d);
    return d;
}

// Forward: block per (b, h, t) (grid-stride over B*H*T rows), online softmax over chunks of 128 keys.
template <int HD>
__device__ __forceinline__ void attn_fwd_simple(const u16* __restrict__ qkv, u16* __restrict__ out,
                                                float* __restrict__ lse, int B, int T, int H, int KV,
                                                float scale) {
    __shared__ float sq[HD];
    __shared__ float sp[128];
    __shared__ float red[4];
    const int tid = threadIdx.x;
    const u64 rs = (u64)(H + 2 * KV) * HD, rows = (u64)B * H * T;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const u64 bh = r / T;
        const int t = (int)(r - bh * T);
        const u64 b = bh / H, h = bh - b * H, kvh = h / (u64)(H / KV);
        const u16* gQ = qkv + b * T * rs + h * HD;
        const u16* gK = qkv + b * T * rs + ((u64)H + kvh) * HD;
        const u16* gV = gK + (u64)KV * HD;
        __syncthreads();
        if (tid < HD) sq[tid] = bf16_to_f32(gQ[(u64)t * rs + tid]);
        __syncthreads();
        float m = ATT_NEG_INF, l = 0.0f, acc = 0.0f;
        for (int c0 = 0; c0 <= t; c0 += 128) {
            const int k = c0 + tid;
            const bool ok = k <= t;
            const float s = ok ? att_dot_row<HD>(sq, gK + (u64)k * rs) * scale : ATT_NEG_INF;
            const float m_new = fmaxf(m, att_block_max128(s, red));  // key c0 <= t is valid: finite
            const float p = ok ? expf(s - m_new) : 0.0f;
            sp[tid] = p;
            const float alpha = expf(m - m_new);
            l = l * alpha + att_block_sum128(p, red);  // its barriers also publish sp
            if (tid < HD) {
                const int n = min(128, t - c0 + 1);
                float a = 0.0f;
                for (int kk = 0; kk < n; ++kk) a = __fmaf_rn(sp[kk], bf16_to_f32(gV[(u64)(c0 + kk) * rs + tid]), a);
                acc = acc * alpha + a;
            }
            m = m_new;
            __syncthreads();
        }
        if (tid < HD) out[((b * T + t) * H + h) * HD + tid] = f32_to_bf16(acc / l);
        if (tid == 0) lse[bh * T + t] = m + logf(l);
    }
}

// dQ: block per query row t; chunks of 128 keys k <= t: ds_k = p_k (dO . v_k - D), dq = scale sum ds_k k_k.
template <int HD>
__device__ __forceinline__ void attn_bwd_simple_dq(const u16* __restrict__ qkv, const u16* __restrict__ dout,
                                                   const float* __restrict__ lse,
                                                   const float* __restrict__ dvec, u16* __restrict__ dqkv,
                                                   int B, int T, int H, int KV, float scale) {
    __shared__ float sq[HD], sdo[HD];
    __shared__ float sds[128];
    const int tid = threadIdx.x;
    const u64 rs = (u64)(H + 2 * KV) * HD, rows = (u64)B * H * T;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const u64 bh = r / T;
        const int t = (int)(r - bh * T);
        const u64 b = bh / H, h = bh - b * H, kvh = h / (u64)(H / KV);
        const u16* gQ = qkv + b * T * rs + h * HD;
        const u16* gK = qkv + b * T * rs + ((u64)H + kvh) * HD;
        const u16* gV = gK + (u64)KV * HD;
        __syncthreads();
        if (tid < HD) {
            sq[tid] = bf16_to_f32(gQ[(u64)t * rs + tid]);
            sdo[tid] = bf16_to_f32(dout[((b * T + t) * H + h) * HD + tid]);
        }
        __syncthreads();
        const float lt = lse[bh * T + t], dt = dvec[bh * T + t];
        float acc = 0.0f;
        for (int c0 = 0; c0 <= t; c0 += 128) {
            const int k = c0 + tid;
            float ds = 0.0f;
            if (k <= t) {
                const float p = expf(att_dot_row<HD>(sq, gK + (u64)k * rs) * scale - lt);
                ds = p * (att_dot_row<HD>(sdo, gV + (u64)k * rs) - dt);
            }
            sds[tid] = ds;
            __syncthreads();
            if (tid < HD) {
                const int n = min(128, t - c0 + 1);
                for (int kk = 0; kk < n; ++kk) acc = __fmaf_rn(sds[kk], bf16_to_f32(gK[(u64)(c0 + kk) * rs + tid]), acc);
            }
            __syncthreads();
        }
        if (tid < HD) dqkv[(b * T + t) * rs + h * HD + tid] = f32_to_bf16(acc * scale);
    }
}

// dK, dV: block per key row k of a key/value head (grid-stride over B*KV*T rows); for each query head of
// its group in increasing order (the group sum, in a fixed order), chunks of 128 queries t >= k.
template <int HD>
__device__ __forceinline__ void attn_bwd_simple_dkdv(const u16* __restrict__ qkv, const u16* __restrict__ dout,
                                                     const float* __restrict__ lse,
                                                     const float* __restrict__ dvec, u16* __restrict__ dqkv,
                                                     int B, int T, int H, int KV, float scale) {
    __shared__ float sk[HD], sv[HD];
    __shared__ float sp[128], sds[128];
    const int tid = threadIdx.x;
    const int G = H / KV;
    const u64 rs = (u64)(H + 2 * KV) * HD, ors = (u64)H * HD, rows = (u64)B * KV * T;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const u64 bkv = r / T;
        const int k = (int)(r - bkv * T);
        const u64 b = bkv / KV, kvh = bkv - b * KV;
        const u16* gK = qkv + b * T * rs + ((u64)H + kvh) * HD;
        const u16* gV = gK + (u64)KV * HD;
        __syncthreads();
        if (tid < HD) {
            sk[tid] = bf16_to_f32(gK[(u64)k * rs + tid]);
            sv[tid] = bf16_to_f32(gV[(u64)k * rs + tid]);
        }
        __syncthreads();
        float dk = 0.0f, dv = 0.0f;
        for (int hg = 0; hg < G; ++hg) {
            const u64 h = kvh * G + hg, bh = b * H + h;
            const u16* gQ = qkv + b * T * rs + h * HD;
            const u16* gdO = dout + b * T * ors + h * HD;
            for (int c0 = k; c0 < T; c0 += 128) {
                const int t = c0 + tid;
                float p = 0.0f, ds = 0.0f;
                if (t < T) {
                    p = expf(att_dot_row<HD>(sk, gQ + (u64)t * rs) * scale - lse[bh * T + t]);
                    ds = p * (att_dot_row<HD>(sv, gdO + (u64)t * ors) - dvec[bh * T + t]);
                }
                sp[tid] = p;
                sds[tid] = ds;
                __syncthreads();
                if (tid < HD) {
                    const int n = min(128, T - c0);
                    for (int tt = 0; tt < n; ++tt) {
                        dv = __fmaf_rn(sp[tt], bf16_to_f32(gdO[(u64)(c0 + tt) * ors + tid]), dv);
                        dk = __fmaf_rn(sds[tt], bf16_to_f32(gQ[(u64)(c0 + tt) * rs + tid]), dk);
                    }
                }
                __syncthreads();
            }
        }
        if (tid < HD) {
            u16* gdK = dqkv + (b * T + k) * rs + ((u64)H + kvh) * HD;
            gdK[tid] = f32_to_bf16(dk * scale);
            gdK[(u64)KV * HD + tid] = f32_to_bf16(dv);
        }
    }
}

#if ATT_WANT(ATT_FAM_PROBES) && !defined(ATT_ONLY_KIND)
// =====================================================================================================
// Probes: one building block of the mma kernels on one 64 x 64 tile (HD = 64), for the layout tests.
// Inputs are dense row-major [64][64] in global memory; one block of 4 warps, warp w computes rows
// 16w..16w+15 of the result, exactly as the kernels above do. Launch with 4 * 64 * 72 * 2 bytes of dynamic
// shared memory.
// =====================================================================================================

template <int N>
__device__ __forceinline__ void att_probe_store_c(float* out, int row0, const float (&c)[N / 8][4], int lane) {
    const int g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int nt = 0; nt < N / 8; ++nt) {
        out[(row0 + g) * N + nt * 8 + 2 * q] = c[nt][0];
        out[(row0 + g) * N + nt * 8 + 2 * q + 1] = c[nt][1];
        out[(row0 + g + 8) * N + nt * 8 + 2 * q] = c[nt][2];
        out[(row0 + g + 8) * N + nt * 8 + 2 * q + 1] = c[nt][3];
    }
}

// out = a b^T (ldmatrix P1 A fragments, P2 B fragments, mma, C layout).
extern "C" __global__ void attn_probe_abt(const u16* a, const u16* b, float* out) {
    u16* sA = reinterpret_cast<u16*>(att_smem);
    u16* sB = sA + 64 * 72;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    att_load_tile<64, 64, 128>(sA, a, 64, 0, 64, threadIdx.x);
    att_load_tile<64, 64, 128>(sB, b, 64, 0, 64, threadIdx.x);
    att_cp_commit();
    att_cp_wait<0>();
    __syncthreads();
    float c[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.0f;
    att_warp_abt<64, 64>(c, sA, warp * 16, sB, lane);
    att_probe_store_c<64>(out, warp * 16, c, lane);
}

// out = p b with p given in f32 (read into C-fragment registers, rounded to bf16 as the kernels do; the
// C -> A reuse and the ldmatrix.trans B fragments).
extern "C" __global__ void attn_probe_pb(const float* p, const u16* b, float* out) {
    u16* sB = reinterpret_cast<u16*>(att_smem);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    att_load_tile<64, 64, 128>(sB, b, 64, 0, 64, threadIdx.x);
    att_cp_commit();
    float pr[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        const int r = warp * 16 + g, c = nt * 8 + 2 * q;
        pr[nt][0] = p[r * 64 + c];
        pr[nt][1] = p[r * 64 + c + 1];
        pr[nt][2] = p[(r + 8) * 64 + c];
        pr[nt][3] = p[(r + 8) * 64 + c + 1];
    }
    att_cp_wait<0>();
    __syncthreads();
    float c[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.0f;
    att_warp_pb<64, 64, 72>(c, pr, sB, 0, lane);
    att_probe_store_c<64>(out, warp * 16, c, lane);
}

// out = at^T b: at [64][64] holds A transposed (as dS^T in the backward); ldmatrix.trans P2 A fragments
// (att_load_at) and P1 .trans B fragments (att_warp_ab), in two 32-column halves as the dQ step with
// BM = 32 does, and the bf16 store of a C fragment into a padded tile (att_store_c_bf16) on the way in.
extern "C" __global__ void attn_probe_atb(const u16* at, const u16* b, float* out) {
    u16* sT = reinterpret_cast<u16*>(att_smem);
    u16* sB = sT + 64 * 72;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    // at arrives through registers in the C layout and att_store_c_bf16, as dS^T does in the backward.
    float cin[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        const int r = warp * 16 + g, c = nt * 8 + 2 * q;
        cin[nt][0] = bf16_to_f32(at[r * 64 + c]);
        cin[nt][1] = bf16_to_f32(at[r * 64 + c + 1]);
        cin[nt][2] = bf16_to_f32(at[(r + 8) * 64 + c]);
        cin[nt][3] = bf16_to_f32(at[(r + 8) * 64 + c + 1]);
    }
    att_store_c_bf16<64, 72>(sT, warp * 16, cin, 1.0f, lane);
    att_load_tile<64, 64, 128>(sB, b, 64, 0, 64, threadIdx.x);
    att_cp_commit();
    att_cp_wait<0>();
    __syncthreads();
    u32 af[4][4];
    att_load_at<64, 72>(af, sT, warp * 16, lane);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float c[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.0f;
        att_warp_ab<64, 32, 72>(c, af, sB, half * 32, lane);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            const int r = warp * 16 + g, col = half * 32 + nt * 8 + 2 * q;
            out[r * 64 + col] = c[nt][0];
            out[r * 64 + col + 1] = c[nt][1];
            out[(r + 8) * 64 + col] = c[nt][2];
            out[(r + 8) * 64 + col + 1] = c[nt][3];
        }
    }
}

#endif  // ATT_WANT(ATT_FAM_PROBES)

// =====================================================================================================
// Entry points
// =====================================================================================================
// Names: attn_fwd_w<NW>m<MT>n<BN>_hd<HD> (forward: NW warps of 16 * MT query rows, key blocks of BN);
// attn_bwd_fused_q<BM>_hd<HD> (fused backward, query blocks of BM); attn_bwd_simple_{dq,dkdv}_hd<HD>,
// attn_fwd_simple_hd<HD>. The variant lists are X-macros so that the host emulator instantiates the same
// set; mod.rs mirrors them (FORWARD_VARIANTS, ...), and a test checks the two agree.
#define ATT_FWD_VARIANTS_32(X) X(32, 4, 1, 64) X(32, 8, 1, 64) X(32, 4, 2, 64) X(32, 4, 2, 128) X(32, 8, 2, 64)
#define ATT_FWD_VARIANTS_64(X) X(64, 4, 1, 64) X(64, 8, 1, 64) X(64, 4, 2, 64) X(64, 4, 2, 128) X(64, 8, 2, 64)
#define ATT_FWD_VARIANTS_128(X) X(128, 4, 1, 64) X(128, 8, 1, 64) X(128, 4, 2, 64) X(128, 4, 2, 32) X(128, 8, 2, 32)

#define ATT_FWD_ENTRY(HD, NW, MT, BN)                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * NW) attn_fwd_w##NW##m##MT##n##BN##_hd##HD(             \
        const u16* qkv, u16* out, float* lse, int T, int H, int KV, float scale_log2) {                        \
        attn_fwd_mma<HD, NW, MT, BN>(qkv, out, lse, T, H, KV, scale_log2);                                     \
    }

#define ATT_FUSED_ENTRY(HD, BM)                                                                                \
    extern "C" __global__ void __launch_bounds__(128) attn_bwd_fused_q##BM##_hd##HD(                          \
        const u16* qkv, const u16* dout, const float* lse, const float* dvec, float* dq_acc,                   \
        u64 dq_split_stride, u16* dqkv, int T, int H, int KV, float scale, float scale_log2) {                 \
        attn_bwd_mma<HD, BM>(qkv, dout, lse, dvec, dq_acc, dq_split_stride, dqkv, T, H, KV, scale,            \
                             scale_log2);                                                                      \
    }
#define ATT_FUSED_ENTRIES(HD) ATT_FUSED_ENTRY(HD, 64) ATT_FUSED_ENTRY(HD, 32)

#define ATT_SIMPLE_ENTRIES(HD)                                                                                 \
    extern "C" __global__ void __launch_bounds__(128) attn_fwd_simple_hd##HD(                                 \
        const u16* qkv, u16* out, float* lse, int B, int T, int H, int KV, float scale) {                      \
        attn_fwd_simple<HD>(qkv, out, lse, B, T, H, KV, scale);                                                \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_bwd_simple_dq_hd##HD(                              \
        const u16* qkv, const u16* dout, const float* lse, const float* dvec, u16* dqkv, int B, int T, int H,  \
        int KV, float scale) {                                                                                 \
        attn_bwd_simple_dq<HD>(qkv, dout, lse, dvec, dqkv, B, T, H, KV, scale);                                \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_bwd_simple_dkdv_hd##HD(                            \
        const u16* qkv, const u16* dout, const float* lse, const float* dvec, u16* dqkv, int B, int T, int H,  \
        int KV, float scale) {                                                                                 \
        attn_bwd_simple_dkdv<HD>(qkv, dout, lse, dvec, dqkv, B, T, H, KV, scale);                              \
    }

// ATT_HD, when defined (by the modules of mod.rs), builds the entry points of that head dim only: a
// model uses one head dim, and each instantiation costs compile time at start-up. ATT_ONLY_KIND (with
// ATT_HD and ATT_ONLY_A, _B, _C), when defined, builds one entry point only (plus the D and dQ-convert
// kernels): kind 1 forward (NW, MT, BN), 2 fused backward (BM), 3 dK/dV (NW, MT, BM), 4 dK/dV with warp
// pairs (NP, BM), 5 dQ (NW, MT, BN). The launches use such single-kernel modules, so a process compiles
// exactly the kernels it runs.
#define ATT_CAT(a, b) a##b
#define ATT_XCAT(a, b) ATT_CAT(a, b)
#define ATT_APPLY(M, x) M(x)  // expands x (ATT_HD) before M pastes it
#define ATT_APPLY2(M, a, b) M(a, b)
#define ATT_APPLY3(M, a, b, c) M(a, b, c)
#define ATT_APPLY4(M, a, b, c, d) M(a, b, c, d)
#ifdef ATT_HD
#define ATT_FOR_HDS(M) ATT_APPLY(M, ATT_HD)
#define ATT_FOR_VARIANTS(LIST, X) ATT_XCAT(LIST, ATT_HD)(X)
#else
#define ATT_FOR_HDS(M) M(32) M(64) M(128)
#define ATT_FOR_VARIANTS(LIST, X) LIST##32(X) LIST##64(X) LIST##128(X)
#endif

#if defined(ATT_ONLY_KIND)
#if ATT_ONLY_KIND == 1
ATT_APPLY4(ATT_FWD_ENTRY, ATT_HD, ATT_ONLY_A, ATT_ONLY_B, ATT_ONLY_C)
#elif ATT_ONLY_KIND == 2
ATT_APPLY2(ATT_FUSED_ENTRY, ATT_HD, ATT_ONLY_A)
#endif
#else
#if ATT_WANT(ATT_FAM_FORWARD)
ATT_FOR_VARIANTS(ATT_FWD_VARIANTS_, ATT_FWD_ENTRY)
#endif
#if ATT_WANT(ATT_FAM_FUSED)
ATT_FOR_HDS(ATT_FUSED_ENTRIES)
#endif
#if ATT_WANT(ATT_FAM_SIMPLE)
ATT_FOR_HDS(ATT_SIMPLE_ENTRIES)
#endif
#endif  // ATT_ONLY_KIND
