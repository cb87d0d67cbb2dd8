// Building blocks of the tensor-core attention kernels (attention.cu, attention_separate.cu): constants,
// the kernel-family switches, PTX wrappers, shared-memory tile loaders and warp-level matrix products.
// Prepended with common.cuh (u16/u32/u64 typedefs, bf16 conversions); the host emulator of the tests
// includes it with ATT_HOST_EMULATION defined and its own emulations of the PTX wrappers.

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

