// Causal flash attention, forward and backward, on Hopper's warpgroup MMA (wgmma.mma_async), sm_90a only.
// Prepended with common.cuh (u16/u32/u64, bf16 conversions), attention_mma.cuh (cp.async, bf16 packing, ex2,
// the dynamic shared memory att_smem) and attention_rows.cu (the backward's D and dQ-conversion kernels);
// compiled by NVRTC for the sm_90a target alone (wgmma does not exist in sm_90 or later targets), in its own
// modules. Same contracts as the mma.sync kernels of attention.cu and attention_separate.cu (layouts there):
// qkv [B, T, H + 2*KV, HD] bf16 in, out [B, T, H, HD] bf16 and lse [B, H, T] f32 (natural log) out, causal,
// grouped-query heads (query head h reads key/value head h / (H / KV)); the backward's dqkv as qkv.
//
// Every layout assumption of this file, in one place (the probes at the end check them on a GPU one by one):
//
// (1) SW128 tiles in shared memory. A [ROWS][W] bf16 tile (W = 64 or 128 columns, ROWS a multiple of 8) is
//     stored as W / 64 column blocks of [ROWS][64] (block c at byte c * ROWS * 128); row r of a block at
//     byte r * 128 of it; the 16-byte chunk j of row r (columns 8j .. 8j+7 of the block) at chunk position
//     j ^ (r % 8). That is CuTe's Swizzle<3,4,3> on byte addresses (address bits 4-6 XOR bits 7-9), the
//     layout wgmma's "128-byte swizzle" mode reads. The hardware applies the XOR to the shared-window
//     address, so every tile starts 1024-byte aligned (the kernels align att_smem up to 1024 bytes
//     themselves) and ROWS * 128 is a multiple of 1024: then the row-index form above and the address form
//     agree. Eight consecutive rows (1024 bytes) form one swizzle atom.
//
// (2) Matrix descriptors (64 bits, PTX ISA "Matrix Descriptor Format" of wgmma; encode(x) = (x & 0x3FFFF) >> 4):
//       bits  0-13  encode(start address)          shared-window byte address of the operand's first element
//       bits 16-29  encode(leading byte offset)    LBO
//       bits 32-45  encode(stride byte offset)     SBO
//       bits 49-51  base offset = 0                (atoms start 1024-byte aligned)
//       bits 62-63  layout = 1                     128-byte swizzle
//     K-major operand (the reduction index k contiguous: Q as A and K as B of S = Q K^T, rows = M or N):
//       start = tile + (k0 / 64) * ROWS * 128 + row0 * 128 + (k0 % 64) * 2 for the k-step k0 .. k0 + 15
//       (k0 % 64 in {0, 16, 32, 48}: 0, 32, 64 or 96 bytes into the swizzled 128-byte rows; the hardware
//       adds the row and chunk offsets before it swizzles, as CUTLASS and DeepGEMM advance their
//       descriptors), SBO = 1024 (rows 8 .. 15 of the operand: the next atom), LBO = 16 (unused by the
//       swizzled K-major layouts; CuTe writes 1, i.e. 16 bytes).
//       CuTe's canonical form, in 16-byte units: ((8, n), 2) : ((8, SBO), 1).
//     MN-major operand (V as B of O = P V: B(k = key, n = column) = V[key][column], n contiguous; the
//     instruction's transpose bit for B is 1):
//       start = tile + key0 * 128 for the k-step of keys key0 .. key0 + 15 (key0 a multiple of 16: two whole
//       atoms), SBO = 1024 (keys key0 + 8 .. + 15: the next atom), LBO = ROWS * 128 (columns 64 .. 127: the
//       next column block; read only when N = 128).
//       CuTe's canonical form, in 16-byte units: ((8, n), (8, k)) : ((1, LBO), (8, SBO)).
//     An MN-major A operand (the backward's dS read from the dS^T tile: A(m = query, k = key) =
//     dS^T[key][query], m contiguous; the transpose bit for A is 1) has the same form with m for n.
//
// (3) Register fragments of wgmma.m64nNk16 (PTX ISA "Register Fragments and Shared Memory Matrix Layouts";
//     CuTe's CLayout_64xN / ALayout_64x16). Warp w = (threadIdx.x / 32) % 4 of a warpgroup owns rows
//     16 w .. 16 w + 15 of the 64; with g = lane / 4, q = lane % 4:
//       accumulator (f32, N / 2 registers): d[4 i + 2 h + e] = D(row 16 w + g + 8 h, col 8 i + 2 q + e),
//         i < N / 8, h, e in {0, 1}: per 8-column chunk i exactly an mma.m16n8k16 C fragment;
//       A from registers (bf16, 4 registers of two): a[0] = A(row g, k 2q, 2q+1), a[1] = A(row g + 8, k 2q,
//         2q+1), a[2] = A(row g, k 2q+8, 2q+9), a[3] = A(row g + 8, k 2q+8, 2q+9) of the warp's 16 rows,
//         lower k in the low 16 bits: the mma.m16n8k16 A fragment.
//     So the accumulator chunks 2 kc and 2 kc + 1 of S are the A fragment of P's columns 16 kc .. 16 kc + 15
//     (att_wg_c_to_a), as for mma.sync (att_warp_pb).
//
// (4) Ordering. wgmma reads shared memory through the async proxy: every thread fences its own cp.async
//     writes (fence.proxy.async.shared::cta after cp.async.wait_group) before the barrier that publishes a
//     tile. wgmma.fence comes before each batch of wgmma (registers written since the last batch);
//     commit_group closes a batch, wait_group N waits until at most the N newest batches are in flight
//     (batches complete in order); the compiler is kept from moving accumulator
//     or A-fragment reads and writes across those by empty asm statements on every register
//     (att_wg_fence_regs, CUTLASS's warpgroup_fence_operand).
//
// ATT_HOST_EMULATION (the host emulator of the tests, tests/attention_common/emulator.cpp) supplies the
// PTX wrappers below, the shared-window address of att_smem and the wgmma operations themselves (from the
// same reading of the PTX ISA as (1)-(3) above: the emulator checks the kernel's index arithmetic, masks,
// pipelining and synchronisation, the GPU probes check (1)-(3)).

// =====================================================================================================
// PTX wrappers
// =====================================================================================================
// A TMA tensor map (the driver's CUtensorMap: 128 opaque bytes, 64-byte aligned), built by the host with
// cuTensorMapEncodeTiled and passed by value as a __grid_constant__ kernel parameter (the TMA unit reads it
// from the parameter space). The host emulator keeps its own description of the map in the same bytes.
struct __align__(64) AttTmaMap {
    u64 opaque[16];
};

#ifndef ATT_HOST_EMULATION

// Orders this thread's generic-proxy writes to shared memory (cp.async, plain stores) before later
// async-proxy reads (wgmma operands) of other threads that synchronise with it through a barrier.
__device__ __forceinline__ void att_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// wgmma.fence: registers written by ordinary instructions are ready for the next wgmma.
__device__ __forceinline__ void att_wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
// Closes the batch of wgmma issued since the last commit.
__device__ __forceinline__ void att_wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed batches of this warpgroup are in flight.
template <int N>
__device__ __forceinline__ void att_wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// An empty asm on one register that the compiler must keep in order with the wgmma asm statements (all
// volatile): reads and writes of the register cannot move across it.
__device__ __forceinline__ void att_wg_fence_reg(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void att_wg_fence_reg(u32& r) { asm volatile("" : "+r"(r)::"memory"); }

// wgmma.mma_async.m64nNk16.f32.bf16.bf16 for N = 64 and 128: `ss` with A and B from shared memory, both
// K-major (transpose bits 0, 0), D = A B^T + (accumulate ? D : 0); `rs_mn` with A from registers and B
// MN-major from shared memory (transpose bit 1), D += A B. Scale factors of A and B: 1.
template <int N>
struct AttWgmma;

// D[64 x 64] (+)= A[64 x 16] * B[64 x 16]^T, A and B K-major in shared memory (descriptors da, db).
template <>
struct AttWgmma<64> {
    // The product with A and B from shared memory under the transpose bits TA and TB (1: the operand is
    // MN-major, A(m, k) with m contiguous, B(k, n) with n contiguous).
    template <int TA, int TB>
    static __device__ __forceinline__ void ss_t(float (&d)[32], u64 da, u64 db, int accumulate) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %35, %36;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
            : "l"(da), "l"(db), "r"(accumulate), "n"(TA), "n"(TB));
    }
    // Both operands K-major (S = Q K^T).
    static __device__ __forceinline__ void ss(float (&d)[32], u64 da, u64 db, int accumulate) {
        ss_t<0, 0>(d, da, db, accumulate);
    }
    // Both operands MN-major (dQ = dS K from the dS^T and K tiles).
    static __device__ __forceinline__ void ss_tt(float (&d)[32], u64 da, u64 db, int accumulate) {
        ss_t<1, 1>(d, da, db, accumulate);
    }
    // D[64 x 64] += A[64 x 16] * B[16 x 64], A from registers (a[0..3] per thread, the mma.m16n8k16 A layout
    // per warp), B MN-major in shared memory (descriptor db, transpose bit set).
    static __device__ __forceinline__ void rs_mn(float (&d)[32], const u32 (&a)[4], u64 db) {
        asm volatile(
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
    }
};

// D[64 x 128] (+)= A[64 x 16] * B[128 x 16]^T, A and B K-major in shared memory (descriptors da, db).
template <>
struct AttWgmma<128> {
    static __device__ __forceinline__ void ss(float (&d)[64], u64 da, u64 db, int accumulate) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
              "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
              "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
              "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
              "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
            : "l"(da), "l"(db), "r"(accumulate));
    }
    // D[64 x 128] += A[64 x 16] * B[16 x 128], A from registers (a[0..3] per thread, the mma.m16n8k16 A layout
    // per warp), B MN-major in shared memory (descriptor db, transpose bit set).
    static __device__ __forceinline__ void rs_mn(float (&d)[64], const u32 (&a)[4], u64 db) {
        asm volatile(
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
              "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
              "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
              "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
              "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
    }
};

// mbarrier (PTX ISA "Parallel Synchronization and Communication Instructions: mbarrier"), 8 bytes of
// shared memory at shared-window address `bar`. A phase completes when its pending arrivals reach zero and
// its expected transaction bytes have all arrived; the next phase then starts with `count` arrivals.
__device__ __forceinline__ void att_mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialised barriers visible to the async proxy (the TMA unit's complete_tx) before any use.
__device__ __forceinline__ void att_mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void att_mbar_arrive(u32 bar) {
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// One arrival that also expects `bytes` more transaction bytes (the TMA loads issued against it).
__device__ __forceinline__ void att_mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar),
                 "r"(bytes)
                 : "memory");
}
// True once the phase of parity `parity` has completed (phases alternate 0, 1, 0, ...; a waiter is never
// more than one phase behind, which the pipeline's full/empty pairing guarantees).
__device__ __forceinline__ bool att_mbar_try_wait(u32 bar, u32 parity) {
    u32 done;
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}
// setmaxnreg: the executing warpgroup's registers per thread become N (a multiple of 8 in 24 .. 256): the
// producer warpgroup of the warp-specialised forward gives registers back, its consumers take them.
template <int N>
__device__ __forceinline__ void att_setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void att_setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
// TMA: the box of the 4-d tensor map at coordinates (c0 innermost .. c3) into shared memory at `dst`
// (1024-byte aligned for the 128-byte swizzle), its bytes counted against barrier `bar`'s transaction
// count. Elements outside the tensor are zero-filled.
__device__ __forceinline__ void att_tma_load_4d(u32 dst, const AttTmaMap* map, int c0, int c1, int c2, int c3,
                                                u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
        "%5}], [%6];\n" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

// Bulk reduction (cp.reduce.async.bulk, non-tensor): the `bytes` bytes of f32 at shared address `src`
// (16-byte aligned, a multiple of 16 bytes) added element-wise into global memory at `dst` (16-byte
// aligned) by the async proxy, as one operation of this thread's current bulk async-group.
__device__ __forceinline__ void att_bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
                 "r"(src), "r"(bytes)
                 : "memory");
}
// Bulk copy (cp.async.bulk, non-tensor): the `bytes` bytes at shared address `src` to global memory at
// `dst` (both 16-byte aligned, a multiple of 16 bytes), in this thread's current bulk async-group.
__device__ __forceinline__ void att_bulk_store(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void att_bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until every bulk async-group of this thread completed: the reductions' writes are performed
// (their completion implies a generic-async proxy fence for this thread).
__device__ __forceinline__ void att_bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// Waits until every bulk async-group of this thread has read its shared-memory source (the source may be
// overwritten; the global writes may still be in flight).
__device__ __forceinline__ void att_bulk_wait_read_all() {
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
// Orders this thread's global accesses of the generic proxy with its async-proxy (bulk) operations.
__device__ __forceinline__ void att_fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
// A GPU-scope acquire load and release add of a 32-bit counter in global memory (the ordered dQ
// reduction's turn counters).
__device__ __forceinline__ u32 att_ld_acquire_gpu(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// Ends the kernel with an error (the launch's stream reports it) instead of spinning forever.
__device__ __forceinline__ void att_trap() { asm volatile("trap;\n" ::: "memory"); }
__device__ __forceinline__ void att_red_release_gpu_add(u32* p, u32 v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

#endif  // ATT_HOST_EMULATION

template <int N>
__device__ __forceinline__ void att_wg_fence_regs(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) att_wg_fence_reg(d[i]);
}
template <int K>
__device__ __forceinline__ void att_wg_fence_regs(u32 (&a)[K][4]) {
#pragma unroll
    for (int i = 0; i < K; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) att_wg_fence_reg(a[i][j]);
}

// Spins until the phase of parity `parity` of barrier `bar` completed.
__device__ __forceinline__ void att_mbar_wait(u32 bar, u32 parity) {
    while (!att_mbar_try_wait(bar, parity)) {
    }
}

// =====================================================================================================
// Descriptors, SW128 tiles
// =====================================================================================================

// The matrix descriptor of (2): start address, LBO and SBO in bytes, 128-byte swizzle, base offset 0.
__device__ __forceinline__ u64 att_wg_desc(u32 start, u32 lbo, u32 sbo) {
    return (u64)((start & 0x3FFFFu) >> 4) | ((u64)((lbo & 0x3FFFFu) >> 4) << 16) |
           ((u64)((sbo & 0x3FFFFu) >> 4) << 32) | (1ull << 62);
}

// Element index of (row r, column c) in a SW128 tile of ROWS rows (1).
template <int ROWS>
__device__ __forceinline__ int att_sw128_index(int r, int c) {
    return (c >> 6) * (ROWS * 64) + r * 64 + ((((c >> 3) & 7) ^ (r & 7)) << 3) + (c & 7);
}

// Loads rows t0 .. t0+ROWS-1 of a [*, W] slice whose row t starts at g + t * gstride (elements) into the
// SW128 tile s (W = 64 or 128): one 16-byte cp.async per chunk, zero-filled for rows t >= T (padding keys
// and values must be finite zeros: P is zero there and multiplies them). Thread tid copies chunk tid % CH
// of rows tid / CH + i * RSTEP; RSTEP is a multiple of 8, so a thread's swizzled chunk position is the same
// in every row it copies.
template <int W, int ROWS, int NT>
__device__ __forceinline__ void att_load_sw128(u16* s, const u16* g, u64 gstride, int t0, int T, int tid) {
    constexpr int CH = W / 8, RSTEP = NT / CH;
    static_assert(NT % CH == 0 && RSTEP % 8 == 0, "a pass of the block covers whole rows, 8 at a time");
    static_assert(ROWS % 8 == 0, "SW128 tiles hold whole swizzle atoms");
    const int r0 = (int)((unsigned)tid / CH), k = (int)((unsigned)tid % CH);
    const u16* src = g + (u64)(t0 + r0) * gstride + k * 8;
    const u64 step = (u64)RSTEP * gstride;
#pragma unroll
    for (int i = 0; i < (ROWS + RSTEP - 1) / RSTEP; ++i) {
        const int r = r0 + i * RSTEP;
        if (ROWS % RSTEP == 0 || r < ROWS) {
            const bool ok = t0 + r < T;
            att_cp_async16(s + att_sw128_index<ROWS>(r, 8 * k), ok ? src : g, ok);
        }
        src += step;
    }
}

// =====================================================================================================
// Warpgroup products (each warpgroup: 64 rows; the caller fences, commits and waits)
// =====================================================================================================

// D[64 x N] = A[64 x HD] * B[N x HD]^T in HD / 16 wgmma (the first overwrites D). a: shared address of A's
// row 0 in column block 0 of a SW128 tile whose column blocks lie a_block bytes apart (rows of A at 128-byte
// steps); b likewise for the N rows of B. (S = Q K^T.)
template <int HD, int N>
__device__ __forceinline__ void att_wg_abt(float (&d)[N / 2], u32 a, u32 a_block, u32 b, u32 b_block) {
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
        const u32 koff = (u32)(kk & 3) * 32u;
        const u64 da = att_wg_desc(a + (u32)(kk >> 2) * a_block + koff, 16u, 1024u);
        const u64 db = att_wg_desc(b + (u32)(kk >> 2) * b_block + koff, 16u, 1024u);
        AttWgmma<N>::ss(d, da, db, kk > 0 ? 1 : 0);
    }
}

// D[64 x N] += P[64 x K] * V[K x N] in K / 16 wgmma: P as A fragments in registers (att_wg_c_to_a), V the
// SW128 tile at shared address v (rows = keys 0 .. K-1, N = 64 or 128 columns, column blocks v_block bytes
// apart), read MN-major: LBO = v_block, SBO = v_sbo (1024, (2); the probe passes others to find the
// encoding a GPU reads should (2) be wrong). (O += P V.)
template <int K, int N>
__device__ __forceinline__ void att_wg_pv(float (&d)[N / 2], const u32 (&p)[K / 16][4], u32 v, u32 v_block,
                                          u32 v_sbo = 1024u) {
#pragma unroll
    for (int kc = 0; kc < K / 16; ++kc) AttWgmma<N>::rs_mn(d, p[kc], att_wg_desc(v + (u32)kc * 2048u, v_block, v_sbo));
}

// The A fragments of P[64 x K] (bf16, round to nearest even) from its accumulator fragments s (3): chunks
// 2 kc and 2 kc + 1 are the columns 16 kc .. 16 kc + 15.
template <int K>
__device__ __forceinline__ void att_wg_c_to_a(u32 (&p)[K / 16][4], const float (&s)[K / 2]) {
#pragma unroll
    for (int kc = 0; kc < K / 16; ++kc) {
        p[kc][0] = att_pack_bf16(s[8 * kc + 0], s[8 * kc + 1]);
        p[kc][1] = att_pack_bf16(s[8 * kc + 2], s[8 * kc + 3]);
        p[kc][2] = att_pack_bf16(s[8 * kc + 4], s[8 * kc + 5]);
        p[kc][3] = att_pack_bf16(s[8 * kc + 6], s[8 * kc + 7]);
    }
}

// =====================================================================================================
// Softmax steps on accumulator fragments (3): the thread's rows row (hr = 0) and row + 8 (hr = 1)
// =====================================================================================================

// Causal mask of S for key block k0 (keys after the row: -inf).
template <int BN>
__device__ __forceinline__ void att_wg_mask(float (&s)[BN / 2], int k0, int row, int q) {
#pragma unroll
    for (int i = 0; i < BN / 8; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int key = k0 + 8 * i + 2 * q + e;
            if (key > row) s[4 * i + e] = ATT_NEG_INF;
            if (key > row + 8) s[4 * i + 2 + e] = ATT_NEG_INF;
        }
}

// Online softmax of one key block, in the log2 domain as attn_fwd_mma: s becomes p = 2^(s * scale_log2 -
// m_new), m and l are updated, alpha = 2^(m_old - m_new) is what the running output must be multiplied by.
// Row max and sum over the 4 lanes of a quad. Every row sees key 0 in block 0, so m is finite from the
// first block on; the guard only keeps a fully masked row from producing inf - inf.
template <int BN>
__device__ __forceinline__ void att_wg_softmax(float (&s)[BN / 2], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                               float scale_log2) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        float mx = ATT_NEG_INF;
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) mx = fmaxf(mx, fmaxf(s[4 * i + 2 * hr], s[4 * i + 2 * hr + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[hr], mx * scale_log2);
        const float mb = m_new == ATT_NEG_INF ? 0.0f : m_new;
        alpha[hr] = att_ex2(m[hr] - mb);
        m[hr] = m_new;
        float rsum = 0.0f;
#pragma unroll
        for (int i = 0; i < BN / 8; ++i)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float p = att_ex2(__fmaf_rn(s[4 * i + 2 * hr + e], scale_log2, -mb));
                s[4 * i + 2 * hr + e] = p;
                rsum += p;
            }
        l[hr] = __fmaf_rn(l[hr], alpha[hr], rsum);
    }
}

// o *= alpha per row.
template <int HD>
__device__ __forceinline__ void att_wg_rescale(float (&o)[HD / 2], const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < HD / 8; ++i)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            o[4 * i + 2 * hr] *= alpha[hr];
            o[4 * i + 2 * hr + 1] *= alpha[hr];
        }
}

// =====================================================================================================
// Forward
// =====================================================================================================
// Grid (B*H, ceil(T / BM)), BM = 64 * NWG query rows per block of NWG warpgroups (128 * NWG threads), the
// last query block first (blockIdx.y = 0 has the most keys). Warpgroup wg owns rows q0 + 64 wg .. + 63;
// thread (warp w of the warpgroup, g, q) rows `row` = q0 + 64 wg + 16 w + g and row + 8 (fragments (3)).
// Key and value blocks of BN keys stream through shared memory with cp.async: iteration j waits for block
// j, fences it to the async proxy, passes one barrier and issues the copies of block j + 1, which overlap
// the products of block j. A warpgroup works on key blocks 0 .. jend - 1 (it skips those after its last
// row, and all when it holds no valid row), but passes every barrier. Per block and warpgroup:
//   S = Q K^T                    HD / 16 wgmma m64nBNk16, A = Q and B = K from shared memory (K-major)
//   causal mask, online softmax  in registers (att_wg_mask, att_wg_softmax)
//   O = O * alpha + P V          BN / 16 wgmma m64nHDk16, A = bf16(P) from registers, B = V MN-major
// in one of two schedules:
// - PIPE false: each batch is waited for before its results are used: S_j, softmax, P_j V_j, in turn.
//   Within a warpgroup the tensor cores and the softmax take turns (they overlap across warpgroups and
//   blocks of an SM). K and V have two buffers: the barrier of iteration j + 1 comes after every
//   warpgroup's P_j V_j completed, so block j + 2 may then overwrite block j's.
// - PIPE true (FlashAttention-3's intra-warpgroup overlap): iteration j issues S_j and then P_{j-1} V_{j-1}
//   (P_{j-1} kept in registers from iteration j - 1), waits for S_j only (wgmma.wait_group 1: batches
//   complete in order), runs the mask and softmax of block j while P_{j-1} V_{j-1} is in flight, then waits
//   for it, rescales O by block j's alpha and converts P_j; the last block's P V is issued and waited for
//   in its own iteration. V_{j-1} is read during iteration j, so V has three buffers (block j + 1's copy,
//   issued in iteration j, goes to the buffer of block j - 2, whose last reader completed in iteration
//   j - 1); K has two (S_j completes within iteration j).
// At the end O / l goes to out through the warpgroup's own rows of the Q tile (SW128, 16-byte stores) and
// lse = (m + log2 l) ln 2.
// Shared memory (1024-byte aligned): Q [BM][HD], K [2][BN][HD], V [2 or 3][BN][HD], all SW128 tiles.
// One warpgroup's walk of the overlapped schedule (PIPE above) over its key blocks 0 .. jend - 1 of the
// block's nkb, given how block j's K and V tiles arrive (the hooks `kv`, see AttKvCpAsync and AttKvTma):
//   kv.top(j)                 at the top of every iteration j < nkb, also those the warpgroup skips
//   kv.k(j), kv.v(j)          shared addresses of block j's K and V tiles
//   kv.wait_k(j), kv.wait_v(j)       before the first product that reads the tile
//   kv.release_k(j), kv.release_v(j) after the products that read it completed (wgmma.wait_group)
//   kv.skip(j)                for the blocks j >= jend the warpgroup does not use
// o, m and l hold the running output, row maxima and sums; aQw is the warpgroup's 64 rows of Q.
template <int HD, int BN, int BM, class KV>
__device__ __forceinline__ void att_wg_fwd_overlapped(KV& kv, int nkb, int jend, u32 aQw, int r0, int wq, int row,
                                                      int q, float scale_log2, float (&o)[HD / 2], float (&m)[2],
                                                      float (&l)[2]) {
    float s[BN / 2], alpha[2];
    u32 pa[BN / 16][4];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) s[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < BN / 16; ++i) pa[i][0] = pa[i][1] = pa[i][2] = pa[i][3] = 0u;
    // S = Q K_j^T, with O += P_{j-1} V_{j-1} (its P in pa since iteration j - 1) as a second batch when
    // pv_in_flight; waits for S_j only (wgmma.wait_group 1: batches complete in order), masks it where
    // block j reaches past the warp's first row, and turns it into P by the online softmax. The caller
    // waited for the tiles before its wgmma.fence (a wait loop between the fence and a wgmma makes ptxas
    // fence again, C7519, and serialize the wgmma).
    auto scores = [&](int j, bool pv_in_flight) {
        att_wg_abt<HD, BN>(s, aQw, BM * 128, kv.k(j), BN * 128);
        att_wg_commit();
        if (pv_in_flight) {
            att_wg_pv<BN, HD>(o, pa, kv.v(j - 1), BN * 128);
            att_wg_commit();
            att_wg_wait<1>();
        } else {
            att_wg_wait<0>();
        }
        kv.release_k(j);
        att_wg_fence_regs<BN / 2>(s);
        if (j * BN + BN - 1 > r0 + 16 * wq) att_wg_mask<BN>(s, j * BN, row, q);
        att_wg_softmax<BN>(s, m, l, alpha, scale_log2);
    };
    // O += P V_j with P from s, waited for.
    auto values = [&](int j) {
        kv.wait_v(j);
        att_wg_c_to_a<BN>(pa, s);
        att_wg_fence_regs<BN / 16>(pa);
        att_wg_fence_regs<HD / 2>(o);
        att_wg_fence();
        att_wg_pv<BN, HD>(o, pa, kv.v(j), BN * 128);
        att_wg_commit();
        att_wg_wait<0>();
        kv.release_v(j);
        att_wg_fence_regs<HD / 2>(o);
    };
    // Block 0 has no P V before it: peeled, so that every wgmma of the loop is unconditional (ptxas
    // serializes all wgmma, C7520, when a batch is issued on one path and not on another).
    kv.top(0);
    if (jend > 0) {
        kv.wait_k(0);
        att_wg_fence_regs<BN / 2>(s);
        att_wg_fence();
        scores(0, false);  // O is zero: no rescale
        if (jend == 1) {
            values(0);
        } else {
            att_wg_c_to_a<BN>(pa, s);
        }
    } else {
        kv.skip(0);
    }
    for (int j = 1; j < nkb; ++j) {
        kv.top(j);
        if (j >= jend) {  // warpgroup-uniform; no barrier below
            kv.skip(j);
            continue;
        }
        kv.wait_k(j);
        kv.wait_v(j - 1);
        att_wg_fence_regs<BN / 2>(s);
        att_wg_fence_regs<HD / 2>(o);
        att_wg_fence_regs<BN / 16>(pa);
        att_wg_fence();
        scores(j, true);   // the softmax of block j runs while P_{j-1} V_{j-1} does
        att_wg_wait<0>();  // P_{j-1} V_{j-1} done: O and pa are free
        kv.release_v(j - 1);
        att_wg_fence_regs<HD / 2>(o);
        att_wg_fence_regs<BN / 16>(pa);
        att_wg_rescale<HD>(o, alpha);
        if (j == jend - 1) {
            values(j);  // the warpgroup's last block: its P V now
        } else {
            att_wg_c_to_a<BN>(pa, s);
        }
    }
}

// The thread's accumulator fragments (rows srow + g and srow + g + 8 of a warpgroup's 64, columns HD)
// times mul[row half], as bf16 pairs at their SW128 positions in the BM-row tile s: staging through the
// warp's own rows of the Q tile (only its warpgroup's wgmma read them, and they completed).
template <int HD, int BM>
__device__ __forceinline__ void att_wg_stage_rows(const float (&acc)[HD / 2], const float (&mul)[2], u16* s,
                                                  int srow, int g, int q) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
#pragma unroll
        for (int i = 0; i < HD / 8; ++i)
            *reinterpret_cast<u32*>(s + att_sw128_index<BM>(srow + g + 8 * hr, 8 * i + 2 * q)) =
                att_pack_bf16(acc[4 * i + 2 * hr] * mul[hr], acc[4 * i + 2 * hr + 1] * mul[hr]);
}

// The warp's 16 staged rows srow .. srow + 15 of the tile s to global rows t_first + r (at
// dst + (t_first + r) * stride), 16 bytes at a time, rows < T only.
template <int HD, int BM>
__device__ __forceinline__ void att_wg_store_rows(const u16* s, int srow, u16* __restrict__ dst, u64 stride,
                                                  int t_first, int T, int lane) {
    __syncwarp();
    constexpr int CH = HD / 8;
#pragma unroll
    for (int c = lane; c < 16 * CH; c += 32) {
        const int r = c / CH, k = c - (c / CH) * CH;
        if (t_first + r < T)
            *reinterpret_cast<uint4*>(dst + (u64)(t_first + r) * stride + k * 8) =
                *reinterpret_cast<const uint4*>(s + att_sw128_index<BM>(srow + r, 8 * k));
    }
}

// The forward's end for one warpgroup: O / l to out through the warpgroup's own rows of the Q tile and
// lse = (m + log2 l) ln 2 (natural log). Rows >= T compute finite values nobody stores.
template <int HD, int BM>
__device__ __forceinline__ void att_wg_fwd_store(const float (&o)[HD / 2], const float (&m)[2], const float (&l)[2],
                                                 u16* sQ, u16* __restrict__ out, float* __restrict__ lse, int bh,
                                                 int b, int h, int H, int T, int wg, int wq, int r0, int row,
                                                 int lane, int g, int q) {
    float inv[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        float lt = l[hr];
        lt += __shfl_xor_sync(0xffffffffu, lt, 1);
        lt += __shfl_xor_sync(0xffffffffu, lt, 2);
        inv[hr] = 1.0f / lt;
        if (q == 0 && row + 8 * hr < T) lse[(u64)bh * T + row + 8 * hr] = (m[hr] + log2f(lt)) * ATT_LN2;
    }
    const int srow = 64 * wg + 16 * wq;  // the warp's first row in the Q tile
    att_wg_stage_rows<HD, BM>(o, inv, sQ, srow, g, q);
    att_wg_store_rows<HD, BM>(sQ, srow, out + (u64)b * T * H * HD + (u64)h * HD, (u64)H * HD, r0 + 16 * wq, T,
                              lane);
}

// Key/value blocks by cp.async, every thread of the block copying (the overlapped forward and the dQ
// kernel): iteration j waits for block j, fences it to the async proxy, passes one barrier and issues
// block j + 1's copies into buffers (j + 1) % KBUF (K) and (j + 1) % VBUF (V), which the kernel's schedule
// has freed by then. The products' waits and releases need nothing more: the barrier orders them.
template <int HD, int BN, int NT, int KBUF, int VBUF>
struct AttKvCpAsync {
    u16* sK;
    u16* sV;
    u32 aK, aV;
    const u16* gK;
    const u16* gV;
    u64 rs;
    int T, nkb, tid;
    static constexpr u32 KBYTES = BN * HD * 2;
    __device__ __forceinline__ void top(int j) {
        att_cp_wait<0>();
        att_fence_proxy_async();
        __syncthreads();  // block j is in its buffers for every thread
        if (j + 1 < nkb) {
            att_load_sw128<HD, BN, NT>(sK + ((j + 1) % KBUF) * (KBYTES / 2), gK, rs, (j + 1) * BN, T, tid);
            att_load_sw128<HD, BN, NT>(sV + ((j + 1) % VBUF) * (KBYTES / 2), gV, rs, (j + 1) * BN, T, tid);
            att_cp_commit();
        }
    }
    __device__ __forceinline__ u32 k(int j) const { return aK + (u32)(j % KBUF) * KBYTES; }
    __device__ __forceinline__ u32 v(int j) const { return aV + (u32)(j % VBUF) * KBYTES; }
    __device__ __forceinline__ void wait_k(int) {}
    __device__ __forceinline__ void wait_v(int) {}
    __device__ __forceinline__ void release_k(int) {}
    __device__ __forceinline__ void release_v(int) {}
    __device__ __forceinline__ void skip(int) {}
};

// Grid (B*H, ceil(T / BM)), BM = 64 * NWG query rows per block of NWG warpgroups (128 * NWG threads), the
// last query block first (blockIdx.y = 0 has the most keys). Warpgroup wg owns rows q0 + 64 wg .. + 63;
// thread (warp w of the warpgroup, g, q) rows `row` = q0 + 64 wg + 16 w + g and row + 8 (fragments (3)).
// Key and value blocks of BN keys stream through shared memory with cp.async: iteration j waits for block
// j, fences it to the async proxy, passes one barrier and issues the copies of block j + 1, which overlap
// the products of block j. A warpgroup works on key blocks 0 .. jend - 1 (it skips those after its last
// row, and all when it holds no valid row), but passes every barrier. Per block and warpgroup:
//   S = Q K^T                    HD / 16 wgmma m64nBNk16, A = Q and B = K from shared memory (K-major)
//   causal mask, online softmax  in registers (att_wg_mask, att_wg_softmax)
//   O = O * alpha + P V          BN / 16 wgmma m64nHDk16, A = bf16(P) from registers, B = V MN-major
// in one of two schedules:
// - PIPE false: each batch is waited for before its results are used: S_j, softmax, P_j V_j, in turn.
//   Within a warpgroup the tensor cores and the softmax take turns (they overlap across warpgroups and
//   blocks of an SM). K and V have two buffers: the barrier of iteration j + 1 comes after every
//   warpgroup's P_j V_j completed, so block j + 2 may then overwrite block j's.
// - PIPE true (FlashAttention-3's intra-warpgroup overlap, att_wg_fwd_overlapped): iteration j issues S_j
//   and then P_{j-1} V_{j-1} (P_{j-1} kept in registers from iteration j - 1), waits for S_j only, runs the
//   mask and softmax of block j while P_{j-1} V_{j-1} is in flight, then waits for it, rescales O by block
//   j's alpha and converts P_j; the last block's P V is issued and waited for in its own iteration.
//   V_{j-1} is read during iteration j, so V has three buffers (block j + 1's copy, issued in iteration j,
//   goes to the buffer of block j - 2, whose last reader completed in iteration j - 1); K has two (S_j
//   completes within iteration j).
// At the end, att_wg_fwd_store.
// Shared memory (1024-byte aligned): Q [BM][HD], K [2][BN][HD], V [2 or 3][BN][HD], all SW128 tiles.
template <int HD, int NWG, int BN, bool PIPE>
__device__ __forceinline__ void attn_fwd_wgmma(const u16* __restrict__ qkv, u16* __restrict__ out,
                                               float* __restrict__ lse, int T, int H, int KV, float scale_log2) {
    static_assert(HD == 64 || HD == 128, "head dim 64 or 128");
    static_assert(BN == 64 || BN == 128, "key blocks of 64 or 128");
    static_assert(NWG >= 1 && NWG <= 3, "1 to 3 warpgroups");
    constexpr int BM = 64 * NWG, NT = 128 * NWG, VBUF = PIPE ? 3 : 2;
    constexpr u32 QBYTES = BM * HD * 2, KBYTES = BN * HD * 2;
    const u32 raw = att_smem_u32(att_smem);
    const u32 pad = (1024u - (raw & 1023u)) & 1023u;
    const u32 aQ = raw + pad, aK = aQ + QBYTES, aV = aK + 2 * KBYTES;  // shared-window addresses
    u16* sQ = reinterpret_cast<u16*>(att_smem + pad);
    u16* sK = reinterpret_cast<u16*>(att_smem + pad + QBYTES);
    u16* sV = reinterpret_cast<u16*>(att_smem + pad + QBYTES + 2 * KBYTES);

    const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7, wq = (tid >> 5) & 3;
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
    const int r0 = q0 + 64 * wg;       // the warpgroup's first row
    const int row = r0 + 16 * wq + g;  // the thread's rows: row, row + 8
    const bool active = r0 < T;        // warpgroup-uniform: a warpgroup of the last block may hold no row
    // The warpgroup's key blocks 0 .. jend - 1 (warpgroup-uniform): up to the one holding its last row.
    const int jend = active ? min(nkb, (r0 + 63) / BN + 1) : 0;
    const u32 aQw = aQ + (u32)(64 * wg) * 128u;  // the warpgroup's 64 rows of Q (in column block 0)

    att_load_sw128<HD, BM, NT>(sQ, gQ, rs, q0, T, tid);
    att_load_sw128<HD, BN, NT>(sK, gK, rs, 0, T, tid);
    att_load_sw128<HD, BN, NT>(sV, gV, rs, 0, T, tid);
    att_cp_commit();

    float o[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) o[i] = 0.0f;
    float m[2] = {ATT_NEG_INF, ATT_NEG_INF}, l[2] = {0.0f, 0.0f};

    if constexpr (!PIPE) {
        float s[BN / 2], alpha[2];
        u32 pa[BN / 16][4];
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) s[i] = 0.0f;
        for (int j = 0; j < nkb; ++j) {
            // Block j landed and is fenced for every thread; the copies of block j + 1.
            att_cp_wait<0>();
            att_fence_proxy_async();
            __syncthreads();  // block j is in its buffers for every thread; see above for the buffers freed
            if (j + 1 < nkb) {
                att_load_sw128<HD, BN, NT>(sK + ((j + 1) & 1) * (KBYTES / 2), gK, rs, (j + 1) * BN, T, tid);
                att_load_sw128<HD, BN, NT>(sV + ((j + 1) % VBUF) * (KBYTES / 2), gV, rs, (j + 1) * BN, T, tid);
                att_cp_commit();
            }
            if (j >= jend) continue;  // warpgroup-uniform; no barrier below
            att_wg_fence_regs<BN / 2>(s);
            att_wg_fence();
            att_wg_abt<HD, BN>(s, aQw, BM * 128, aK + (u32)(j & 1) * KBYTES, BN * 128);
            att_wg_commit();
            att_wg_wait<0>();
            att_wg_fence_regs<BN / 2>(s);
            if (j * BN + BN - 1 > r0 + 16 * wq) att_wg_mask<BN>(s, j * BN, row, q);
            att_wg_softmax<BN>(s, m, l, alpha, scale_log2);
            att_wg_rescale<HD>(o, alpha);
            att_wg_c_to_a<BN>(pa, s);
            att_wg_fence_regs<BN / 16>(pa);
            att_wg_fence_regs<HD / 2>(o);
            att_wg_fence();
            att_wg_pv<BN, HD>(o, pa, aV + (u32)(j % VBUF) * KBYTES, BN * 128);
            att_wg_commit();
            att_wg_wait<0>();
            att_wg_fence_regs<HD / 2>(o);
        }
    } else {
        AttKvCpAsync<HD, BN, NT, 2, 3> kv{sK, sV, aK, aV, gK, gV, rs, T, nkb, tid};
        att_wg_fwd_overlapped<HD, BN, BM>(kv, nkb, jend, aQw, r0, wq, row, q, scale_log2, o, m, l);
    }
    if (!active) return;  // no barrier below
    att_wg_fwd_store<HD, BM>(o, m, l, sQ, out, lse, bh, b, h, H, T, wg, wq, r0, row, lane, g, q);
}

// Stages of the warp-specialised forward's key/value pipeline.
#define ATT_WS_STAGES 2
// Query-tile stages of the warp-specialised dK/dV kernel: three at head dim 64 (its tiles are small; 5 %
// faster than two at the llama-1b shape on an H100), two at 128 (where a build with three everywhere was
// slower).
#define ATT_KV_WS_STAGES(HD) ((HD) == 64 ? 3 : 2)

// Key/value blocks by TMA from the block's producer warpgroup (attn_fwd_wgmma_ws, attn_bwd_dq_wgmma_ws): stage j % ST holds block j;
// full barriers (one arrival, the producer's, plus the TMA bytes) say it landed, empty barriers (one
// arrival per consumer warp, after its products that read the stage completed) let the producer refill it.
template <int HD, int BN, int ST>
struct AttKvTma {
    u32 aK, aV, bar;  // bar: full_k[ST], full_v[ST], empty_k[ST], empty_v[ST] at 8-byte steps
    int lane;
    static constexpr u32 KBYTES = BN * HD * 2;
    __device__ __forceinline__ static u32 phase(int j) { return (u32)(j / ST) & 1u; }
    __device__ __forceinline__ void top(int) {}
    __device__ __forceinline__ u32 k(int j) const { return aK + (u32)(j % ST) * KBYTES; }
    __device__ __forceinline__ u32 v(int j) const { return aV + (u32)(j % ST) * KBYTES; }
    __device__ __forceinline__ void wait_k(int j) { att_mbar_wait(bar + 8u * (j % ST), phase(j)); }
    __device__ __forceinline__ void wait_v(int j) { att_mbar_wait(bar + 8u * (ST + j % ST), phase(j)); }
    __device__ __forceinline__ void release_k(int j) {
        if (lane == 0) att_mbar_arrive(bar + 8u * (2 * ST + j % ST));
    }
    __device__ __forceinline__ void release_v(int j) {
        if (lane == 0) att_mbar_arrive(bar + 8u * (3 * ST + j % ST));
    }
    // A block the warpgroup does not use still passes through its stage in order, so that every phase of
    // the barriers completes.
    __device__ __forceinline__ void skip(int j) {
        wait_k(j);
        release_k(j);
        wait_v(j);
        release_v(j);
    }
};

// The warp-specialised kernels' barriers at aBar: full_q (one arrival: the producer's, with the bytes of
// the tiles loaded once), full_k[ST], full_v[ST] (one arrival each use), empty_k[ST], empty_v[ST] (one
// arrival per consumer warp); initialised by thread 0 and published by the block's only barrier.
template <int ST, int NWG>
__device__ __forceinline__ void att_ws_init_barriers(u32 aBar, int tid) {
    if (tid == 0) {
        att_mbar_init(aBar, 1);
        for (int i = 0; i < 2 * ST; ++i) att_mbar_init(aBar + 8u * (1 + i), 1);
        for (int i = 2 * ST; i < 4 * ST; ++i) att_mbar_init(aBar + 8u * (1 + i), 4 * NWG);
        att_mbar_init_fence();
    }
    __syncthreads();
}

// The producer's loop over key/value blocks 0 .. nkb - 1 (one thread): block j into stage j % ST of the K
// and V tiles (heads kh and vh of qkv through the tensor map tkv, batch b), each after the consumers
// released the stage's previous block (its empty phase j / ST - 1), counted against the stage's full
// barrier (bar: full_k[ST], full_v[ST], empty_k[ST], empty_v[ST]).
template <int HD, int BN, int ST>
__device__ __forceinline__ void att_ws_produce_kv(const AttTmaMap* tkv, u32 aK, u32 aV, u32 bar, int nkb, int kh,
                                                  int vh, int b) {
    constexpr u32 KBYTES = BN * HD * 2;
    const u32 fk = bar, fv = fk + 8u * ST, ek = fv + 8u * ST, ev = ek + 8u * ST;
    for (int j = 0; j < nkb; ++j) {
        const int st = j % ST;
        const u32 ph = (u32)(j / ST - 1) & 1u;
        if (j >= ST) att_mbar_wait(ek + 8u * st, ph);
        att_mbar_arrive_expect_tx(fk + 8u * st, KBYTES);
#pragma unroll
        for (int c = 0; c < HD / 64; ++c)
            att_tma_load_4d(aK + (u32)st * KBYTES + (u32)c * BN * 128, tkv, 64 * c, kh, j * BN, b, fk + 8u * st);
        if (j >= ST) att_mbar_wait(ev + 8u * st, ph);
        att_mbar_arrive_expect_tx(fv + 8u * st, KBYTES);
#pragma unroll
        for (int c = 0; c < HD / 64; ++c)
            att_tma_load_4d(aV + (u32)st * KBYTES + (u32)c * BN * 128, tkv, 64 * c, vh, j * BN, b, fv + 8u * st);
    }
}

// The overlapped forward (PIPE above, att_wg_fwd_overlapped) with warp specialisation: NWG consumer
// warpgroups (rows as attn_fwd_wgmma) and one producer warpgroup (the block's last, threads 128 NWG ..
// 128 NWG + 127) whose first thread issues every load with TMA, so the consumers spend no instructions
// and no barrier on copies and run independently of each other. A whole warpgroup, not one warp, because
// registers are allocated per warpgroup on sm_90 (ptxas budgets 168 per thread for 288 threads as for
// 384); setmaxnreg moves them: the producer keeps 24, each consumer thread gets 240 (the products'
// accumulators, S and P take about 200). The Q tile comes once, behind its own barrier; key/value
// block j goes to stage j % ST, loaded when the consumers released the block ST earlier. TMA writes the
// 128-byte-swizzled layout (1) itself: one box of 64 columns x BN rows per column block, from the tensor
// maps tmq (box rows BM) and tmkv (box rows BN) over qkv as [B][T][H + 2 KV][HD] (coordinates column,
// head, token, batch); rows at t >= T arrive as zeros.
// Shared memory (1024-byte aligned): Q [BM][HD], K [ST][BN][HD], V [ST][BN][HD] (SW128 tiles), then the
// barriers full_q, full_k[ST], full_v[ST], empty_k[ST], empty_v[ST] (8 bytes each).
template <int HD, int NWG, int BN>
__device__ __forceinline__ void attn_fwd_wgmma_ws(const AttTmaMap* tmq, const AttTmaMap* tmkv, u16* __restrict__ out,
                                                  float* __restrict__ lse, int T, int H, int KV, float scale_log2) {
    static_assert(HD == 64 || HD == 128, "head dim 64 or 128");
    static_assert(BN == 64 || BN == 128, "key blocks of 64 or 128");
    static_assert(NWG == 2 || NWG == 3, "two or three consumer warpgroups (the register splits below)");
    constexpr int BM = 64 * NWG, NC = 128 * NWG, ST = ATT_WS_STAGES;
    constexpr u32 QBYTES = BM * HD * 2, KBYTES = BN * HD * 2;
    const u32 raw = att_smem_u32(att_smem);
    const u32 pad = (1024u - (raw & 1023u)) & 1023u;
    const u32 aQ = raw + pad, aK = aQ + QBYTES, aV = aK + ST * KBYTES, aBar = aV + ST * KBYTES;
    u16* sQ = reinterpret_cast<u16*>(att_smem + pad);

    const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7, wq = (tid >> 5) & 3;
    const int g = lane >> 2, q = lane & 3;
    const int bh = blockIdx.x, b = bh / H, h = bh - (bh / H) * H;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BM;
    const int kvh = h / (H / KV);
    const int q_end = min(q0 + BM, T);
    const int nkb = (q_end - 1) / BN + 1;

    att_ws_init_barriers<ST, NWG>(aBar, tid);

    // The register file (64 Ki per SM, one block) split as FlashAttention-3 does: 24 + 2 x 240 per thread
    // for two consumer warpgroups, 24 + 3 x 160 for three (a split asking for more than the pool makes
    // setmaxnreg.inc wait forever).
    constexpr int CONSUMER_REGS = NWG == 2 ? 240 : 160;
    if (tid >= NC) {  // the producer warpgroup
        att_setmaxnreg_dec<24>();
        if (tid == NC) {
            att_mbar_arrive_expect_tx(aBar, QBYTES);
#pragma unroll
            for (int c = 0; c < HD / 64; ++c) att_tma_load_4d(aQ + (u32)c * BM * 128, tmq, 64 * c, h, q0, b, aBar);
            att_ws_produce_kv<HD, BN, ST>(tmkv, aK, aV, aBar + 8u, nkb, H + kvh, H + KV + kvh, b);
        }
        return;
    }

    att_setmaxnreg_inc<CONSUMER_REGS>();
    const int r0 = q0 + 64 * wg;       // the warpgroup's first row
    const int row = r0 + 16 * wq + g;  // the thread's rows: row, row + 8
    const bool active = r0 < T;
    const int jend = active ? min(nkb, (r0 + 63) / BN + 1) : 0;
    const u32 aQw = aQ + (u32)(64 * wg) * 128u;

    float o[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) o[i] = 0.0f;
    float m[2] = {ATT_NEG_INF, ATT_NEG_INF}, l[2] = {0.0f, 0.0f};
    att_mbar_wait(aBar, 0);  // Q
    AttKvTma<HD, BN, ST> kv{aK, aV, aBar + 8u, lane};
    att_wg_fwd_overlapped<HD, BN, BM>(kv, nkb, jend, aQw, r0, wq, row, q, scale_log2, o, m, l);
    if (!active) return;
    att_wg_fwd_store<HD, BM>(o, m, l, sQ, out, lse, bh, b, h, H, T, wg, wq, r0, row, lane, g, q);
}


// =====================================================================================================
// Backward
// =====================================================================================================
// Two organisations, as for mma.sync (attention.cu, attention_separate.cu; same contracts, read those
// first):
// - attn_bwd_wgmma_kv (DQ false): dK and dV only. Grid (B*KV, ceil(T / BN)), NWG warpgroups, BN = 64 NWG
//   keys per block; warpgroup wg owns keys k0 + 64 wg .. + 63 (thread (warp w, g, q): keys k0 + 64 wg +
//   16 w + g and + 8, fragments (3)). The block loops over its group's query heads (increasing) and for
//   each over the query tiles of 64 rows from the diagonal on, one pipeline that crosses from one head to
//   the next, summing dK and dV in registers in that fixed order: deterministic. dQ comes from
//   attn_bwd_wgmma_q below. The pair is the deterministic backward.
// - attn_bwd_wgmma_fused (DQ true, NWG 1): also dQ / scale, added into dq_acc + split * dq_split_stride
//   with vector reductions, with the grid (B*KV, nsplit) and snake order of attn_bwd_mma (the atomic
//   backward: nsplit = the number of key blocks and one buffer).
// Per query tile and warpgroup:
//   batch 1  S^T  = K Q^T        HD/16 wgmma m64n64k16, A = K, B = Q, both K-major
//   batch 2  dP^T = V dO^T       HD/16 wgmma m64n64k16, A = V, B = dO, both K-major
//            P^T = 2^(S^T scale log2e - lse log2e), 0 where key > query or query >= T   (batch 2 in flight)
//   batch 3  dV += P^T dO        4 wgmma m64nHDk16, A = bf16(P^T) from registers, B = dO MN-major
//            dS^T = P^T (dP^T - D)                                                        (batch 3 in flight)
//   batch 4  dK += dS^T Q        4 wgmma m64nHDk16, A = bf16(dS^T) from registers, B = Q MN-major
//   DQ only: dS^T (bf16) -> the SW128 tile sdS [64 keys][64 queries], fenced to the async proxy, barrier;
//   batch 5+ dQ = dS K           per 64 columns of dQ: 4 wgmma m64n64k16 with A = dS read MN-major from sdS
//                                (transpose bit: A(query, key) = sdS[key][query]) and B = K MN-major, waited
//                                for (the first wait covers batches 3 and 4) and added into dq_acc.
// A warpgroup whose keys all lie after the tile's last query skips the tile (its products are zero) but
// passes the barriers. Q and dO (with lse and D) are double-buffered: the copies of tile n + 1 are issued
// after the barrier at the top of tile n, into the buffers of tile n - 1, whose readers all completed
// (every batch is waited for within its tile).
// Shared memory (1024-byte aligned SW128 tiles): K, V [BN][HD]; Q, dO [2][64][HD]; DQ: sdS [64][64] bf16;
// lse, D [2][64] f32.
// Batches 1 to 4 of the dK/dV kernels for one query tile of BM = 64 rows and one warpgroup's 64 keys
// (attn_bwd_wgmma above): S^T and dP^T, P^T (masked where key > query or query >= T), dV += P^T dO, dS^T,
// and dK += dS^T Q issued and left in flight (the caller waits). The same steps as attn_bwd_wgmma's tile
// body, which keeps its own inline copy: extracted there, ptxas spills 12 bytes of its 255-register
// head-dim-128 variant. aKw, aVw: the
// warpgroup's rows of the K and V tiles (column blocks KCB = BN * 128 bytes apart); cQ, cdO: the tile's Q
// and dO (column blocks BM * 128 apart); cL, cD: its lse and D in shared memory; key_a: the thread's first
// key.
// With DS (the fused deterministic backward), dS^T (bf16) also goes to the SW128 tile sdS of DS_ROWS rows
// (keys) and BM columns (queries), the warp's rows at ds_row0 + 16 warp (after batch 4 was issued: its A
// operand is in registers, so the stores overlap it).
template <int HD, int BN, int BM, bool DS = false, int DS_ROWS = 64>
__device__ __forceinline__ void att_wg_kv_tile(u32 aKw, u32 aVw, u32 cQ, u32 cdO, const float* __restrict__ cL,
                                               const float* __restrict__ cD,
                                               int q0, int kw0, int key_a, int T, int q, float scale_log2,
                                               float (&dk)[HD / 2], float (&dv)[HD / 2], u16* sdS = nullptr,
                                               int ds_row0 = 0) {
    constexpr u32 KCB = BN * 128, QCB = BM * 128;
    // Batches 1 and 2: S^T and dP^T.
    float s[BM / 2], dp[BM / 2];
    att_wg_fence_regs<BM / 2>(s);
    att_wg_fence_regs<BM / 2>(dp);
    att_wg_fence();
    att_wg_abt<HD, BM>(s, aKw, KCB, cQ, QCB);
    att_wg_commit();
    att_wg_abt<HD, BM>(dp, aVw, KCB, cdO, QCB);
    att_wg_commit();
    att_wg_wait<1>();
    att_wg_fence_regs<BM / 2>(s);

    // P^T, columns = queries q0 + 8 c + 2 q + e.
#pragma unroll
    for (int c = 0; c < BM / 8; ++c)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float ml = cL[8 * c + 2 * q + e] * ATT_LOG2E;
#pragma unroll
            for (int hr = 0; hr < 2; ++hr)
                s[4 * c + 2 * hr + e] = att_ex2(__fmaf_rn(s[4 * c + 2 * hr + e], scale_log2, -ml));
        }
    if ((q0 < kw0 + 63) || (q0 + BM > T)) {  // warpgroup-uniform: the tile reaches the mask or T
#pragma unroll
        for (int c = 0; c < BM / 8; ++c)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int query = q0 + 8 * c + 2 * q + e;
#pragma unroll
                for (int hr = 0; hr < 2; ++hr)
                    if (key_a + 8 * hr > query || query >= T) s[4 * c + 2 * hr + e] = 0.0f;
            }
    }

    // Batch 3: dV += P^T dO.
    u32 pa[BM / 16][4];
    att_wg_c_to_a<BM>(pa, s);
    att_wg_fence_regs<BM / 16>(pa);
    att_wg_fence_regs<HD / 2>(dv);
    att_wg_fence();
    att_wg_pv<BM, HD>(dv, pa, cdO, QCB);
    att_wg_commit();
    att_wg_wait<1>();  // dP^T (batch 2) done; dV may still run
    att_wg_fence_regs<BM / 2>(dp);

    // dS^T = P^T (dP^T - D), into dp.
#pragma unroll
    for (int c = 0; c < BM / 8; ++c)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float dd = cD[8 * c + 2 * q + e];
#pragma unroll
            for (int hr = 0; hr < 2; ++hr)
                dp[4 * c + 2 * hr + e] = s[4 * c + 2 * hr + e] * (dp[4 * c + 2 * hr + e] - dd);
        }

    // Batch 4: dK += dS^T Q.
    u32 dsa[BM / 16][4];
    att_wg_c_to_a<BM>(dsa, dp);
    att_wg_fence_regs<BM / 16>(dsa);
    att_wg_fence_regs<HD / 2>(dk);
    att_wg_fence();
    att_wg_pv<BM, HD>(dk, dsa, cQ, QCB);
    att_wg_commit();
    if constexpr (DS) {
        const int warp = (threadIdx.x >> 5) & 3, g = (threadIdx.x & 31) >> 2;
#pragma unroll
        for (int kc = 0; kc < BM / 16; ++kc)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int row = ds_row0 + 16 * warp + g + 8 * (r & 1), col = 16 * kc + 8 * (r >> 1) + 2 * q;
                *reinterpret_cast<u32*>(sdS + att_sw128_index<DS_ROWS>(row, col)) = dsa[kc][r];
            }
    }
}

template <int HD, int NWG, bool DQ>
__device__ __forceinline__ void attn_bwd_wgmma(const u16* __restrict__ qkv, const u16* __restrict__ dout,
                                               const float* __restrict__ lse, const float* __restrict__ dvec,
                                               float* __restrict__ dq_acc, u64 dq_split_stride,
                                               u16* __restrict__ dqkv, int T, int H, int KV, float scale,
                                               float scale_log2) {
    static_assert(HD == 64 || HD == 128, "head dim 64 or 128");
    static_assert(NWG == 1 || NWG == 2, "one or two warpgroups");
    static_assert(!DQ || NWG == 1, "the fused dQ step is written for one warpgroup");
    constexpr int BN = 64 * NWG, BM = 64, NT = 128 * NWG;
    constexpr u32 KB = BN * HD * 2;      // bytes of the K (and V) tile
    constexpr u32 QB = BM * HD * 2;      // bytes of one Q (dO) tile
    constexpr u32 KCB = BN * 128;        // bytes between the column blocks of the K and V tiles
    constexpr u32 QCB = BM * 128;        // ... of the Q and dO tiles
    const u32 raw = att_smem_u32(att_smem);
    const u32 pad = (1024u - (raw & 1023u)) & 1023u;
    const u32 aK = raw + pad, aV = aK + KB, aQ = aV + KB, adO = aQ + 2 * QB, adS = adO + 2 * QB;
    unsigned char* base = att_smem + pad;
    u16* sK = reinterpret_cast<u16*>(base);
    u16* sV = reinterpret_cast<u16*>(base + KB);
    u16* sQ = reinterpret_cast<u16*>(base + 2 * KB);
    u16* sdO = reinterpret_cast<u16*>(base + 2 * KB + 2 * QB);
    u16* sdS = reinterpret_cast<u16*>(base + 2 * KB + 4 * QB);
    float* sL = reinterpret_cast<float*>(base + 2 * KB + 4 * QB + (DQ ? 64 * 128 : 0));  // [2][BM]
    float* sD = sL + 2 * BM;                                                          // [2][BM]

    const int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3, wg = tid >> 7;
    const int g = lane >> 2, q = lane & 3;
    const int bkv = blockIdx.x, b = bkv / KV, kvh = bkv - (bkv / KV) * KV;
    const int G = H / KV;
    const int split = blockIdx.y, nsplit = gridDim.y;
    const u64 rs = (u64)(H + 2 * KV) * HD, ors = (u64)H * HD;
    const u64 kv_off = (u64)b * T * rs + (u64)(H + kvh) * HD;
    const int nkb = (T + BN - 1) / BN, nqb = (T + BM - 1) / BM;
    u64 q_off = (u64)b * T * rs + (u64)kvh * G * HD, o_off = (u64)b * T * ors + (u64)kvh * G * HD;
    u64 l_off = ((u64)b * H + (u64)kvh * G) * T;
    float* const acc_base = dq_acc + (u64)split * dq_split_stride;
    const u32 aKw = aK + (u32)(64 * wg) * 128u, aVw = aV + (u32)(64 * wg) * 128u;  // the warpgroup's keys

    for (int round = 0;; ++round) {
        const int j = round * nsplit + ((round & 1) ? nsplit - 1 - split : split);
        if (j >= nkb) break;
        const int k0 = j * BN;
        const int i0 = k0 / BM;  // the first query tile holding a query >= k0
        const int kw0 = k0 + 64 * wg;  // the warpgroup's first key

        att_load_sw128<HD, BN, NT>(sK, qkv + kv_off, rs, k0, T, tid);  // committed with the first tile
        att_load_sw128<HD, BN, NT>(sV, qkv + kv_off + (u64)KV * HD, rs, k0, T, tid);

        float dk[HD / 2], dv[HD / 2];
#pragma unroll
        for (int i = 0; i < HD / 2; ++i) dk[i] = dv[i] = 0.0f;
        const int key_a = kw0 + warp * 16 + g;  // the thread's keys: key_a, key_a + 8

        att_load_sw128<HD, BM, NT>(sQ, qkv + q_off, rs, i0 * BM, T, tid);
        att_load_sw128<HD, BM, NT>(sdO, dout + o_off, ors, i0 * BM, T, tid);
        att_load_vec<BM, NT>(sL, lse + l_off, i0 * BM, T, tid);
        att_load_vec<BM, NT>(sD, dvec + l_off, i0 * BM, T, tid);
        att_cp_commit();
        int i = i0, buf = 0, heads_after = G - 1;
        for (;; buf ^= 1) {
            att_cp_wait<0>();
            att_fence_proxy_async();
            __syncthreads();  // tile `buf` landed for every thread; every batch of the previous tile is done
            if (i + 1 < nqb || heads_after > 0) {
                const int nb = buf ^ 1;
                const bool next_head = i + 1 == nqb;
                const int ni = next_head ? i0 : i + 1;
                const u64 hs = next_head ? (u64)HD : 0, ls = next_head ? (u64)T : 0;
                att_load_sw128<HD, BM, NT>(sQ + nb * (QB / 2), qkv + q_off + hs, rs, ni * BM, T, tid);
                att_load_sw128<HD, BM, NT>(sdO + nb * (QB / 2), dout + o_off + hs, ors, ni * BM, T, tid);
                att_load_vec<BM, NT>(sL + nb * BM, lse + l_off + ls, ni * BM, T, tid);
                att_load_vec<BM, NT>(sD + nb * BM, dvec + l_off + ls, ni * BM, T, tid);
                att_cp_commit();
            }
            const u32 cQ = aQ + (u32)buf * QB, cdO = adO + (u32)buf * QB;
            const float* cL = sL + buf * BM;
            const float* cD = sD + buf * BM;
            const int q0 = i * BM;

            // Warpgroup-uniform: some key of the warpgroup is visible to some query of the tile (never false
            // with DQ: NWG 1 starts at the diagonal tile).
            if (kw0 <= q0 + BM - 1) {
                // Batches 1 and 2: S^T and dP^T.
                float s[BM / 2], dp[BM / 2];
                att_wg_fence_regs<BM / 2>(s);
                att_wg_fence_regs<BM / 2>(dp);
                att_wg_fence();
                att_wg_abt<HD, BM>(s, aKw, KCB, cQ, QCB);
                att_wg_commit();
                att_wg_abt<HD, BM>(dp, aVw, KCB, cdO, QCB);
                att_wg_commit();
                att_wg_wait<1>();
                att_wg_fence_regs<BM / 2>(s);

                // P^T, columns = queries q0 + 8 c + 2 q + e.
#pragma unroll
                for (int c = 0; c < BM / 8; ++c)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float ml = cL[8 * c + 2 * q + e] * ATT_LOG2E;
#pragma unroll
                        for (int hr = 0; hr < 2; ++hr)
                            s[4 * c + 2 * hr + e] = att_ex2(__fmaf_rn(s[4 * c + 2 * hr + e], scale_log2, -ml));
                    }
                if ((q0 < kw0 + 63) || (q0 + BM > T)) {  // warpgroup-uniform: the tile reaches the mask or T
#pragma unroll
                    for (int c = 0; c < BM / 8; ++c)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int query = q0 + 8 * c + 2 * q + e;
#pragma unroll
                            for (int hr = 0; hr < 2; ++hr)
                                if (key_a + 8 * hr > query || query >= T) s[4 * c + 2 * hr + e] = 0.0f;
                        }
                }

                // Batch 3: dV += P^T dO.
                u32 pa[BM / 16][4];
                att_wg_c_to_a<BM>(pa, s);
                att_wg_fence_regs<BM / 16>(pa);
                att_wg_fence_regs<HD / 2>(dv);
                att_wg_fence();
                att_wg_pv<BM, HD>(dv, pa, cdO, QCB);
                att_wg_commit();
                att_wg_wait<1>();  // dP^T (batch 2) done; dV may still run
                att_wg_fence_regs<BM / 2>(dp);

                // dS^T = P^T (dP^T - D), into dp.
#pragma unroll
                for (int c = 0; c < BM / 8; ++c)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float dd = cD[8 * c + 2 * q + e];
#pragma unroll
                        for (int hr = 0; hr < 2; ++hr)
                            dp[4 * c + 2 * hr + e] = s[4 * c + 2 * hr + e] * (dp[4 * c + 2 * hr + e] - dd);
                    }

                // Batch 4: dK += dS^T Q.
                u32 dsa[BM / 16][4];
                att_wg_c_to_a<BM>(dsa, dp);
                att_wg_fence_regs<BM / 16>(dsa);
                att_wg_fence_regs<HD / 2>(dk);
                att_wg_fence();
                att_wg_pv<BM, HD>(dk, dsa, cQ, QCB);
                att_wg_commit();

                if constexpr (DQ) {
                    // dS^T to sdS (row = key, column = query), the bf16 pairs of dsa at their SW128 positions.
#pragma unroll
                    for (int kc = 0; kc < BM / 16; ++kc)
#pragma unroll
                        for (int r = 0; r < 4; ++r) {
                            const int row = 16 * warp + g + 8 * (r & 1), col = 16 * kc + 8 * (r >> 1) + 2 * q;
                            *reinterpret_cast<u32*>(sdS + att_sw128_index<BN>(row, col)) = dsa[kc][r];
                        }
                    att_fence_proxy_async();
                    __syncthreads();  // sdS complete (the block is this one warpgroup)

                    // Batch 5 (and 6): dQ[:, 64 c .. 64 c + 63] = dS K, one 64-column half at a time (both
                    // at once would hold 64 more registers where HD = 128 has none left), each waited for
                    // and added into dq_acc.
#pragma unroll
                    for (int c = 0; c < HD / 64; ++c) {
                        float dq[32];
                        att_wg_fence_regs<32>(dq);
                        att_wg_fence();
#pragma unroll
                        for (int kc = 0; kc < BN / 16; ++kc)
                            AttWgmma<64>::ss_tt(dq, att_wg_desc(adS + (u32)kc * 2048u, KCB, 1024u),
                                                att_wg_desc(aK + (u32)c * KCB + (u32)kc * 2048u, KCB, 1024u),
                                                kc > 0 ? 1 : 0);
                        att_wg_commit();
                        att_wg_wait<0>();
                        att_wg_fence_regs<32>(dq);
#pragma unroll
                        for (int hr = 0; hr < 2; ++hr) {
                            const int row = q0 + 16 * warp + g + 8 * hr;
                            if (row < T) {
                                float* acc = acc_base + o_off + (u64)row * ors + 64 * c + 2 * q;
#pragma unroll
                                for (int n = 0; n < 8; ++n)
                                    att_red_add2(acc + 8 * n, dq[4 * n + 2 * hr], dq[4 * n + 2 * hr + 1]);
                            }
                        }
                    }
                } else {
                    att_wg_wait<0>();
                }
                att_wg_fence_regs<HD / 2>(dv);
                att_wg_fence_regs<HD / 2>(dk);
            }
            if (++i == nqb) {
                q_off += HD, o_off += HD, l_off += T;
                if (heads_after-- == 0) break;
                i = i0;
            }
        }
        q_off -= (u64)G * HD, o_off -= (u64)G * HD, l_off -= (u64)G * T;

        // dK (times scale) and dV to dqkv, staged in the warp's own rows of sK / sV (every wgmma reading them
        // completed), 16 bytes at a time.
        __syncthreads();
        const int srow = 64 * wg + 16 * warp;
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
#pragma unroll
            for (int n = 0; n < HD / 8; ++n) {
                const int idx = att_sw128_index<BN>(srow + g + 8 * hr, 8 * n + 2 * q);
                *reinterpret_cast<u32*>(sK + idx) = att_pack_bf16(dk[4 * n + 2 * hr] * scale, dk[4 * n + 2 * hr + 1] * scale);
                *reinterpret_cast<u32*>(sV + idx) = att_pack_bf16(dv[4 * n + 2 * hr], dv[4 * n + 2 * hr + 1]);
            }
        __syncwarp();
        constexpr int CH = HD / 8;
#pragma unroll
        for (int c = lane; c < 16 * CH; c += 32) {
            const int r = c / CH, k = c - (c / CH) * CH;
            const int t = k0 + srow + r;
            if (t < T) {
                const int idx = att_sw128_index<BN>(srow + r, 8 * k);
                *reinterpret_cast<uint4*>(dqkv + kv_off + (u64)t * rs + k * 8) = *reinterpret_cast<const uint4*>(sK + idx);
                *reinterpret_cast<uint4*>(dqkv + kv_off + (u64)KV * HD + (u64)t * rs + k * 8) =
                    *reinterpret_cast<const uint4*>(sV + idx);
            }
        }
        __syncthreads();  // before the next key block's copies overwrite the tiles
    }
}

// The producer steps of the warp-specialised dK/dV kernel and the ordered backward (lane 0 issues the
// TMA loads). K and V of the block's BN keys once, against barrier `bar` (tensor map tkv; column blocks
// BN * 128 bytes apart):
template <int HD, int BN>
__device__ __forceinline__ void att_ws_load_kv_once(const AttTmaMap* tkv, u32 aK, u32 aV, u32 bar, int H, int KV,
                                                    int kvh, int k0, int b, int lane) {
    if (lane != 0) return;
    att_mbar_arrive_expect_tx(bar, 2 * BN * HD * 2);
#pragma unroll
    for (int c = 0; c < HD / 64; ++c) {
        att_tma_load_4d(aK + (u32)c * BN * 128, tkv, 64 * c, H + kvh, k0, b, bar);
        att_tma_load_4d(aV + (u32)c * BN * 128, tkv, 64 * c, H + KV + kvh, k0, b, bar);
    }
}
// ... and query tile i of head h as the walk's tile n into stage n % ST: after the consumers released
// the stage's previous tile (empty phase n / ST - 1), the warp writes its lse and D rows (zeros past T)
// with ordinary stores, then lane 0 loads Q and dO (tensor maps tq, tdo) against the stage's full barrier.
// Barriers at aBar: full_kv, full[ST], empty[ST].
template <int HD, int BM, int ST>
__device__ __forceinline__ void att_ws_produce_q_tile(const AttTmaMap* tq, const AttTmaMap* tdo,
                                                      const float* __restrict__ lse, const float* __restrict__ dvec,
                                                      float* sL, float* sD, u32 aQ, u32 adO, u32 aBar, int n, int i,
                                                      int h, int b, int H, int T, int lane) {
    constexpr u32 QB = BM * HD * 2;
    const int st = n % ST;
    const float* gL = lse + ((u64)b * H + h) * T;
    const float* gD = dvec + ((u64)b * H + h) * T;
    if (n >= ST) att_mbar_wait(aBar + 8u * (1 + ST + st), (u32)(n / ST - 1) & 1u);
    for (int r = lane; r < BM; r += 32) {
        const int t = i * BM + r;
        sL[st * BM + r] = t < T ? gL[t] : 0.0f;
        sD[st * BM + r] = t < T ? gD[t] : 0.0f;
    }
    __syncwarp();  // the warp's lse and D writes before lane 0's arrival (release)
    if (lane == 0) {
        const u32 full = aBar + 8u * (1 + st);
        att_mbar_arrive_expect_tx(full, 2 * QB);
#pragma unroll
        for (int c = 0; c < HD / 64; ++c) {
            att_tma_load_4d(aQ + (u32)st * QB + (u32)c * BM * 128, tq, 64 * c, h, i * BM, b, full);
            att_tma_load_4d(adO + (u32)st * QB + (u32)c * BM * 128, tdo, 64 * c, h, i * BM, b, full);
        }
    }
}

// The warp-specialised dK/dV kernels' end: dK (times scale) and dV to dqkv, staged in the warp's own rows
// (64 wg + 16 warp ..) of the K and V tiles (BN rows), 16 bytes at a time, rows < T only.
template <int HD, int BN>
__device__ __forceinline__ void att_ws_store_dkdv(const float (&dk)[HD / 2], const float (&dv)[HD / 2], u16* sK,
                                                  u16* sV, u16* __restrict__ dqkv, int b, int kvh, int k0, int T,
                                                  int H, int KV, float scale, int wg, int warp, int lane) {
    const int srow = 64 * wg + 16 * warp, g = lane >> 2, q = lane & 3;
    const u64 rs = (u64)(H + 2 * KV) * HD;
    const float dk_mul[2] = {scale, scale}, dv_mul[2] = {1.0f, 1.0f};
    att_wg_stage_rows<HD, BN>(dk, dk_mul, sK, srow, g, q);
    att_wg_stage_rows<HD, BN>(dv, dv_mul, sV, srow, g, q);
    u16* gdK = dqkv + (u64)b * T * rs + (u64)(H + kvh) * HD;
    att_wg_store_rows<HD, BN>(sK, srow, gdK, rs, k0 + srow, T, lane);
    att_wg_store_rows<HD, BN>(sV, srow, gdK + (u64)KV * HD, rs, k0 + srow, T, lane);
}

// The dK/dV kernel with warp specialisation (the deterministic backward's first kernel, as attn_bwd_wgmma
// with DQ false): grid (B*KV, ceil(T / BN)), NWG consumer warpgroups of 64 keys each (BN = 64 NWG) and a
// producer warpgroup. The producer's first thread loads the block's K and V once (tensor map tkv, boxes
// of BN rows) and then, per query tile of the block's walk (the group's query heads in order, for each
// the tiles of 64 rows from the diagonal on), Q and dO into stage n % ST (tq over qkv, tdo over dout,
// boxes of 64 rows), after its first warp wrote the tile's lse and D into the stage with ordinary loads
// (TMA would need 16-byte aligned rows of lse, which T does not guarantee) and synchronised with it. The
// consumers run batches 1-4 per tile (att_wg_kv_tile) and release the stage when batch 4 completed; a
// warpgroup whose keys lie after the tile's last query releases it unread. dK and dV sum over the tiles in
// that fixed order: deterministic, the same bits as attn_bwd_wgmma.
// Shared memory (1024-byte aligned): K, V [BN][HD]; Q, dO [ST][64][HD] (SW128 tiles); lse, D [ST][64] f32;
// the barriers full_kv, full[ST], empty[ST].
template <int HD, int NWG>
__device__ __forceinline__ void attn_bwd_kv_wgmma_ws(const AttTmaMap* tkv, const AttTmaMap* tq, const AttTmaMap* tdo,
                                                     const float* __restrict__ lse, const float* __restrict__ dvec,
                                                     u16* __restrict__ dqkv, int T, int H, int KV, float scale,
                                                     float scale_log2) {
    static_assert(HD == 64 || HD == 128, "head dim 64 or 128");
    static_assert(NWG == 2, "two consumer warpgroups (the register split is for three)");
    constexpr int BN = 64 * NWG, BM = 64, NC = 128 * NWG, ST = ATT_KV_WS_STAGES(HD);
    constexpr u32 KB = BN * HD * 2, QB = BM * HD * 2;
    const u32 raw = att_smem_u32(att_smem);
    const u32 pad = (1024u - (raw & 1023u)) & 1023u;
    const u32 aK = raw + pad, aV = aK + KB, aQ = aV + KB, adO = aQ + ST * QB;
    unsigned char* base = att_smem + pad;
    u16* sK = reinterpret_cast<u16*>(base);
    u16* sV = reinterpret_cast<u16*>(base + KB);
    float* sL = reinterpret_cast<float*>(base + 2 * KB + 2 * ST * QB);  // [ST][BM]
    float* sD = sL + ST * BM;                                            // [ST][BM]
    const u32 aBar = aQ + 2 * ST * QB + 2 * ST * BM * 4;  // full_kv, full[ST], empty[ST]

    const int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3, wg = tid >> 7;
    const int g = lane >> 2, q = lane & 3;
    const int bkv = blockIdx.x, b = bkv / KV, kvh = bkv - (bkv / KV) * KV;
    const int G = H / KV;
    const int nqb = (T + BM - 1) / BM;
    const int k0 = blockIdx.y * BN;
    const int i0 = k0 / BM;  // the first query tile holding a query >= k0

    if (tid == 0) {
        att_mbar_init(aBar, 1);
        for (int i = 0; i < ST; ++i) att_mbar_init(aBar + 8u * (1 + i), 1);
        for (int i = 0; i < ST; ++i) att_mbar_init(aBar + 8u * (1 + ST + i), 4 * NWG);
        att_mbar_init_fence();
    }
    __syncthreads();

    if (tid >= NC) {  // the producer warpgroup; its first warp works
        att_setmaxnreg_dec<24>();
        if (tid >= NC + 32) return;
        att_ws_load_kv_once<HD, BN>(tkv, aK, aV, aBar, H, KV, kvh, k0, b, lane);
        int n = 0;
        for (int hh = 0; hh < G; ++hh)
            for (int i = i0; i < nqb; ++i, ++n)
                att_ws_produce_q_tile<HD, BM, ST>(tq, tdo, lse, dvec, sL, sD, aQ, adO, aBar, n, i, kvh * G + hh, b,
                                                  H, T, lane);
        return;
    }

    att_setmaxnreg_inc<240>();
    const int kw0 = k0 + 64 * wg;  // the warpgroup's first key
    const int key_a = kw0 + warp * 16 + g;
    const u32 aKw = aK + (u32)(64 * wg) * 128u, aVw = aV + (u32)(64 * wg) * 128u;
    float dk[HD / 2], dv[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) dk[i] = dv[i] = 0.0f;
    att_mbar_wait(aBar, 0);  // K and V
    int n = 0;
    for (int hh = 0; hh < G; ++hh) {
        for (int i = i0; i < nqb; ++i, ++n) {
            const int st = n % ST;
            att_mbar_wait(aBar + 8u * (1 + st), (u32)(n / ST) & 1u);
            const int q0 = i * BM;
            if (kw0 <= q0 + BM - 1) {  // warpgroup-uniform: some key is visible to some query of the tile
                att_wg_kv_tile<HD, BN, BM>(aKw, aVw, aQ + (u32)st * QB, adO + (u32)st * QB, sL + st * BM,
                                           sD + st * BM, q0, kw0, key_a, T, q, scale_log2, dk, dv);
                att_wg_wait<0>();
                att_wg_fence_regs<HD / 2>(dv);
                att_wg_fence_regs<HD / 2>(dk);
            }
            if (lane == 0) att_mbar_arrive(aBar + 8u * (1 + ST + st));
        }
    }

    // dK (times scale) and dV to dqkv, staged in the warp's own rows of sK and sV (only this warpgroup's
    // wgmma read them, and they completed).
    att_ws_store_dkdv<HD, BN>(dk, dv, sK, sV, dqkv, b, kvh, k0, T, H, KV, scale, wg, warp, lane);
}

// Bytes of attn_bwd_kv_wgmma_ws's shared memory: K, V [64 NWG][HD]; Q, dO [ST][64][HD]; lse, D [ST][64]
// f32; 1 + 2 ST barriers; the alignment.
#define ATT_WG_KV_WS_SMEM(HD, NWG) \
    ((2 * 64 * (NWG) + 2 * ATT_KV_WS_STAGES(HD) * 64) * (HD) * 2 + 2 * ATT_KV_WS_STAGES(HD) * 64 * 4 + \
     (1 + 2 * ATT_KV_WS_STAGES(HD)) * 8 + 1024)

// Bytes of attn_bwd_wgmma's shared memory (the host's figures must match): the K and V tiles of 64 NWG
// rows, Q and dO [2][64][HD], sdS with DQ, lse and D, and the 1024-byte alignment.
#define ATT_WG_BWD_SMEM(HD, NWG, DQ) ((2 * 64 * (NWG) + 4 * 64) * (HD) * 2 + ((DQ) ? 64 * 128 : 0) + 4 * 64 * 4 + 1024)

// -----------------------------------------------------------------------------------------------------
// The fused deterministic backward, attn_bwd_wgmma_ordered_hd<HD>: dK, dV and dQ in one kernel, five
// products per tile pair where the pair of kernels above needs seven, FlashAttention-3's organisation with
// its deterministic dQ. Grid (B*KV, ceil(T / 128)); block (bkv, n) holds keys k0 = 128 n .. k0 + 127 in
// two consumer warpgroups of 64 (warpgroup 0 the lower keys) and a producer warpgroup, as
// attn_bwd_kv_wgmma_ws. It walks the query tiles of 64 rows in decreasing order, i = nqb - 1 down to
// k0 / 64, and for each tile the group's query heads in increasing order (heads inner: every block
// reaches tile (h, i) after the same number of steps from its start). Per tile and consumer warpgroup:
//   batches 1-4  as att_wg_kv_tile (S^T, dP^T, dV += P^T dO, dK += dS^T Q); dS^T (bf16) also to the
//                warpgroup's 64 rows of the SW128 tile sdS [128 keys][64 queries]
//   batch 5      per 64-column half c of dQ: dQ_w = dS_w K_w over the warpgroup's 64 keys, 4 wgmma
//                m64n64k16 with A = sdS read MN-major (A(query, key) = sdS[key][query]) and B = K read
//                MN-major, waited for
//   combine      step n uses sdQ buffer n % DQS (ATT_WG_ORDERED_DQS: 3 at head dim 64, 2 at 128):
//                warpgroup 0 stores dQ_0 into that f32 tile (once the buffer's writer has read its
//                previous tile: dq_empty) and arrives on dq_half; warpgroup 1 waits for it, stores
//                dQ_0 + dQ_1 and arrives on dq_full
// The buffer's dQ writer, warp 1 + (n % DQS) of the producer warpgroup, then adds it into the f32
// accumulator tile of (b, h, i) in global memory with one bulk reduction (key block 0: a bulk copy), in
// key-block order: its first lane waits until the tile's counter equals the block's key-block index
// (ld.acquire.gpu), reduces, frees the buffer as soon as the reduction has read it, waits for the
// reduction's writes, and increments the counter (red.release.gpu). With a writer per buffer and the
// early free the consumers wait neither for a reduction's writes nor for a turn while another buffer is
// free. (H100, llama-8b's shape, 2026-12-07: one buffer freed after the writes 3.67 ms, two freed once
// read 3.27 ms, a writer per buffer 3.23 ms.) Every dQ element is thus ((dQ(block 0) + dQ(block 1)) + ...)
// in key-block order, each block's part (dQ_0 + dQ_1) summed in a fixed order too: the same bits on every
// run. A block waits only for lower key blocks, which the grid launches first (blockIdx.y = n) and whose
// walks hold this block's tiles, in the same order, before their own last ones: a waiting block never
// waits for one that has not started, and in a full wave all blocks reach a tile together.
// The accumulator holds per (b, h, i) (tile index (b * H + h) * nqb + i) 64 x HD f32 in sdQ's order,
// the consumer threads' dQ registers as they hold them: element ((c * 4 + w) * 8 + r4) * 128 + 4 lane + j
// is register 4 r4 + j of half c of lane `lane` of warp w (row 16 w + lane / 4 + 8 (j / 2), column
// 64 c + 8 r4 + 2 (lane % 4) + j % 2), 16-byte stores without bank conflicts; attn_bwd_dq_tiles_convert
// (attention_rows.cu) writes dQ * scale from it. Accumulator and counters are zero at launch.
// Shared memory (1024-byte aligned): K, V [128][HD]; Q, dO [ST][64][HD]; sdS [128][64] bf16 (SW128
// tiles); sdQ [DQS][64 HD] f32; lse, D [ST][64] f32; the barriers full_kv, full[ST], empty[ST], then
// dq_half, dq_full, dq_empty per sdQ buffer.
// The ordered backward's sdQ buffers and dQ writer warps: 3 at head dim 64 (every spare warp of the
// producer warpgroup), 2 at 128 (a third does not fit in shared memory).
#define ATT_WG_ORDERED_DQS(HD) ((HD) == 64 ? 3 : 2)
template <int HD, bool COLS>
__device__ __forceinline__ void attn_bwd_ordered_wgmma(const AttTmaMap* tkv, const AttTmaMap* tq,
                                                       const AttTmaMap* tdo, const float* __restrict__ lse,
                                                       const float* __restrict__ dvec, float* __restrict__ dq_acc,
                                                       u32* __restrict__ dq_turn, u16* __restrict__ dqkv, int T,
                                                       int H, int KV, float scale, float scale_log2) {
    static_assert(HD == 64 || HD == 128, "head dim 64 or 128");
    static_assert(!COLS || HD == 128, "dQ's columns split between the warpgroups at head dim 128 only");
    constexpr int NWG = 2, BN = 128, BM = 64, NC = 256, ST = ATT_KV_WS_STAGES(HD);
    constexpr u32 KB = BN * HD * 2, QB = BM * HD * 2, KCB = BN * 128, DSB = BN * BM * 2, DQB = BM * HD * 4;
    constexpr int DQS = ATT_WG_ORDERED_DQS(HD);  // sdQ buffers, each with its own writer warp
    const u32 raw = att_smem_u32(att_smem);
    const u32 pad = (1024u - (raw & 1023u)) & 1023u;
    const u32 aK = raw + pad, aV = aK + KB, aQ = aV + KB, adO = aQ + ST * QB, adS = adO + ST * QB,
              adQ = adS + DSB;
    unsigned char* base = att_smem + pad;
    u16* sK = reinterpret_cast<u16*>(base);
    u16* sV = reinterpret_cast<u16*>(base + KB);
    u16* sdS = reinterpret_cast<u16*>(base + 2 * KB + 2 * ST * QB);
    float* sdQ = reinterpret_cast<float*>(base + 2 * KB + 2 * ST * QB + DSB);
    float* sL = reinterpret_cast<float*>(base + 2 * KB + 2 * ST * QB + DSB + DQS * DQB);  // [ST][BM]
    float* sD = sL + ST * BM;                                                            // [ST][BM]
    // full_kv, full[ST], empty[ST], then per sdQ buffer dq_half, dq_full, dq_empty
    const u32 aBar = adQ + DQS * DQB + 2 * ST * BM * 4;
    const u32 dq_bars = aBar + 8u * (1 + 2 * ST);
    // sdQ buffer d's barriers: warpgroup 0's part stored, the sum stored, the writer has read it.
    auto dq_half = [dq_bars](int d) { return dq_bars + 24u * (u32)d; };
    auto dq_full = [dq_bars](int d) { return dq_bars + 24u * (u32)d + 8u; };
    auto dq_empty = [dq_bars](int d) { return dq_bars + 24u * (u32)d + 16u; };

    const int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3, wg = tid >> 7;
    const int g = lane >> 2, q = lane & 3;
    const int bkv = blockIdx.x, b = bkv / KV, kvh = bkv - (bkv / KV) * KV;
    const int G = H / KV;
    const int nqb = (T + BM - 1) / BM;
    const int kb = blockIdx.y, k0 = kb * BN;
    const int i0 = k0 / BM;  // the last query tile of the walk: the first holding a query >= k0

    if (tid == 0) {
        att_mbar_init(aBar, 1);
        for (int s = 0; s < ST; ++s) att_mbar_init(aBar + 8u * (1 + s), 1);
        for (int s = 0; s < ST; ++s) att_mbar_init(aBar + 8u * (1 + ST + s), 4 * NWG);
        for (int d = 0; d < DQS; ++d) {
            att_mbar_init(dq_half(d), 4);
            att_mbar_init(dq_full(d), COLS ? 8 : 4);  // COLS: every warp of both warpgroups
            att_mbar_init(dq_empty(d), 1);
        }
        att_mbar_init_fence();
    }
    __syncthreads();

    if (tid >= NC) {  // the producer warpgroup: warp 0 loads, warps 1 .. DQS write dQ
        // The block's pool is 168 registers per thread (the launch bounds' most for 384 threads), 504 per
        // thread of a warpgroup triple: 2 x 232 for the consumers and 40 here (with 24 the two loops
        // spill). A split asking for more than the pool makes setmaxnreg.inc wait forever.
        att_setmaxnreg_dec<40>();
        if (tid >= NC + 32 * (1 + DQS)) return;
        if (tid < NC + 32) {
            att_ws_load_kv_once<HD, BN>(tkv, aK, aV, aBar, H, KV, kvh, k0, b, lane);
            int n = 0;
            for (int i = nqb - 1; i >= i0; --i)
                for (int hh = 0; hh < G; ++hh, ++n)
                    att_ws_produce_q_tile<HD, BM, ST>(tq, tdo, lse, dvec, sL, sD, aQ, adO, aBar, n, i, kvh * G + hh,
                                                      b, H, T, lane);
            return;
        }
        // The dQ writer of buffer d: the steps n with n % DQS = d. A writer's reductions are serial (a
        // turn, the reduction, its writes, the next block's turn); one writer for every step was the
        // kernel's bottleneck at short steps.
        const int d = ((tid - NC) >> 5) - 1;
        const u32 adQn = adQ + (u32)d * DQB;
        int n = 0;
        for (int i = nqb - 1; i >= i0; --i)
            for (int hh = 0; hh < G; ++hh, ++n) {
                if (n % DQS != d) continue;
                att_mbar_wait(dq_full(d), (u32)(n / DQS) & 1u);
                if (lane == 0) {
                    const u64 tile = ((u64)b * H + kvh * G + hh) * nqb + i;
                    u32* turn = dq_turn + tile;
                    // A turn that never comes (a lower block that cannot run) is an error after 2^28
                    // polls, seconds at least, rather than a hang of the whole process.
                    for (u32 polls = 0; att_ld_acquire_gpu(turn) != (u32)kb;)
                        if (++polls == (1u << 28)) att_trap();
                    att_fence_proxy_async_global();
                    // Key block 0 comes first at every tile: it stores, so the accumulator needs no clearing.
                    if (kb == 0)
                        att_bulk_store(dq_acc + tile * (u64)(BM * HD), adQn, DQB);
                    else
                        att_bulk_reduce_add_f32(dq_acc + tile * (u64)(BM * HD), adQn, DQB);
                    att_bulk_commit();
                    // The buffer is free once read; the next block's turn waits for the writes. (Freeing
                    // it only after the writes cost a quarter of the kernel's time at llama-8b's shape.)
                    att_bulk_wait_read_all();
                    att_mbar_arrive(dq_empty(d));
                    att_bulk_wait_all();
                    att_fence_proxy_async_global();
                    att_red_release_gpu_add(turn, 1u);
                }
                __syncwarp();
            }
        return;
    }

    att_setmaxnreg_inc<232>();
    const int kw0 = k0 + 64 * wg;  // the warpgroup's first key
    const int key_a = kw0 + warp * 16 + g;
    const u32 aKw = aK + (u32)(64 * wg) * 128u, aVw = aV + (u32)(64 * wg) * 128u;
    // In sdQ buffer d: half c, quad r4 at + d * DQB / 16 + (c * 4 * 8 + r4) * 32.
    float4* dq_mine = reinterpret_cast<float4*>(sdQ) + warp * 8 * 32 + lane;
    float dk[HD / 2], dv[HD / 2];
#pragma unroll
    for (int x = 0; x < HD / 2; ++x) dk[x] = dv[x] = 0.0f;
    att_mbar_wait(aBar, 0);  // K and V
    int n = 0;
    for (int i = nqb - 1; i >= i0; --i)
        for (int hh = 0; hh < G; ++hh, ++n) {
            const int st = n % ST;
            att_mbar_wait(aBar + 8u * (1 + st), (u32)(n / ST) & 1u);
            const int q0 = i * BM;
            const bool visible = kw0 <= q0 + BM - 1;  // warpgroup-uniform (always true for warpgroup 0)
            if (visible) {
                att_wg_kv_tile<HD, BN, BM, true, BN>(aKw, aVw, aQ + (u32)st * QB, adO + (u32)st * QB, sL + st * BM,
                                                     sD + st * BM, q0, kw0, key_a, T, q, scale_log2, dk, dv, sdS,
                                                     64 * wg);
                // Batches 3 and 4 complete before dQ's products are issued: their A fragments (P^T, dS^T)
                // stay live until then, and with dQ's accumulators beside dK and dV at head dim 128 that
                // spills.
                att_wg_wait<0>();
                att_wg_fence_regs<HD / 2>(dv);
                att_wg_fence_regs<HD / 2>(dk);
                att_fence_proxy_async();
                if constexpr (!COLS) att_bar_sync(1 + wg, 128);  // the warpgroup's rows of sdS complete
            } else if constexpr (COLS) {
                // Warpgroup 1 sees no query of the tile: its 64 rows of sdS (bytes 8192 .. 16383) hold
                // zeros for the other warpgroup's dQ products (64 bytes per thread).
                float4* rows = reinterpret_cast<float4*>(reinterpret_cast<unsigned char*>(sdS) + DSB / 2);
#pragma unroll
                for (int x = 0; x < 4; ++x) rows[(tid - 128) * 4 + x] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                att_fence_proxy_async();
            }
            if constexpr (COLS) {
                // Both warpgroups' rows of sdS complete (an idle warpgroup 1's zeroed above).
                att_bar_sync(3, 256);
                if (lane == 0) att_mbar_arrive(aBar + 8u * (1 + ST + st));  // Q and dO read
                // dQ's columns 64 wg .. 64 wg + 63 over the block's 128 keys: 8 wgmma m64n64k16, A = sdS
                // MN-major, B = K MN-major. (One straight-line chain: a data-dependent length makes ptxas
                // serialise it, hence the zeroed rows of an idle warpgroup 1.)
                float dq[32];
                att_wg_fence_regs<32>(dq);
                att_wg_fence();
#pragma unroll
                for (int kc = 0; kc < 8; ++kc) {
                    const u32 krow = (u32)(16 * kc) * 128u;
                    AttWgmma<64>::ss_tt(dq, att_wg_desc(adS + krow, DSB, 1024u),
                                        att_wg_desc(aK + (u32)wg * KCB + krow, KCB, 1024u), kc > 0 ? 1 : 0);
                }
                att_wg_commit();
                att_wg_wait<0>();
                att_wg_fence_regs<32>(dq);
                // Every warp of both warpgroups has waited for its part of the products: sdS and K rows
                // may be overwritten (the next tile's dS^T, the dK staging) by either warpgroup.
                att_bar_sync(4, 256);
                const int d = n % DQS;
                float4* dst = dq_mine + d * (DQB / 16) + wg * 4 * 8 * 32;
                // Buffer d's previous step, n - DQS, was read by the writer.
                if (n >= DQS) att_mbar_wait(dq_empty(d), (u32)(n / DQS - 1) & 1u);
#pragma unroll
                for (int r4 = 0; r4 < 8; ++r4)
                    dst[r4 * 32] = make_float4(dq[4 * r4], dq[4 * r4 + 1], dq[4 * r4 + 2], dq[4 * r4 + 3]);
                att_fence_proxy_async();  // the warp's part of sdQ before the writer's bulk reduction reads it
                __syncwarp();
                if (lane == 0) att_mbar_arrive(dq_full(d));
            } else {
                if (lane == 0) att_mbar_arrive(aBar + 8u * (1 + ST + st));  // Q and dO read
#pragma unroll
                for (int c = 0; c < HD / 64; ++c) {
                    float dq[32];
                    if (visible) {
                        att_wg_fence_regs<32>(dq);
                        att_wg_fence();
#pragma unroll
                        for (int kc = 0; kc < 4; ++kc) {
                            const u32 krow = (u32)(64 * wg + 16 * kc) * 128u;
                            AttWgmma<64>::ss_tt(dq, att_wg_desc(adS + krow, DSB, 1024u),
                                                att_wg_desc(aK + (u32)c * KCB + krow, KCB, 1024u), kc > 0 ? 1 : 0);
                        }
                        att_wg_commit();
                        att_wg_wait<0>();
                        att_wg_fence_regs<32>(dq);
                    } else {
#pragma unroll
                        for (int x = 0; x < 32; ++x) dq[x] = 0.0f;
                    }
                    const int d = n % DQS;
                    float4* dst = dq_mine + d * (DQB / 16) + c * 4 * 8 * 32;
                    if (wg == 0) {
                        // Buffer d's previous step, n - DQS, was read by the writer.
                        if (c == 0 && n >= DQS) att_mbar_wait(dq_empty(d), (u32)(n / DQS - 1) & 1u);
#pragma unroll
                        for (int r4 = 0; r4 < 8; ++r4)
                            dst[r4 * 32] = make_float4(dq[4 * r4], dq[4 * r4 + 1], dq[4 * r4 + 2], dq[4 * r4 + 3]);
                    } else {
                        if (c == 0) att_mbar_wait(dq_half(d), (u32)(n / DQS) & 1u);
#pragma unroll
                        for (int r4 = 0; r4 < 8; ++r4) {
                            const float4 p = dst[r4 * 32];
                            dst[r4 * 32] = make_float4(p.x + dq[4 * r4], p.y + dq[4 * r4 + 1], p.z + dq[4 * r4 + 2],
                                                       p.w + dq[4 * r4 + 3]);
                        }
                    }
                }
                if (wg == 1) att_fence_proxy_async();  // sdQ's sums before the writer's bulk reduction reads them
                __syncwarp();
                if (lane == 0) att_mbar_arrive(wg == 0 ? dq_half(n % DQS) : dq_full(n % DQS));
            }
        }

    // dK (times scale) and dV to dqkv, staged in the warp's own rows of sK and sV. Every warp of the
    // warpgroup read all 64 of its K rows as dQ's B operand, and a warp's wait covers only its own part
    // of a wgmma: the warpgroup passes a barrier before any warp overwrites them. (The emulator, which
    // completes a late wgmma per thread at its own wait, caught the missing barrier.) With COLS every
    // step ended with a barrier of both warpgroups after their products.
    if constexpr (!COLS) att_bar_sync(1 + wg, 128);
    att_ws_store_dkdv<HD, BN>(dk, dv, sK, sV, dqkv, b, kvh, k0, T, H, KV, scale, wg, warp, lane);
}

// Bytes of attn_bwd_ordered_wgmma's shared memory: K, V [128][HD]; Q, dO [ST][64][HD]; sdS [128][64] bf16;
// sdQ [DQS][64][HD] f32; lse, D [ST][64] f32; 1 + 2 ST + 3 DQS barriers; the alignment.
#define ATT_WG_ORDERED_SMEM(HD)                                                                            \
    ((2 * 128 + 2 * ATT_KV_WS_STAGES(HD) * 64) * (HD) * 2 + 128 * 64 * 2 +                                \
     ATT_WG_ORDERED_DQS(HD) * 64 * (HD) * 4 + 2 * ATT_KV_WS_STAGES(HD) * 64 * 4 +                         \
     (1 + 3 * ATT_WG_ORDERED_DQS(HD) + 2 * ATT_KV_WS_STAGES(HD)) * 8 + 1024)

// -----------------------------------------------------------------------------------------------------
// dQ of the deterministic backward. Grid (B*H, ceil(T / BM)), BM = 64 NWG query rows per block of NWG
// warpgroups, the last query block first; the forward's layout (attn_fwd_wgmma): warpgroup wg owns rows
// q0 + 64 wg .. + 63, thread rows `row` and row + 8; key and value blocks of BN keys streamed through
// shared memory. Per key block j and warpgroup:
//   batch 1  S  = Q K^T           HD/16 wgmma m64nBNk16, A = Q, B = K, both K-major
//   batch 2  dP = dO V^T          HD/16 wgmma m64nBNk16, A = dO, B = V, both K-major
//            P = 2^(S scale log2e - lse log2e), 0 where key > row; dS = P (dP - D)
//   batch 3  dQ += dS K           BN/16 wgmma m64nHDk16, A = bf16(dS) from registers, B = K MN-major
// in one of two schedules, as the forward's:
// - PIPE false: each batch waited for before its result is used; K and V have two buffers.
// - PIPE true: iteration j issues S_j and dP_j and then dQ += dS_{j-1} K_{j-1} (dS_{j-1} kept in registers
//   from iteration j - 1), waits for S_j and dP_j only (wgmma.wait_group 1: batches complete in order),
//   computes P_j and dS_j while dQ's product runs, then waits for it before dS_j replaces dS_{j-1} in the
//   A registers; the warpgroup's last block issues its own dQ product and waits. K_{j-1} is read during
//   iteration j, so K has three buffers (block j + 1's copy, issued in iteration j, goes to the buffer of
//   block j - 2, whose last reader completed in iteration j - 1); V keeps two. Block 0 is peeled, so no
//   product in the loop depends on j > 0.
// Each dQ element is summed by one thread over the key blocks in order (both schedules add the same
// products in the same order: the same bits): deterministic. At the end dQ * scale goes to the q slot of
// dqkv through the warpgroup's own rows of the Q tile.
// Shared memory (1024-byte aligned SW128 tiles): Q, dO [BM][HD]; K [2 or 3][BN][HD]; V [2][BN][HD].
// One warpgroup's dQ over its key blocks 0 .. jend - 1 of the block's nkb (either schedule above), key and
// value tiles through the hooks kv (as att_wg_fwd_overlapped's); ml, dd: lse (log2 domain) and D of the
// thread's rows; dq accumulates.
template <int HD, int BN, int BM, bool PIPE, class KV>
__device__ __forceinline__ void att_wg_dq_walk(KV& kv, int nkb, int jend, u32 aQw, u32 adOw, int r0, int wq,
                                               int row, int q, float scale_log2, const float (&ml)[2],
                                               const float (&dd)[2], float (&dq)[HD / 2]) {
    float s[BN / 2], dp[BN / 2];
    u32 dsa[BN / 16][4];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) s[i] = dp[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < BN / 16; ++i) dsa[i][0] = dsa[i][1] = dsa[i][2] = dsa[i][3] = 0u;

    // S_j and dP_j issued (two batches; the caller waited for the tiles and fenced).
    auto issue_scores = [&](int j) {
        att_wg_abt<HD, BN>(s, aQw, BM * 128, kv.k(j), BN * 128);
        att_wg_commit();
        att_wg_abt<HD, BN>(dp, adOw, BM * 128, kv.v(j), BN * 128);
        att_wg_commit();
    };
    // P_j in s (S_j complete): the forward's causal mask (-inf where key > row, where the block reaches
    // past the warp's first row), then 2^(S scale log2e - lse log2e), which is 0 at -inf.
    auto probabilities = [&](int j) {
        att_wg_fence_regs<BN / 2>(s);
        if (j * BN + BN - 1 > r0 + 16 * wq) att_wg_mask<BN>(s, j * BN, row, q);
#pragma unroll
        for (int c = 0; c < BN / 8; ++c)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    s[4 * c + 2 * hr + e] = att_ex2(__fmaf_rn(s[4 * c + 2 * hr + e], scale_log2, -ml[hr]));
    };
    // dS_j = P_j (dP_j - D) into dp (dP_j complete).
    auto score_grads = [&]() {
        att_wg_fence_regs<BN / 2>(dp);
#pragma unroll
        for (int c = 0; c < BN / 8; ++c)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    dp[4 * c + 2 * hr + e] = s[4 * c + 2 * hr + e] * (dp[4 * c + 2 * hr + e] - dd[hr]);
    };
    // The unpipelined block j up to dS in dsa: S_j and dP_j, waited for, P_j while dP_j runs; V_j is free
    // after.
    auto block_to_ds = [&](int j) {
        kv.wait_k(j);
        kv.wait_v(j);
        att_wg_fence_regs<BN / 2>(s);
        att_wg_fence_regs<BN / 2>(dp);
        att_wg_fence();
        issue_scores(j);
        att_wg_wait<1>();
        probabilities(j);
        att_wg_wait<0>();
        kv.release_v(j);
        score_grads();
        att_wg_c_to_a<BN>(dsa, dp);
    };
    // dQ += dS K_j with dS in dsa, waited for; K_j is free after.
    auto dq_product = [&](int j) {
        att_wg_fence_regs<BN / 16>(dsa);
        att_wg_fence_regs<HD / 2>(dq);
        att_wg_fence();
        att_wg_pv<BN, HD>(dq, dsa, kv.k(j), BN * 128);
        att_wg_commit();
        att_wg_wait<0>();
        kv.release_k(j);
        att_wg_fence_regs<HD / 2>(dq);
    };

    if constexpr (!PIPE) {
        for (int j = 0; j < nkb; ++j) {
            kv.top(j);
            if (j >= jend) {  // warpgroup-uniform; no barrier below
                kv.skip(j);
                continue;
            }
            block_to_ds(j);
            dq_product(j);
        }
    } else {
        kv.top(0);
        if (jend > 0) {
            block_to_ds(0);
            if (jend == 1) dq_product(0);
        } else {
            kv.skip(0);
        }
        for (int j = 1; j < nkb; ++j) {
            kv.top(j);
            if (j >= jend) {  // warpgroup-uniform; no barrier below
                kv.skip(j);
                continue;
            }
            kv.wait_k(j);
            kv.wait_v(j);
            att_wg_fence_regs<BN / 2>(s);
            att_wg_fence_regs<BN / 2>(dp);
            att_wg_fence_regs<BN / 16>(dsa);
            att_wg_fence_regs<HD / 2>(dq);
            att_wg_fence();
            issue_scores(j);
            // dQ += dS_{j-1} K_{j-1} as a third batch, then wait for S_j and dP_j only.
            att_wg_pv<BN, HD>(dq, dsa, kv.k(j - 1), BN * 128);
            att_wg_commit();
            att_wg_wait<1>();
            kv.release_v(j);
            probabilities(j);
            score_grads();
            att_wg_wait<0>();  // dQ's product done: dsa and dq are free
            kv.release_k(j - 1);
            att_wg_fence_regs<HD / 2>(dq);
            att_wg_fence_regs<BN / 16>(dsa);
            att_wg_c_to_a<BN>(dsa, dp);
            if (j == jend - 1) dq_product(j);  // the warpgroup's last block: its dQ product now
        }
    }
}

// lse (log2 domain) and D of the thread's rows row and row + 8 (0 past T).
__device__ __forceinline__ void att_wg_row_stats(const float* __restrict__ lse, const float* __restrict__ dvec,
                                                 int bh, int row, int T, float (&ml)[2], float (&dd)[2]) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const int t = row + 8 * hr;
        ml[hr] = t < T ? lse[(u64)bh * T + t] * ATT_LOG2E : 0.0f;
        dd[hr] = t < T ? dvec[(u64)bh * T + t] : 0.0f;
    }
}

template <int HD, int NWG, int BN, bool PIPE>
__device__ __forceinline__ void attn_bwd_dq_wgmma(const u16* __restrict__ qkv, const u16* __restrict__ dout,
                                                  const float* __restrict__ lse, const float* __restrict__ dvec,
                                                  u16* __restrict__ dqkv, int T, int H, int KV, float scale,
                                                  float scale_log2) {
    static_assert(HD == 64 || HD == 128, "head dim 64 or 128");
    static_assert(BN == 64 || BN == 128, "key blocks of 64 or 128");
    static_assert(NWG >= 1 && NWG <= 2, "1 or 2 warpgroups");
    constexpr int BM = 64 * NWG, NT = 128 * NWG, KBUF = PIPE ? 3 : 2;
    constexpr u32 QB = BM * HD * 2, KB = BN * HD * 2;
    const u32 raw = att_smem_u32(att_smem);
    const u32 pad = (1024u - (raw & 1023u)) & 1023u;
    const u32 aQ = raw + pad, adO = aQ + QB, aK = adO + QB, aV = aK + KBUF * KB;
    u16* sQ = reinterpret_cast<u16*>(att_smem + pad);
    u16* sdO = reinterpret_cast<u16*>(att_smem + pad + QB);
    u16* sK = reinterpret_cast<u16*>(att_smem + pad + 2 * QB);
    u16* sV = reinterpret_cast<u16*>(att_smem + pad + 2 * QB + KBUF * KB);

    const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7, wq = (tid >> 5) & 3;
    const int g = lane >> 2, q = lane & 3;
    const int bh = blockIdx.x, b = bh / H, h = bh - (bh / H) * H;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BM;
    const u64 rs = (u64)(H + 2 * KV) * HD, ors = (u64)H * HD;
    const int kvh = h / (H / KV);
    const u16* gQ = qkv + (u64)b * T * rs + (u64)h * HD;
    const u16* gdO = dout + (u64)b * T * ors + (u64)h * HD;
    const u16* gK = qkv + (u64)b * T * rs + (u64)(H + kvh) * HD;
    const u16* gV = gK + (u64)KV * HD;
    const int q_end = min(q0 + BM, T);
    const int nkb = (q_end - 1) / BN + 1;
    const int r0 = q0 + 64 * wg;
    const int row = r0 + 16 * wq + g;
    const bool active = r0 < T;
    const int jend = active ? min(nkb, (r0 + 63) / BN + 1) : 0;
    const u32 aQw = aQ + (u32)(64 * wg) * 128u, adOw = adO + (u32)(64 * wg) * 128u;

    float ml[2], dd[2];
    att_wg_row_stats(lse, dvec, bh, row, T, ml, dd);

    att_load_sw128<HD, BM, NT>(sQ, gQ, rs, q0, T, tid);
    att_load_sw128<HD, BM, NT>(sdO, gdO, ors, q0, T, tid);
    att_load_sw128<HD, BN, NT>(sK, gK, rs, 0, T, tid);
    att_load_sw128<HD, BN, NT>(sV, gV, rs, 0, T, tid);
    att_cp_commit();

    float dq[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) dq[i] = 0.0f;
    AttKvCpAsync<HD, BN, NT, KBUF, 2> kv{sK, sV, aK, aV, gK, gV, rs, T, nkb, tid};
    att_wg_dq_walk<HD, BN, BM, PIPE>(kv, nkb, jend, aQw, adOw, r0, wq, row, q, scale_log2, ml, dd, dq);
    if (!active) return;  // no barrier below

    // dQ * scale to the q slot of dqkv through the warp's own rows of the Q tile.
    const int srow = 64 * wg + 16 * wq;
    const float mul[2] = {scale, scale};
    att_wg_stage_rows<HD, BM>(dq, mul, sQ, srow, g, q);
    att_wg_store_rows<HD, BM>(sQ, srow, dqkv + (u64)b * T * rs + (u64)h * HD, rs, r0 + 16 * wq, T, lane);
}

// The dQ kernel with warp specialisation, as attn_fwd_wgmma_ws is the forward's: NWG consumer warpgroups
// (the plain schedule, rows as attn_bwd_dq_wgmma) and a producer warpgroup whose first thread loads the Q
// and dO tiles once (tensor maps tq over qkv and tdo over dout, both with boxes of BM rows) and key/value
// block j into stage j % ST (tkv, boxes of BN rows), once the consumers released the block ST earlier: V
// after its dP product, K after its dQ product. Registers as the forward's (24 / 240).
// Shared memory (1024-byte aligned): Q, dO [BM][HD]; K, V [ST][BN][HD] (SW128 tiles); the barriers
// full_q (Q and dO), full_k[ST], full_v[ST], empty_k[ST], empty_v[ST].
template <int HD, int NWG, int BN>
__device__ __forceinline__ void attn_bwd_dq_wgmma_ws(const AttTmaMap* tq, const AttTmaMap* tdo,
                                                     const AttTmaMap* tkv, const float* __restrict__ lse,
                                                     const float* __restrict__ dvec, u16* __restrict__ dqkv, int T,
                                                     int H, int KV, float scale, float scale_log2) {
    static_assert(HD == 64 || HD == 128, "head dim 64 or 128");
    static_assert(BN == 64 || BN == 128, "key blocks of 64 or 128");
    static_assert(NWG == 2, "two consumer warpgroups (the register split is for three)");
    constexpr int BM = 64 * NWG, NC = 128 * NWG, ST = ATT_WS_STAGES;
    constexpr u32 QB = BM * HD * 2, KB = BN * HD * 2;
    const u32 raw = att_smem_u32(att_smem);
    const u32 pad = (1024u - (raw & 1023u)) & 1023u;
    const u32 aQ = raw + pad, adO = aQ + QB, aK = adO + QB, aV = aK + ST * KB, aBar = aV + ST * KB;
    u16* sQ = reinterpret_cast<u16*>(att_smem + pad);

    const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7, wq = (tid >> 5) & 3;
    const int g = lane >> 2, q = lane & 3;
    const int bh = blockIdx.x, b = bh / H, h = bh - (bh / H) * H;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BM;
    const u64 rs = (u64)(H + 2 * KV) * HD;
    const int kvh = h / (H / KV);
    const int q_end = min(q0 + BM, T);
    const int nkb = (q_end - 1) / BN + 1;

    att_ws_init_barriers<ST, NWG>(aBar, tid);
    if (tid >= NC) {  // the producer warpgroup
        att_setmaxnreg_dec<24>();
        if (tid == NC) {
            att_mbar_arrive_expect_tx(aBar, 2 * QB);
#pragma unroll
            for (int c = 0; c < HD / 64; ++c) {
                att_tma_load_4d(aQ + (u32)c * BM * 128, tq, 64 * c, h, q0, b, aBar);
                att_tma_load_4d(adO + (u32)c * BM * 128, tdo, 64 * c, h, q0, b, aBar);
            }
            att_ws_produce_kv<HD, BN, ST>(tkv, aK, aV, aBar + 8u, nkb, H + kvh, H + KV + kvh, b);
        }
        return;
    }

    att_setmaxnreg_inc<240>();
    const int r0 = q0 + 64 * wg;
    const int row = r0 + 16 * wq + g;
    const bool active = r0 < T;
    const int jend = active ? min(nkb, (r0 + 63) / BN + 1) : 0;
    const u32 aQw = aQ + (u32)(64 * wg) * 128u, adOw = adO + (u32)(64 * wg) * 128u;
    float ml[2], dd[2];
    att_wg_row_stats(lse, dvec, bh, row, T, ml, dd);
    float dq[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) dq[i] = 0.0f;
    att_mbar_wait(aBar, 0);  // Q and dO
    AttKvTma<HD, BN, ST> kv{aK, aV, aBar + 8u, lane};
    att_wg_dq_walk<HD, BN, BM, false>(kv, nkb, jend, aQw, adOw, r0, wq, row, q, scale_log2, ml, dd, dq);
    if (!active) return;
    const int srow = 64 * wg + 16 * wq;
    const float mul[2] = {scale, scale};
    att_wg_stage_rows<HD, BM>(dq, mul, sQ, srow, g, q);
    att_wg_store_rows<HD, BM>(sQ, srow, dqkv + (u64)b * T * rs + (u64)h * HD, rs, r0 + 16 * wq, T, lane);
}

// Bytes of attn_bwd_dq_wgmma's shared memory: Q and dO [64 NWG][HD], K [KBUF][BN][HD] (KBUF 2, or 3
// pipelined), V [2][BN][HD], the alignment.
#define ATT_WG_DQ_SMEM(HD, NWG, BN, KBUF) ((2 * 64 * (NWG) + ((KBUF) + 2) * (BN)) * (HD) * 2 + 1024)

#if !defined(ATT_ONLY_KIND)
// =====================================================================================================
// Probes: the building blocks of attn_fwd_wgmma alone, one warpgroup (128 threads), on dense row-major
// inputs in global memory, with the kernel's own loader, descriptors, wgmma wrappers and fragment maps; f32
// row-major results. A wrong descriptor field, swizzle or fragment map shows up here as a wrong small matrix
// product. Launch with 1 block of 128 threads and ATT_WG_PROBE_SMEM bytes of dynamic shared memory.
// =====================================================================================================
#define ATT_WG_PROBE_SMEM (2 * 64 * 128 * 2 + 1024)

// The 1024-byte aligned start of att_smem: generic pointer and shared-window address.
__device__ __forceinline__ unsigned char* att_wg_probe_base(u32& addr) {
    const u32 raw = att_smem_u32(att_smem);
    const u32 pad = (1024u - (raw & 1023u)) & 1023u;
    addr = raw + pad;
    return att_smem + pad;
}

// out[r][c] for the accumulator fragment d of a 64 x N product (3).
template <int N>
__device__ __forceinline__ void att_wg_probe_store(float* out, const float (&d)[N / 2]) {
    const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int i = 0; i < N / 8; ++i)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
#pragma unroll
            for (int e = 0; e < 2; ++e) out[(16 * w + g + 8 * hr) * N + 8 * i + 2 * q + e] = d[4 * i + 2 * hr + e];
}

// a, b [64][HD] into two SW128 tiles of 64 rows at base and base + 64 * HD * 2; waits, fences, barrier.
template <int HD>
__device__ __forceinline__ void att_wg_probe_load(u16* sa, const u16* a, u16* sb, const u16* b) {
    att_load_sw128<HD, 64, 128>(sa, a, HD, 0, 64, threadIdx.x);
    att_load_sw128<HD, 64, 128>(sb, b, HD, 0, 64, threadIdx.x);
    att_cp_commit();
    att_cp_wait<0>();
    att_fence_proxy_async();
    __syncthreads();
}

// out[64][64] = a[:, 0:16] * b[:, 0:16]^T for a, b [64][64]: ONE wgmma m64n64k16 (A, B K-major in shared
// memory), the smallest test of (1), (2) and the accumulator map of (3).
extern "C" __global__ void __launch_bounds__(128) attn_wg_probe_abt16(const u16* a, const u16* b, float* out) {
    u32 base;
    u16* sa = reinterpret_cast<u16*>(att_wg_probe_base(base));
    u16* sb = sa + 64 * 64;
    att_wg_probe_load<64>(sa, a, sb, b);
    float d[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.0f;
    att_wg_fence_regs<32>(d);
    att_wg_fence();
    AttWgmma<64>::ss(d, att_wg_desc(base, 16u, 1024u), att_wg_desc(base + 64u * 64u * 2u, 16u, 1024u), 0);
    att_wg_commit();
    att_wg_wait<0>();
    att_wg_fence_regs<32>(d);
    att_wg_probe_store<64>(out, d);
}

// out[64][64] = a * b^T for a, b [64][HD]: the S step of the kernel (att_wg_abt, HD / 16 wgmma, the k-steps
// inside the swizzled rows and, at HD = 128, across the two column blocks).
template <int HD>
__device__ __forceinline__ void attn_wg_probe_abt(const u16* a, const u16* b, float* out) {
    u32 base;
    u16* sa = reinterpret_cast<u16*>(att_wg_probe_base(base));
    u16* sb = sa + 64 * HD;
    att_wg_probe_load<HD>(sa, a, sb, b);
    float d[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.0f;
    att_wg_fence_regs<32>(d);
    att_wg_fence();
    att_wg_abt<HD, 64>(d, base, 64u * 128u, base + 64u * HD * 2u, 64u * 128u);
    att_wg_commit();
    att_wg_wait<0>();
    att_wg_fence_regs<32>(d);
    att_wg_probe_store<64>(out, d);
}

// out[64][HD] = bf16(p) * v for p [64][64] f32 and v [64 keys][HD]: the O step of the kernel (p enters
// as accumulator fragments, att_wg_c_to_a, att_wg_pv: A from registers, V MN-major with the transpose bit,
// at HD = 128 both column blocks through LBO). V's descriptor has LBO v_lbo and SBO v_sbo: the kernel's
// are 64 * 128 (the column block of a 64-key tile) and 1024; a test tries others when those fail.
template <int HD>
__device__ __forceinline__ void attn_wg_probe_pv(const float* p, const u16* v, float* out, u32 v_lbo, u32 v_sbo) {
    u32 base;
    u16* sv = reinterpret_cast<u16*>(att_wg_probe_base(base));
    att_load_sw128<HD, 64, 128>(sv, v, HD, 0, 64, threadIdx.x);
    att_cp_commit();
    const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3, g = lane >> 2, q = lane & 3;
    float s[32];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
#pragma unroll
            for (int e = 0; e < 2; ++e) s[4 * i + 2 * hr + e] = p[(16 * w + g + 8 * hr) * 64 + 8 * i + 2 * q + e];
    u32 pa[4][4];
    att_wg_c_to_a<64>(pa, s);
    att_cp_wait<0>();
    att_fence_proxy_async();
    __syncthreads();
    float d[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) d[i] = 0.0f;
    att_wg_fence_regs<4>(pa);
    att_wg_fence_regs<HD / 2>(d);
    att_wg_fence();
    att_wg_pv<64, HD>(d, pa, base, v_lbo, v_sbo);
    att_wg_commit();
    att_wg_wait<0>();
    att_wg_fence_regs<HD / 2>(d);
    att_wg_probe_store<HD>(out, d);
}

#define ATT_WG_PROBE_ENTRIES(HD)                                                                                \
    extern "C" __global__ void __launch_bounds__(128) attn_wg_probe_abt_hd##HD(const u16* a, const u16* b,   \
                                                                               float* out) {                  \
        attn_wg_probe_abt<HD>(a, b, out);                                                                      \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_wg_probe_pv_hd##HD(const float* p, const u16* v,   \
                                                                              float* out, u32 v_lbo,          \
                                                                              u32 v_sbo) {                    \
        attn_wg_probe_pv<HD>(p, v, out, v_lbo, v_sbo);                                                         \
    }
ATT_WG_PROBE_ENTRIES(64)
ATT_WG_PROBE_ENTRIES(128)
#endif  // !ATT_ONLY_KIND

// =====================================================================================================
// Entry points
// =====================================================================================================
// attn_fwd_wgmma_g<NWG>n<BN>[p]_hd<HD>: NWG warpgroups of 64 query rows, key blocks of BN, the suffix p for
// the overlapped schedule (PIPE). The variant list is an X-macro, X(HD, NWG, BN, suffix), so that the host
// emulator instantiates the same set; tiles.rs mirrors it (WGMMA_FORWARD_VARIANTS) and a test checks that
// the two agree. With ATT_ONLY_KIND 6 (and ATT_HD, ATT_ONLY_A = NWG, ATT_ONLY_B = BN, ATT_ONLY_C = 1 for the
// overlapped schedule), as mod.rs builds the module of one kernel, only that entry point.
#define ATT_WG_FWD_VARIANTS_64(X) X(64, 2, 64, ) X(64, 2, 128, ) X(64, 3, 128, ) X(64, 2, 128, p) X(64, 3, 128, p)
#define ATT_WG_FWD_VARIANTS_128(X) \
    X(128, 2, 128, ) X(128, 2, 64, ) X(128, 1, 128, ) X(128, 2, 128, p) X(128, 2, 64, p)

#define ATT_WG_PIPE_ false
#define ATT_WG_PIPE_p true
#define ATT_WG_FWD_ENTRY(HD, NWG, BN, SUF)                                                                     \
    extern "C" __global__ void __launch_bounds__(128 * NWG, 1) attn_fwd_wgmma_g##NWG##n##BN##SUF##_hd##HD(    \
        const u16* qkv, u16* out, float* lse, int T, int H, int KV, float scale_log2) {                        \
        attn_fwd_wgmma<HD, NWG, BN, ATT_WG_PIPE_##SUF>(qkv, out, lse, T, H, KV, scale_log2);                   \
    }
// attn_fwd_wgmma_g<NWG>n<BN>w_hd<HD>: the warp-specialised forward (NWG consumer warpgroups and a producer
// warpgroup, TMA loads), with the forward's arguments and then the two tensor maps; qkv is read through the
// maps and passed only so that the launch orders the buffer like the others. ATT_ONLY_C = 2 builds it.
#define ATT_WG_FWD_WS_VARIANTS_64(X) X(64, 2, 64) X(64, 2, 128) X(64, 3, 128)
#define ATT_WG_FWD_WS_VARIANTS_128(X) X(128, 2, 128) X(128, 2, 64)
#define ATT_WG_FWD_WS_ENTRY(HD, NWG, BN)                                                                       \
    extern "C" __global__ void __launch_bounds__(128 * NWG + 128, 1) attn_fwd_wgmma_g##NWG##n##BN##w_hd##HD(   \
        const u16* qkv, u16* out, float* lse, int T, int H, int KV, float scale_log2,                          \
        const __grid_constant__ AttTmaMap tmq, const __grid_constant__ AttTmaMap tmkv) {                       \
        (void)qkv;                                                                                             \
        attn_fwd_wgmma_ws<HD, NWG, BN>(&tmq, &tmkv, out, lse, T, H, KV, scale_log2);                           \
    }
#define ATT_WG_APPLY3(M, a, b, c) M(a, b, c)
#define ATT_WG_APPLY4(M, a, b, c, d) M(a, b, c, d)  // expands ATT_HD, ATT_ONLY_A, ATT_ONLY_B first
#define ATT_WG_APPLY1(M, a) M(a)

// The backward entry points, with the signatures of attention.cu's and attention_separate.cu's:
//   attn_bwd_wgmma_fused_hd<HD>        the fused backward (DQ, one warpgroup; ATT_ONLY_KIND 7)
//   attn_bwd_wgmma_kv_g<NWG>_hd<HD>    the dK/dV kernel (ATT_ONLY_KIND 8, ATT_ONLY_A = NWG)
//   attn_bwd_wgmma_q_g<NWG>n<BN>[p]_hd<HD> the dQ kernel (ATT_ONLY_KIND 9, ATT_ONLY_A = NWG, ATT_ONLY_B = BN,
//                                      ATT_ONLY_C = 1 for the pipelined schedule)
// The variant lists are X-macros (tiles.rs mirrors them: WGMMA_BACKWARD_VARIANTS).
#define ATT_WG_BWD_FUSED_ENTRY(HD)                                                                            \
    extern "C" __global__ void __launch_bounds__(128, 1) attn_bwd_wgmma_fused_hd##HD(                         \
        const u16* qkv, const u16* dout, const float* lse, const float* dvec, float* dq_acc,                   \
        u64 dq_split_stride, u16* dqkv, int T, int H, int KV, float scale, float scale_log2) {                 \
        attn_bwd_wgmma<HD, 1, true>(qkv, dout, lse, dvec, dq_acc, dq_split_stride, dqkv, T, H, KV, scale,     \
                                    scale_log2);                                                               \
    }
#define ATT_WG_BWD_KV_ENTRY(HD, NWG)                                                                          \
    extern "C" __global__ void __launch_bounds__(128 * NWG, 1) attn_bwd_wgmma_kv_g##NWG##_hd##HD(             \
        const u16* qkv, const u16* dout, const float* lse, const float* dvec, u16* dqkv, int T, int H, int KV, \
        float scale, float scale_log2) {                                                                       \
        attn_bwd_wgmma<HD, NWG, false>(qkv, dout, lse, dvec, nullptr, 0, dqkv, T, H, KV, scale, scale_log2);  \
    }
#define ATT_WG_BWD_Q_ENTRY(HD, NWG, BN, SUF)                                                                  \
    extern "C" __global__ void __launch_bounds__(128 * NWG, 1) attn_bwd_wgmma_q_g##NWG##n##BN##SUF##_hd##HD(  \
        const u16* qkv, const u16* dout, const float* lse, const float* dvec, u16* dqkv, int T, int H, int KV, \
        float scale, float scale_log2) {                                                                       \
        attn_bwd_dq_wgmma<HD, NWG, BN, ATT_WG_PIPE_##SUF>(qkv, dout, lse, dvec, dqkv, T, H, KV, scale,        \
                                                          scale_log2);                                         \
    }
// attn_bwd_wgmma_q_g<NWG>n<BN>w_hd<HD>: the warp-specialised dQ kernel (ATT_ONLY_KIND 9, ATT_ONLY_C = 2),
// the dQ kernel's arguments and then the tensor maps of Q (qkv, boxes of BM rows), dO (dout, BM rows) and
// K/V (qkv, BN rows).
#define ATT_WG_Q_WS_VARIANTS_64(X) X(64, 2, 64) X(64, 2, 128)
#define ATT_WG_Q_WS_VARIANTS_128(X) X(128, 2, 64)
#define ATT_WG_BWD_Q_WS_ENTRY(HD, NWG, BN)                                                                     \
    extern "C" __global__ void __launch_bounds__(128 * NWG + 128, 1) attn_bwd_wgmma_q_g##NWG##n##BN##w_hd##HD( \
        const u16* qkv, const u16* dout, const float* lse, const float* dvec, u16* dqkv, int T, int H, int KV, \
        float scale, float scale_log2, const __grid_constant__ AttTmaMap tq,                                   \
        const __grid_constant__ AttTmaMap tdo, const __grid_constant__ AttTmaMap tkv) {                        \
        (void)qkv;                                                                                             \
        (void)dout;                                                                                            \
        attn_bwd_dq_wgmma_ws<HD, NWG, BN>(&tq, &tdo, &tkv, lse, dvec, dqkv, T, H, KV, scale, scale_log2);      \
    }
// attn_bwd_wgmma_kv_g<NWG>w_hd<HD>: the warp-specialised dK/dV kernel (ATT_ONLY_KIND 8, ATT_ONLY_C = 2),
// the dK/dV kernel's arguments and then the tensor maps of K/V (qkv, boxes of 64 NWG rows), Q (qkv, 64
// rows) and dO (dout, 64 rows).
#define ATT_WG_KV_WS_VARIANTS(X) X(64, 2) X(128, 2)
#define ATT_WG_BWD_KV_WS_ENTRY(HD, NWG)                                                                        \
    extern "C" __global__ void __launch_bounds__(128 * NWG + 128, 1) attn_bwd_wgmma_kv_g##NWG##w_hd##HD(      \
        const u16* qkv, const u16* dout, const float* lse, const float* dvec, u16* dqkv, int T, int H, int KV, \
        float scale, float scale_log2, const __grid_constant__ AttTmaMap tkv,                                  \
        const __grid_constant__ AttTmaMap tq, const __grid_constant__ AttTmaMap tdo) {                         \
        (void)qkv;                                                                                             \
        (void)dout;                                                                                            \
        attn_bwd_kv_wgmma_ws<HD, NWG>(&tkv, &tq, &tdo, lse, dvec, dqkv, T, H, KV, scale, scale_log2);          \
    }
// attn_bwd_wgmma_ordered<NAME>_hd<HD>: the fused deterministic backward (ATT_ONLY_KIND 10), NAME `_cols`
// with dQ's columns split between the consumer warpgroups (COLS; head dim 128, ATT_ONLY_A = 1), the dK/dV
// kernel's arguments with the dQ accumulator tiles and their turn counters, then the tensor maps of K/V
// (qkv, boxes of 128 rows), Q (qkv, 64 rows) and dO (dout, 64 rows).
#define ATT_WG_BWD_ORDERED_ENTRY(HD, COLS, NAME)                                                               \
    extern "C" __global__ void __launch_bounds__(384, 1) attn_bwd_wgmma_ordered##NAME##_hd##HD(                \
        const u16* qkv, const u16* dout, const float* lse, const float* dvec, float* dq_acc, u32* dq_turn,     \
        u16* dqkv, int T, int H, int KV, float scale, float scale_log2, const __grid_constant__ AttTmaMap tkv,  \
        const __grid_constant__ AttTmaMap tq, const __grid_constant__ AttTmaMap tdo) {                         \
        (void)qkv;                                                                                             \
        (void)dout;                                                                                            \
        attn_bwd_ordered_wgmma<HD, COLS>(&tkv, &tq, &tdo, lse, dvec, dq_acc, dq_turn, dqkv, T, H, KV, scale,   \
                                         scale_log2);                                                          \
    }
#define ATT_WG_KV_VARIANTS_64(X) X(64, 1) X(64, 2)
#define ATT_WG_KV_VARIANTS_128(X) X(128, 1) X(128, 2)
#define ATT_WG_Q_VARIANTS_64(X) \
    X(64, 1, 64, ) X(64, 2, 64, ) X(64, 1, 128, ) X(64, 2, 128, ) X(64, 1, 64, p) X(64, 2, 64, p)
#define ATT_WG_Q_VARIANTS_128(X) X(128, 1, 64, ) X(128, 2, 64, ) X(128, 1, 64, p)
#define ATT_WG_APPLY2(M, a, b) M(a, b)

#if defined(ATT_ONLY_KIND)
#if ATT_ONLY_KIND == 6 && ATT_ONLY_C == 2
ATT_WG_APPLY3(ATT_WG_FWD_WS_ENTRY, ATT_HD, ATT_ONLY_A, ATT_ONLY_B)
#elif ATT_ONLY_KIND == 6 && ATT_ONLY_C
ATT_WG_APPLY4(ATT_WG_FWD_ENTRY, ATT_HD, ATT_ONLY_A, ATT_ONLY_B, p)
#elif ATT_ONLY_KIND == 6
ATT_WG_APPLY4(ATT_WG_FWD_ENTRY, ATT_HD, ATT_ONLY_A, ATT_ONLY_B, )
#elif ATT_ONLY_KIND == 7
ATT_WG_APPLY1(ATT_WG_BWD_FUSED_ENTRY, ATT_HD)
#elif ATT_ONLY_KIND == 8 && ATT_ONLY_C == 2
ATT_WG_APPLY2(ATT_WG_BWD_KV_WS_ENTRY, ATT_HD, ATT_ONLY_A)
#elif ATT_ONLY_KIND == 8
ATT_WG_APPLY2(ATT_WG_BWD_KV_ENTRY, ATT_HD, ATT_ONLY_A)
#elif ATT_ONLY_KIND == 9 && ATT_ONLY_C == 2
ATT_WG_APPLY3(ATT_WG_BWD_Q_WS_ENTRY, ATT_HD, ATT_ONLY_A, ATT_ONLY_B)
#elif ATT_ONLY_KIND == 9 && ATT_ONLY_C
ATT_WG_APPLY4(ATT_WG_BWD_Q_ENTRY, ATT_HD, ATT_ONLY_A, ATT_ONLY_B, p)
#elif ATT_ONLY_KIND == 9
ATT_WG_APPLY4(ATT_WG_BWD_Q_ENTRY, ATT_HD, ATT_ONLY_A, ATT_ONLY_B, )
#elif ATT_ONLY_KIND == 10 && ATT_ONLY_A == 1 && ATT_HD == 128
ATT_WG_APPLY3(ATT_WG_BWD_ORDERED_ENTRY, ATT_HD, true, _cols)
#elif ATT_ONLY_KIND == 10
ATT_WG_APPLY3(ATT_WG_BWD_ORDERED_ENTRY, ATT_HD, false, )
#endif
#else
ATT_WG_FWD_VARIANTS_64(ATT_WG_FWD_ENTRY)
ATT_WG_FWD_VARIANTS_128(ATT_WG_FWD_ENTRY)
ATT_WG_FWD_WS_VARIANTS_64(ATT_WG_FWD_WS_ENTRY)
ATT_WG_FWD_WS_VARIANTS_128(ATT_WG_FWD_WS_ENTRY)
ATT_WG_BWD_FUSED_ENTRY(64)
ATT_WG_BWD_FUSED_ENTRY(128)
ATT_WG_KV_VARIANTS_64(ATT_WG_BWD_KV_ENTRY)
ATT_WG_KV_VARIANTS_128(ATT_WG_BWD_KV_ENTRY)
ATT_WG_Q_VARIANTS_64(ATT_WG_BWD_Q_ENTRY)
ATT_WG_Q_VARIANTS_128(ATT_WG_BWD_Q_ENTRY)
ATT_WG_KV_WS_VARIANTS(ATT_WG_BWD_KV_WS_ENTRY)
ATT_WG_Q_WS_VARIANTS_64(ATT_WG_BWD_Q_WS_ENTRY)
ATT_WG_Q_WS_VARIANTS_128(ATT_WG_BWD_Q_WS_ENTRY)
ATT_WG_BWD_ORDERED_ENTRY(64, false, )
ATT_WG_BWD_ORDERED_ENTRY(128, false, )
ATT_WG_BWD_ORDERED_ENTRY(128, true, _cols)
#endif
