// Causal flash attention, forward and backward, BF16 in and out, F32 accumulation. Prepended with
// common.cuh (u16/u32/u64 typedefs, bf16 conversions). Compiled by NVRTC with the crate's precise options
// (--fmad=false, no fast math): the fast kernels therefore spell out their fused multiply-adds (__fmaf_rn)
// and exponentials (ex2.approx) where they want them.
//
// Layouts (row-major, element offsets):
//   qkv  [B, T, 3, H, HD] bf16: q(b,t,h,d) at ((b*T + t)*3*H + 0*H + h)*HD + d, k at +H*HD, v at +2*H*HD
//   out  [B, T, H, HD]    bf16: ((b*T + t)*H + h)*HD + d              (also dout)
//   lse  [B, H, T]        f32:  (b*H + h)*T + t, natural-log log-sum-exp of the scaled scores of row t
//   dqkv [B, T, 3, H, HD] bf16, as qkv
//   D    [B, H, T]        f32:  rowsum(dout * out) (backward workspace)
//   dq_acc [nbuf][B, T, H, HD] f32: dQ / scale accumulated by the backward (workspace)
//
// Two families of kernels:
//   *_mma_*:    FlashAttention-2 style tiles on tensor cores (mma.sync m16n8k16 bf16, ldmatrix, cp.async).
//   *_simple_*: one block per row, plain f32 dot products, no tensor cores, no shared tiles beyond one row.
//               Obviously correct and slow: the fallback that separates a fragment-layout bug in the mma
//               kernels from a problem elsewhere (launch, layout of the buffers, the host code).
// And the probe kernels at the end, which run one building block of the mma kernels on one tile so a test
// can check each fragment mapping in isolation.
//
// One file (over the usual length) because NVRTC builds each module from one string, and the forward,
// backward, simple kernels and probes share the PTX wrappers and fragment helpers at the top.

#define ATT_LOG2E 1.4426950408889634f
#define ATT_LN2 0.69314718055994531f
#define ATT_NEG_INF (-__int_as_float(0x7f800000))

// Kernel families. A module built with ATT_FAMILY defined (mod.rs builds one per head dim and family)
// holds that family's entry points only, plus the two small kernels every backward launches (D and the
// dQ conversion); without it, every family.
#define ATT_FAM_FORWARD 1
#define ATT_FAM_FUSED 2
#define ATT_FAM_SEPARATE 3
#define ATT_FAM_SIMPLE 4
#define ATT_FAM_PROBES 5
#ifdef ATT_FAMILY
#define ATT_WANT(f) (ATT_FAMILY == (f))
#else
#define ATT_WANT(f) 1
#endif

// =====================================================================================================
// PTX wrappers
// =====================================================================================================
// ATT_HOST_EMULATION is defined only by the host emulator of the tests (tests/attention_common/
// emulator.cpp), which compiles this file with a C++ compiler and supplies these functions (and the
// shared-memory buffer) as emulations of the PTX instructions' specified semantics.
#ifndef ATT_HOST_EMULATION

// The dynamic shared memory of the mma kernels and probes (sized by the launch).
extern __shared__ __align__(16) unsigned char att_smem[];

__device__ __forceinline__ u32 att_smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// 16-byte global -> shared copy; `valid` false copies nothing and zero-fills the 16 bytes (src-size 0).
__device__ __forceinline__ void att_cp_async16(void* dst, const void* src, bool valid) {
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(att_smem_u32(dst)), "l"(src), "r"(n));
}
// 4-byte global -> shared copy with the same zero-fill rule.
__device__ __forceinline__ void att_cp_async4(void* dst, const void* src, bool valid) {
    const int n = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(att_smem_u32(dst)), "l"(src), "r"(n));
}
__device__ __forceinline__ void att_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void att_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ldmatrix x4: four 8x8 b16 matrices. Lane l supplies the row address of row (l % 8) of matrix (l / 8).
// Without .trans, lane l receives in r[i] the two elements (row l/4, cols 2*(l%4), 2*(l%4)+1) of matrix i;
// with .trans it receives (rows 2*(l%4), 2*(l%4)+1, col l/4) of matrix i (the lower index in the low half).
__device__ __forceinline__ void att_ldsm_x4(const void* p, u32 (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(att_smem_u32(p))
                 : "memory");
}
__device__ __forceinline__ void att_ldsm_x4_trans(const void* p, u32 (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(att_smem_u32(p))
                 : "memory");
}

// D = A * B + D, m16n8k16, A row-major 16x16 bf16, B "col" 16x8 bf16, D 16x8 f32. With g = lane / 4 and
// q = lane % 4 (PTX ISA, "matrix fragments for mma.m16n8k16"):
//   A: a[0] = (row g,   cols 2q, 2q+1)   a[1] = (row g+8, cols 2q, 2q+1)
//      a[2] = (row g,   cols 2q+8, +9)   a[3] = (row g+8, cols 2q+8, +9)
//   B: b0 = (rows k = 2q, 2q+1, col n = g)   b1 = (rows k = 2q+8, 2q+9, col n = g)
//   C/D: c[0], c[1] = (row g, cols 2q, 2q+1)   c[2], c[3] = (row g+8, cols 2q, 2q+1)
// In every packed register the element with the lower k (or column) index is in the low 16 bits.
__device__ __forceinline__ void att_mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two f32 -> one register of two bf16 (round to nearest even), `lo` in the low half. PTX puts the first
// source operand in the UPPER half, hence the swapped operands.
__device__ __forceinline__ u32 att_pack_bf16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// 2^x (approximate, flush-to-zero; 2^-inf = 0).
__device__ __forceinline__ float att_ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// *p += (a, b) for two consecutive floats (8-byte aligned), without return value.
__device__ __forceinline__ void att_red_add2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
#endif
}

// Named barrier `id` (1..15; 0 is the one of __syncthreads) over `n` threads (a multiple of 32):
// att_bar_sync waits until n threads arrived; att_bar_arrive only signals (a producer that need not wait
// for its consumer). Shared-memory writes before either are visible to the threads past the barrier.
__device__ __forceinline__ void att_bar_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void att_bar_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

#endif  // ATT_HOST_EMULATION

// =====================================================================================================
// Shared-memory tiles
// =====================================================================================================
// A tile of ROWS rows of W bf16 lives in shared memory with a row stride of W + 8 elements: the 16 bytes
// of padding shift consecutive rows by 16 bytes modulo 128, so the 8 row addresses of one ldmatrix
// matrix (8 rows x 16 bytes) fall in 8 distinct 16-byte bank groups (conflict-free), and so do the
// bf16x2 stores of an mma C fragment (8 rows g, 4 lanes q x 4 bytes). W + 8 = 40, 72, 136 elements:
// 80, 144, 272 bytes, all multiples of 16 (cp.async and ldmatrix need 16-byte aligned rows).

// Loads rows t0 .. t0+ROWS-1 (tile row r = global row t0 + r) of a [*, W] slice whose row t starts at
// g + t * gstride (elements) into s (row stride W + 8). Rows t >= T are zero-filled: padding rows of K and
// V must be finite zeros, since P (zero there) multiplies them. Thread tid copies chunk tid % CH of rows
// tid / CH + i * (NT / CH): compile-time trip counts and a running source pointer, so the loop unrolls
// into a few integer instructions per 16-byte copy (a grid-stride form over chunk indices compiled to a
// generic loop with signed divisions, several times the integer work, in every iteration of the
// kernels' main loops).
template <int W, int ROWS, int NT>
__device__ __forceinline__ void att_load_tile(u16* s, const u16* g, u64 gstride, int t0, int T, int tid) {
    constexpr int CH = W / 8;         // 16-byte chunks per row
    constexpr int RSTEP = NT / CH;    // rows per pass of the block
    static_assert(NT % CH == 0, "a pass of the block must cover whole rows");
    const int r0 = (int)((unsigned)tid / CH), k = (int)((unsigned)tid % CH);
    const u16* src = g + (u64)(t0 + r0) * gstride + k * 8;
    const u64 step = (u64)RSTEP * gstride;
#pragma unroll
    for (int i = 0; i < (ROWS + RSTEP - 1) / RSTEP; ++i) {
        const int r = r0 + i * RSTEP;
        if (ROWS % RSTEP == 0 || r < ROWS) {
            const bool ok = t0 + r < T;
            att_cp_async16(s + r * (W + 8) + k * 8, ok ? src : g, ok);
        }
        src += step;
    }
}

// Loads v[t0 .. t0+ROWS-1] (f32) into s, zero past T.
template <int ROWS, int NT>
__device__ __forceinline__ void att_load_vec(float* s, const float* v, int t0, int T, int tid) {
#pragma unroll
    for (int i = 0; i < (ROWS + NT - 1) / NT; ++i) {
        const int r = tid + i * NT;
        if (ROWS % NT == 0 || r < ROWS) {
            const bool ok = t0 + r < T;
            att_cp_async4(s + r, v + (ok ? t0 + r : 0), ok);
        }
    }
}

// =====================================================================================================
// Warp-level matrix products (each warp: 16 output rows). All operands in shared memory are row-major
// tiles with the padded strides above. Address patterns of ldmatrix x4 used below (l = lane):
//   P1: row = r0 + (l & 15),                   col = c0 + (l >> 4) * 8
//   P2: row = r0 + (l & 7) + ((l >> 4) << 3),  col = c0 + ((l >> 3) & 1) * 8
// P1 without .trans gives an A fragment of the 16x16 block at (r0, c0) (matrices: rows r0..7 / r0+8..15
// at col c0 -> a[0] / a[1]; at col c0+8 -> a[2] / a[3]).
// P1 with .trans on storage M[k][n] gives B fragments of two n-tiles: r[0], r[1] = b0, b1 of cols
// c0..c0+7 (matrices rows r0..7 / r0+8..15 at col c0: lane gets M[r0 + 2q + i][c0 + g], i.e. B(k=2q+i,
// n=g)); r[2], r[3] = b0, b1 of cols c0+8..c0+15.
// P2 without .trans on storage M[n][k] (B^T stored by rows, as K in Q K^T) gives B fragments of the two
// n-tiles rows r0..7 and r0+8..15: r[0] = b0 (k = c0 + 2q + i, n = r0 + g), r[1] = b1 (k + 8), r[2],
// r[3] the same for n = r0 + 8 + g.
// P2 with .trans on storage M[k][m] (A^T stored by rows) gives the A fragment of A = M^T at
// (m0 = c0, k0 = r0): a[0] = M[r0 + 2q + i][c0 + g] = A(g, 2q + i), a[1] from cols c0+8 (rows g+8),
// a[2] from rows r0+8 (k + 8), a[3] both.
// =====================================================================================================

// C[16 x N] += A[16 x K] * B[N x K]^T: A rows a_row0.. of sA, B rows 0..N-1 of sB, both with K columns.
// (Q K^T in the forward; K Q^T and V dO^T in the backward.)
template <int K, int N>
__device__ __forceinline__ void att_warp_abt(float (&c)[N / 8][4], const u16* sA, int a_row0, const u16* sB,
                                             int lane) {
    constexpr int S = K + 8;
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        u32 a[4];
        att_ldsm_x4(sA + (a_row0 + (lane & 15)) * S + kk * 16 + (lane >> 4) * 8, a);
#pragma unroll
        for (int np = 0; np < N / 16; ++np) {
            u32 b[4];
            att_ldsm_x4(sB + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * S + kk * 16 + ((lane >> 3) & 1) * 8, b);
            att_mma(c[2 * np], a, b[0], b[1]);
            att_mma(c[2 * np + 1], a, b[2], b[3]);
        }
    }
}

// C[16 x N] += P[16 x K] * B[K x N]: P in registers in the C-fragment layout of K/8 n-tiles (as produced
// by att_warp_abt), rounded to bf16 here; B rows 0..K-1 of sB (row stride SB), columns col0..col0+N-1.
// A C fragment pair (n-tiles 2kc, 2kc+1) is exactly the A fragment of columns 16kc..16kc+15:
// a[0] = (row g, cols 2q..) = c[2kc][0,1], a[1] = (row g+8) = c[2kc][2,3], a[2] = (row g, cols 8+2q..) =
// c[2kc+1][0,1], a[3] = c[2kc+1][2,3].
// (P V in the forward; P^T dO and dS^T Q in the backward.)
template <int K, int N, int SB>
__device__ __forceinline__ void att_warp_pb(float (&c)[N / 8][4], const float (&p)[K / 8][4], const u16* sB,
                                            int col0, int lane) {
#pragma unroll
    for (int kc = 0; kc < K / 16; ++kc) {
        u32 a[4];
        a[0] = att_pack_bf16(p[2 * kc][0], p[2 * kc][1]);
        a[1] = att_pack_bf16(p[2 * kc][2], p[2 * kc][3]);
        a[2] = att_pack_bf16(p[2 * kc + 1][0], p[2 * kc + 1][1]);
        a[3] = att_pack_bf16(p[2 * kc + 1][2], p[2 * kc + 1][3]);
#pragma unroll
        for (int np = 0; np < N / 16; ++np) {
            u32 b[4];
            att_ldsm_x4_trans(sB + (kc * 16 + (lane & 15)) * SB + col0 + np * 16 + (lane >> 4) * 8, b);
            att_mma(c[2 * np], a, b[0], b[1]);
            att_mma(c[2 * np + 1], a, b[2], b[3]);
        }
    }
}

// The A fragments of A[16 x K] = M^T where M = sT[K rows][..] holds A transposed (row stride ST): A rows
// are columns m0..m0+15 of sT. (dS from the stored dS^T in the backward.)
template <int K, int ST>
__device__ __forceinline__ void att_load_at(u32 (&a)[K / 16][4], const u16* sT, int m0, int lane) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk)
        att_ldsm_x4_trans(sT + (kk * 16 + (lane & 7) + ((lane >> 4) << 3)) * ST + m0 + ((lane >> 3) & 1) * 8,
                          a[kk]);
}

// C[16 x N] += A[16 x K] * B[K x N] with A given as fragments and B rows 0..K-1 of sB (stride SB),
// columns col0.. . (dS K in the backward.)
template <int K, int N, int SB>
__device__ __forceinline__ void att_warp_ab(float (&c)[N / 8][4], const u32 (&a)[K / 16][4], const u16* sB,
                                            int col0, int lane) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
#pragma unroll
        for (int np = 0; np < N / 16; ++np) {
            u32 b[4];
            att_ldsm_x4_trans(sB + (kk * 16 + (lane & 15)) * SB + col0 + np * 16 + (lane >> 4) * 8, b);
            att_mma(c[2 * np], a[kk], b[0], b[1]);
            att_mma(c[2 * np + 1], a[kk], b[2], b[3]);
        }
    }
}

// Stores a warp's 16 x N C fragment as bf16 into rows row0.. of a padded shared tile (stride S), scaled.
template <int N, int S>
__device__ __forceinline__ void att_store_c_bf16(u16* s, int row0, const float (&c)[N / 8][4], float scale,
                                                 int lane) {
    const int g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int nt = 0; nt < N / 8; ++nt) {
        *reinterpret_cast<u32*>(s + (row0 + g) * S + nt * 8 + 2 * q) =
            att_pack_bf16(c[nt][0] * scale, c[nt][1] * scale);
        *reinterpret_cast<u32*>(s + (row0 + g + 8) * S + nt * 8 + 2 * q) =
            att_pack_bf16(c[nt][2] * scale, c[nt][3] * scale);
    }
}

// Copies rows row0..row0+15 of a padded shared tile (W columns) to global rows t = t_first + r (r < 16)
// at g + t * gstride, skipping t >= T. One warp, 16-byte stores.
template <int W>
__device__ __forceinline__ void att_warp_store_rows(u16* g, u64 gstride, const u16* s, int row0, int t_first,
                                                    int T, int lane) {
    constexpr int CH = W / 8;
#pragma unroll
    for (int c = lane; c < 16 * CH; c += 32) {
        const int r = c / CH, k = c - (c / CH) * CH;
        const int t = t_first + r;
        if (t < T)
            *reinterpret_cast<uint4*>(g + (u64)t * gstride + k * 8) =
                *reinterpret_cast<const uint4*>(s + (row0 + r) * (W + 8) + k * 8);
    }
}

// ---- Several 16-row tiles per warp ------------------------------------------------------------------
// The same products for MT row tiles of 16 (a warp owning 16 * MT rows): each B fragment loaded from
// shared memory feeds MT mma instead of one, which halves (MT = 2) the shared-memory reads per mma of the
// one-tile helpers above, whose ldmatrix traffic (one x4 per two mma) is the limit of a 16-row warp.

// C[m] += A[16 x K] (rows a_row0 + 16 m .. of sA) * B[N x K]^T (rows 0..N-1 of sB), m < MT.
template <int K, int N, int MT>
__device__ __forceinline__ void att_warp_abt_mt(float (&c)[MT][N / 8][4], const u16* sA, int a_row0,
                                                const u16* sB, int lane) {
    constexpr int S = K + 8;
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        u32 a[MT][4];
#pragma unroll
        for (int m = 0; m < MT; ++m)
            att_ldsm_x4(sA + (a_row0 + 16 * m + (lane & 15)) * S + kk * 16 + (lane >> 4) * 8, a[m]);
#pragma unroll
        for (int np = 0; np < N / 16; ++np) {
            u32 b[4];
            att_ldsm_x4(sB + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * S + kk * 16 + ((lane >> 3) & 1) * 8, b);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                att_mma(c[m][2 * np], a[m], b[0], b[1]);
                att_mma(c[m][2 * np + 1], a[m], b[2], b[3]);
            }
        }
    }
}

// The A fragments of rows a_row0 + 16 m .. (m < MT), all K columns, of sA (row stride K + 8): for
// operands that stay in registers across a loop.
template <int K, int MT>
__device__ __forceinline__ void att_load_a_mt(u32 (&a)[MT][K / 16][4], const u16* sA, int a_row0, int lane) {
    constexpr int S = K + 8;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int kk = 0; kk < K / 16; ++kk)
            att_ldsm_x4(sA + (a_row0 + 16 * m + (lane & 15)) * S + kk * 16 + (lane >> 4) * 8, a[m][kk]);
}

// As att_warp_abt_mt with the A fragments already in registers (att_load_a_mt).
template <int K, int N, int MT>
__device__ __forceinline__ void att_warp_abt_mt_ra(float (&c)[MT][N / 8][4], const u32 (&a)[MT][K / 16][4],
                                                   const u16* sB, int lane) {
    constexpr int S = K + 8;
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk)
#pragma unroll
        for (int np = 0; np < N / 16; ++np) {
            u32 b[4];
            att_ldsm_x4(sB + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * S + kk * 16 + ((lane >> 3) & 1) * 8, b);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                att_mma(c[m][2 * np], a[m][kk], b[0], b[1]);
                att_mma(c[m][2 * np + 1], a[m][kk], b[2], b[3]);
            }
        }
}

// C[m] += P[m] (16 x K, C-fragment registers, rounded to bf16 here) * B[K x N] (rows 0..K-1 of sB, row
// stride SB, columns col0..), m < MT. (P V in the forward; P^T dO, dS^T Q and dS K in the backward.)
template <int K, int N, int SB, int MT>
__device__ __forceinline__ void att_warp_pb_mt(float (&c)[MT][N / 8][4], const float (&p)[MT][K / 8][4],
                                               const u16* sB, int col0, int lane) {
#pragma unroll
    for (int kc = 0; kc < K / 16; ++kc) {
        u32 a[MT][4];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            a[m][0] = att_pack_bf16(p[m][2 * kc][0], p[m][2 * kc][1]);
            a[m][1] = att_pack_bf16(p[m][2 * kc][2], p[m][2 * kc][3]);
            a[m][2] = att_pack_bf16(p[m][2 * kc + 1][0], p[m][2 * kc + 1][1]);
            a[m][3] = att_pack_bf16(p[m][2 * kc + 1][2], p[m][2 * kc + 1][3]);
        }
#pragma unroll
        for (int np = 0; np < N / 16; ++np) {
            u32 b[4];
            att_ldsm_x4_trans(sB + (kc * 16 + (lane & 15)) * SB + col0 + np * 16 + (lane >> 4) * 8, b);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                att_mma(c[m][2 * np], a[m], b[0], b[1]);
                att_mma(c[m][2 * np + 1], a[m], b[2], b[3]);
            }
        }
    }
}

template <int MT, int N>
__device__ __forceinline__ void att_zero_mt(float (&c)[MT][N][4]) {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < N; ++n) c[m][n][0] = c[m][n][1] = c[m][n][2] = c[m][n][3] = 0.0f;
}

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
                                             float* __restrict__ lse, int T, int H, float scale_log2) {
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
    const u64 rs = (u64)3 * H * HD;  // qkv row stride
    const u16* gQ = qkv + (u64)b * T * rs + (u64)h * HD;
    const u16* gK = gQ + (u64)H * HD;
    const u16* gV = gQ + (u64)2 * H * HD;
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
// Grid (B*H, nsplit); 4 warps; each block processes key blocks of BN = 64 rows (warp w owns keys
// 16w..16w+15), taking key block j = r*nsplit + (r even ? split : nsplit-1-split) for r = 0, 1, ...
// (a snake order that evens out the causal work between splits). For one key block it loops over the
// query blocks of BM rows from the diagonal on, double-buffering Q, dO, lse and D with cp.async, and
// keeps dK and dV in registers:
//   S^T  = K Q^T         (16 keys x BM queries per warp)
//   P^T  = 2^(S^T * scale * log2e - lse * log2e), 0 where key > query or query >= T
//   dV  += P^T dO
//   dP^T = V dO^T
//   dS^T = P^T * (dP^T - D)
//   dK  += dS^T Q                      (times scale at the end)
//   dS^T -> shared (bf16); dQ(BM x HD) += dS K, added into dq_acc with vector reductions (dQ / scale).
// dq_acc + split * dq_split_stride is this block's accumulator. Deterministic mode gives every split its
// own buffer (dq_split_stride = B*T*H*HD): each address is then updated by one thread of one block only,
// in program order, so the sums are the same bits on every run. Atomic mode passes stride 0 and nsplit =
// number of key blocks: all blocks of a head add into one buffer, in a varying order.
// Shared memory: K, V [BN][HD+8]; Q, dO [2][BM][HD+8]; dS^T [BN][BM+8] bf16; lse, D [2][BM] f32.
template <int HD, int BM>
__device__ __forceinline__ void attn_bwd_mma(const u16* __restrict__ qkv, const u16* __restrict__ dout,
                                             const float* __restrict__ lse, const float* __restrict__ dvec,
                                             float* __restrict__ dq_acc, u64 dq_split_stride,
                                             u16* __restrict__ dqkv, int T, int H, float scale,
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
    const int bh = blockIdx.x, b = bh / H, h = bh - (bh / H) * H;
    const int split = blockIdx.y, nsplit = gridDim.y;
    const u64 rs = (u64)3 * H * HD, ors = (u64)H * HD;
    const u16* gQ = qkv + (u64)b * T * rs + (u64)h * HD;
    const u16* gK = gQ + (u64)H * HD;
    const u16* gV = gQ + (u64)2 * H * HD;
    const u16* gdO = dout + (u64)b * T * ors + (u64)h * HD;
    const float* gL = lse + (u64)bh * T;
    const float* gD = dvec + (u64)bh * T;
    float* acc = dq_acc + (u64)split * dq_split_stride + (u64)b * T * ors + (u64)h * HD;
    u16* gdK = dqkv + (u64)b * T * rs + (u64)H * HD + (u64)h * HD;
    u16* gdV = gdK + (u64)H * HD;
    const int nkb = (T + BN - 1) / BN, nqb = (T + BM - 1) / BM;

    for (int round = 0;; ++round) {
        const int j = round * nsplit + ((round & 1) ? nsplit - 1 - split : split);
        if (j >= nkb) break;  // j grows with the round
        const int k0 = j * BN;
        const int i0 = k0 / BM;  // first query block holding a query >= k0 (BM divides BN)

        att_load_tile<HD, BN, NT>(sK, gK, rs, k0, T, tid);
        att_load_tile<HD, BN, NT>(sV, gV, rs, k0, T, tid);
        att_load_tile<HD, BM, NT>(sQ, gQ, rs, i0 * BM, T, tid);
        att_load_tile<HD, BM, NT>(sdO, gdO, ors, i0 * BM, T, tid);
        att_load_vec<BM, NT>(sL, gL, i0 * BM, T, tid);
        att_load_vec<BM, NT>(sD, gD, i0 * BM, T, tid);
        att_cp_commit();

        float dk[HD / 8][4], dv[HD / 8][4];
#pragma unroll
        for (int i = 0; i < HD / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.0f;
        const int key_a = k0 + warp * 16 + g;  // key of rows [.][0,1] of the S^T fragments; +8 for [2,3]

        for (int i = i0; i < nqb; ++i) {
            const int buf = (i - i0) & 1;
            att_cp_wait<0>();
            __syncthreads();  // block i is in buffer `buf`; every warp is done with iteration i-1
            if (i + 1 < nqb) {
                const int nb = buf ^ 1;
                att_load_tile<HD, BM, NT>(sQ + nb * BM * S, gQ, rs, (i + 1) * BM, T, tid);
                att_load_tile<HD, BM, NT>(sdO + nb * BM * S, gdO, ors, (i + 1) * BM, T, tid);
                att_load_vec<BM, NT>(sL + nb * BM, gL, (i + 1) * BM, T, tid);
                att_load_vec<BM, NT>(sD + nb * BM, gD, (i + 1) * BM, T, tid);
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
                        if (row < T) att_red_add2(acc + (u64)row * ors + col, c[n][0], c[n][1]);
                        if (row + 8 < T) att_red_add2(acc + (u64)(row + 8) * ors + col, c[n][2], c[n][3]);
                    }
                }
            }
        }

        // dK (times scale) and dV to dqkv, staged through sK / sV once every warp is done reading them.
        __syncthreads();
        att_store_c_bf16<HD, S>(sK, warp * 16, dk, scale, lane);
        att_store_c_bf16<HD, S>(sV, warp * 16, dv, 1.0f, lane);
        __syncwarp();
        att_warp_store_rows<HD>(gdK, rs, sK, warp * 16, k0 + warp * 16, T, lane);
        att_warp_store_rows<HD>(gdV, rs, sV, warp * 16, k0 + warp * 16, T, lane);
        __syncthreads();  // before the next key block overwrites the tiles
    }
}

// =====================================================================================================
// Backward helpers shared by both families
// =====================================================================================================

// D[(b*H + h)*T + t] = sum_d dout[b,t,h,d] * out[b,t,h,d] (f32), one warp per (b, t, h) row, lanes over d
// in a fixed order, so the result does not depend on the launch.
extern "C" __global__ void attn_bwd_dot_rows(const u16* __restrict__ out, const u16* __restrict__ dout,
                                             float* __restrict__ dvec, int B, int T, int H, int HD) {
    const u64 rows = (u64)B * T * H;
    const int lane = threadIdx.x & 31;
    const u64 warps = (u64)gridDim.x * (blockDim.x >> 5);
    for (u64 r = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
        float s = 0.0f;
        for (int d = lane; d < HD; d += 32)
            s = __fmaf_rn(bf16_to_f32(dout[r * HD + d]), bf16_to_f32(out[r * HD + d]), s);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) {
            const u64 bt = r / H;
            const int h = (int)(r - bt * H);
            const u64 b = bt / T, t = bt - b * T;
            dvec[(b * H + h) * T + t] = s;
        }
    }
}

// dq slot of dqkv = bf16(scale * sum_{s < nbuf} acc[s * stride + i]) for every i of [B, T, H, HD], the
// buffers summed in order s = 0, 1, ... (deterministic).
extern "C" __global__ void attn_bwd_dq_convert(const float* __restrict__ acc, int nbuf, u64 stride,
                                               u16* __restrict__ dqkv, u64 n, int H, int HD, float scale) {
    const u64 row_len = (u64)H * HD;
    for (u64 i = global_thread(); i < n; i += grid_threads()) {
        float s = acc[i];
        for (int k = 1; k < nbuf; ++k) s += acc[(u64)k * stride + i];
        const u64 row = i / row_len, c = i - row * row_len;
        dqkv[row * 3 * row_len + c] = f32_to_bf16(s * scale);
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
                                                float* __restrict__ lse, int B, int T, int H, float scale) {
    __shared__ float sq[HD];
    __shared__ float sp[128];
    __shared__ float red[4];
    const int tid = threadIdx.x;
    const u64 rs = (u64)3 * H * HD, rows = (u64)B * H * T;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const u64 bh = r / T;
        const int t = (int)(r - bh * T);
        const u64 b = bh / H, h = bh - b * H;
        const u16* gQ = qkv + b * T * rs + h * HD;
        const u16* gK = gQ + (u64)H * HD;
        const u16* gV = gQ + (u64)2 * H * HD;
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
                                                   int B, int T, int H, float scale) {
    __shared__ float sq[HD], sdo[HD];
    __shared__ float sds[128];
    const int tid = threadIdx.x;
    const u64 rs = (u64)3 * H * HD, rows = (u64)B * H * T;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const u64 bh = r / T;
        const int t = (int)(r - bh * T);
        const u64 b = bh / H, h = bh - b * H;
        const u16* gQ = qkv + b * T * rs + h * HD;
        const u16* gK = gQ + (u64)H * HD;
        const u16* gV = gQ + (u64)2 * H * HD;
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

// dK, dV: block per key row k; chunks of 128 queries t >= k.
template <int HD>
__device__ __forceinline__ void attn_bwd_simple_dkdv(const u16* __restrict__ qkv, const u16* __restrict__ dout,
                                                     const float* __restrict__ lse,
                                                     const float* __restrict__ dvec, u16* __restrict__ dqkv,
                                                     int B, int T, int H, float scale) {
    __shared__ float sk[HD], sv[HD];
    __shared__ float sp[128], sds[128];
    const int tid = threadIdx.x;
    const u64 rs = (u64)3 * H * HD, ors = (u64)H * HD, rows = (u64)B * H * T;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const u64 bh = r / T;
        const int k = (int)(r - bh * T);
        const u64 b = bh / H, h = bh - b * H;
        const u16* gQ = qkv + b * T * rs + h * HD;
        const u16* gK = gQ + (u64)H * HD;
        const u16* gV = gQ + (u64)2 * H * HD;
        const u16* gdO = dout + b * T * ors + h * HD;
        __syncthreads();
        if (tid < HD) {
            sk[tid] = bf16_to_f32(gK[(u64)k * rs + tid]);
            sv[tid] = bf16_to_f32(gV[(u64)k * rs + tid]);
        }
        __syncthreads();
        float dk = 0.0f, dv = 0.0f;
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
        if (tid < HD) {
            dqkv[(b * T + k) * rs + (u64)H * HD + h * HD + tid] = f32_to_bf16(dk * scale);
            dqkv[(b * T + k) * rs + (u64)2 * H * HD + h * HD + tid] = f32_to_bf16(dv);
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
        const u16* qkv, u16* out, float* lse, int T, int H, float scale_log2) {                                \
        attn_fwd_mma<HD, NW, MT, BN>(qkv, out, lse, T, H, scale_log2);                                         \
    }

#define ATT_FUSED_ENTRY(HD, BM)                                                                                \
    extern "C" __global__ void __launch_bounds__(128) attn_bwd_fused_q##BM##_hd##HD(                          \
        const u16* qkv, const u16* dout, const float* lse, const float* dvec, float* dq_acc,                   \
        u64 dq_split_stride, u16* dqkv, int T, int H, float scale, float scale_log2) {                         \
        attn_bwd_mma<HD, BM>(qkv, dout, lse, dvec, dq_acc, dq_split_stride, dqkv, T, H, scale, scale_log2);   \
    }
#define ATT_FUSED_ENTRIES(HD) ATT_FUSED_ENTRY(HD, 64) ATT_FUSED_ENTRY(HD, 32)

#define ATT_SIMPLE_ENTRIES(HD)                                                                                 \
    extern "C" __global__ void __launch_bounds__(128) attn_fwd_simple_hd##HD(                                 \
        const u16* qkv, u16* out, float* lse, int B, int T, int H, float scale) {                              \
        attn_fwd_simple<HD>(qkv, out, lse, B, T, H, scale);                                                    \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_bwd_simple_dq_hd##HD(                              \
        const u16* qkv, const u16* dout, const float* lse, const float* dvec, u16* dqkv, int B, int T, int H,  \
        float scale) {                                                                                         \
        attn_bwd_simple_dq<HD>(qkv, dout, lse, dvec, dqkv, B, T, H, scale);                                    \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_bwd_simple_dkdv_hd##HD(                            \
        const u16* qkv, const u16* dout, const float* lse, const float* dvec, u16* dqkv, int B, int T, int H,  \
        float scale) {                                                                                         \
        attn_bwd_simple_dkdv<HD>(qkv, dout, lse, dvec, dqkv, B, T, H, scale);                                  \
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
