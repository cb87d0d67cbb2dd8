// Host emulator of the attention kernels, for machines without a GPU (the `attention_emulated` test).
//
// Compiles src/attention/attention_mma.cuh, attention.cu, attention_separate.cu and attention_wgmma.cu
// themselves with a C++ compiler. Every CUDA thread of a block is a std::thread; __syncthreads, named barriers, __syncwarp and
// the warp-collective instructions are barriers over those threads; the PTX wrappers attention_mma.cuh
// hides under ATT_HOST_EMULATION are emulated here from the PTX ISA's specification of each instruction,
// element by element:
//   ldmatrix .x4 (.trans): lane l supplies the address of row l % 8 of matrix l / 8; lane l receives, in
//     register i, elements (row l/4, cols 2(l%4), 2(l%4)+1) of matrix i, or with .trans (rows 2(l%4),
//     2(l%4)+1, col l/4); the lower-index element in the low 16 bits.
//   mma.m16n8k16 bf16: A element (r, k) is held by lane (r%8)*4 + (k%8)/2 in register (r>=8) + 2*(k>=8),
//     half k%2; B element (k, n) by lane n*4 + (k%8)/2 in register (k>=8), half k%2; C/D element (r, n)
//     by lane (r%8)*4 + n/2 in register 2*(r>=8) + n%2.
//   cp.async: copies (or zero-fills with src-size 0) either at issue ("early") or only when a
//     cp.async.wait_group retires its group ("late"), the two extremes the hardware may choose between.
//   wgmma.mma_async m64nNk16 bf16 -> f32 (attention_wgmma.cu): a warpgroup-collective operation (all 128
//     threads issue the same one, checked). Operands from shared memory through their matrix descriptors,
//     128-byte swizzle only: K-major element (mn, k) at start + (mn / 8) * SBO + (mn % 8) * 128 + 2 k,
//     MN-major element (k, mn) at start + (mn / 64) * LBO + (k / 8) * SBO + (k % 8) * 128 + 2 (mn % 64),
//     then address bits 4-6 XOR bits 7-9 (CuTe's canonical GMMA layouts, Swizzle<3,4,3>); A from
//     registers in the mma.m16n8k16 A layout of each warp's 16 rows, or from shared memory K-major or
//     (transpose bit) MN-major; accumulator d[4 i + 2 h + e] = D(16 w +
//     g + 8 h, 8 i + 2 q + e). Results at issue ("early") or at the wgmma.wait_group that retires the batch
//     ("late": the accumulator reads NaN in between, and shared memory is read at the wait, so a kernel
//     that reads results early or overwrites operands in flight fails). A wgmma without a wgmma.fence since
//     the last wait, and a wgmma after a barrier that published cp.async data without
//     fence.proxy.async, are errors. In late mode each warp's shared-memory operands of an op are checked
//     at its wait against their bits at issue: a kernel that overwrites an operand another warp of the
//     warpgroup has not yet waited for is an error (ATT_EMULATOR_SLOW_WARP_US=N keeps the last warp of
//     each warpgroup N microseconds slow at its waits, so such a kernel fails reliably). setmaxnreg
//     moves registers within the block's pool fixed at launch (an inc the pool cannot satisfy is a
//     deadlock error). cp.async.bulk and cp.reduce.async.bulk run at issue, or read their source at
//     cp.async.bulk.wait_group.read and write at cp.async.bulk.wait_group; the GPU-scope counters run
//     under one lock with deadlock detection.
//     The emulated shared window starts at a 16-byte but not 1024-byte
//     aligned address: the swizzle follows address bits, so a kernel must align its tiles itself.
// So the kernels' own index arithmetic, tile bookkeeping, masks and synchronisation run as written, and
// only the instruction semantics come from here. The emulator also checks every shared-memory address of
// ldmatrix / cp.async (alignment and bounds), every global address of cp.async and red (inside a
// buffer), and fills shared memory with NaN bit patterns before each block, so a read of memory no one
// wrote shows up as NaN in the outputs. Build with -fsanitize=address to catch other out-of-bounds
// accesses.
//
// Usage:
//   emulator run IN OUT B H KV T HD SCALE early|late FWD BWD   (KV key/value heads, dividing H)
//     FWD: simple | w<NW>m<MT>n<BN> (a forward variant, as in the kernel names)
//     BWD: simple | fused:q<BM>:det:<SPLITS> | fused:q<BM>:atomic | wg:det:<SPLITS> | wg:atomic (the wgmma
//          fused backward) | wgsep:g<NWG>[w]:g<NWG>n<BN>[p|w] (the wgmma dK/dV and dQ kernels) | sep:DKDV:w<NW>m<MT>n<BN> with DKDV
//          w<NW>m<MT>q<BM> or p<NP>q<BM> (warp pairs) | wgord | wgordc (the fused ordered wgmma backward;
//          wgordc: dQ's columns split, head dim 128) | none (the forward alone; dqkv.bin all NaN)
//     IN/qkv.bin, IN/dout.bin (bf16 little-endian) -> OUT/out.bin (bf16), OUT/lse.bin (f32),
//     OUT/dqkv.bin (bf16). SPLITS 0 = (2 * 132 + pairs - 1) / pairs (pairs = B * KV), capped by the key blocks.
//   emulator probe abt|pb|atb IN OUT
//     IN/a.bin (bf16; f32 for pb), IN/b.bin (bf16), 64 x 64 each -> OUT/out.bin (f32 64 x 64).
//   emulator wgprobe abt16|abt|pv HD IN OUT   (the wgmma probes of attention_wgmma.cu, see wgprobe())
//   FWD may also be wg:g<NWG>n<BN>[p] (a wgmma forward variant).

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

typedef uint8_t u8;
typedef uint16_t u16;
typedef uint32_t u32;
typedef uint64_t u64;
typedef int64_t i64;

#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static
#define __grid_constant__

using std::max;
using std::min;

struct Dim3 {
    unsigned x = 0, y = 0, z = 0;
};
static Dim3 gridDim, blockDim;
static thread_local Dim3 threadIdx, blockIdx;
static thread_local unsigned char* att_smem = nullptr;

[[noreturn]] static void die(const char* what) {
    std::fprintf(stderr, "EMULATOR ERROR: %s (block %u,%u thread %u)\n", what, blockIdx.x, blockIdx.y,
                 threadIdx.x);
    std::fflush(stderr);
    std::abort();
}

// ---- bit casts and conversions (common.cuh's, on the host) ----
static inline float __uint_as_float(u32 u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
static inline float __int_as_float(int i) { return __uint_as_float((u32)i); }
static inline u32 __float_as_uint(float f) {
    u32 u;
    std::memcpy(&u, &f, 4);
    return u;
}
static inline float bf16_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }
static inline u16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);                                      // round to nearest even
    return (u16)(u >> 16);
}
static inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
struct alignas(16) uint4 {
    u32 x, y, z, w;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
static inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

// ---- the block being run ----
// Exchange slots of one warp's collectives, two sets used alternately: a lane writes its slot, waits at
// the warp barrier, reads others' slots. A lane can reuse a set only after every lane passed the barrier of
// the next collective, so no lane still reads it, and one barrier per collective suffices.
struct Slots {
    const void* addr[32];
    u32 a[32][4];
    u32 b[32][2];
    float v[32];
};
struct Warp {
    std::unique_ptr<std::barrier<>> bar;
    Slots set[2];
};
static std::unique_ptr<std::barrier<>> g_block_bar;
static std::deque<Warp> g_warps;
static size_t g_smem_bytes = 0;
static thread_local int t_lane = 0, t_warp = 0;
static bool g_late_copies = false;
static int g_slow_warp_us = 0;  // ATT_EMULATOR_SLOW_WARP_US (late mode only)

static thread_local int t_phase = 0;
static inline Warp& W() { return g_warps[t_warp]; }
// The slot set of this lane's next collective.
static inline Slots& next_slots() { return W().set[t_phase++ & 1]; }
// Set by a thread that passes a barrier while shared-memory data it received by cp.async was not fenced
// to the async proxy (fence.proxy.async) since: a wgmma after that reads it through the wrong proxy.
static thread_local bool t_proxy_dirty = false;
static std::atomic<bool> g_unfenced_smem{false};
static inline void __syncthreads() {
    if (t_proxy_dirty) g_unfenced_smem = true;
    g_block_bar->arrive_and_wait();
}
// Named barriers 1..15 (bar.sync / bar.arrive id, n), created at the first use in a launch with its count.
static std::unique_ptr<std::barrier<>> g_named[16];
static int g_named_count[16];
static std::mutex g_named_mutex;
static std::barrier<>& named_barrier(int id, int n) {
    if (id < 1 || id > 15 || n <= 0 || n % 32 != 0) die("named barrier id or count");
    std::lock_guard<std::mutex> lock(g_named_mutex);
    if (!g_named[id]) {
        g_named[id] = std::make_unique<std::barrier<>>(n);
        g_named_count[id] = n;
    }
    if (g_named_count[id] != n) die("named barrier used with two thread counts");
    return *g_named[id];
}
static inline void att_bar_sync(int id, int n) { named_barrier(id, n).arrive_and_wait(); }
static inline void att_bar_arrive(int id, int n) { (void)named_barrier(id, n).arrive(); }
static inline void __syncwarp() { W().bar->arrive_and_wait(); }
static inline float __shfl_xor_sync(unsigned mask, float v, int m) {
    if (mask != 0xffffffffu) die("partial shuffle mask");
    Slots& w = next_slots();
    w.v[t_lane] = v;
    __syncwarp();
    return w.v[t_lane ^ m];
}
static inline u64 global_thread() { return (u64)blockIdx.x * blockDim.x + threadIdx.x; }
static inline u64 grid_threads() { return (u64)gridDim.x * blockDim.x; }

// ---- global buffers (for address checks) ----
struct Region {
    const unsigned char* begin;
    size_t bytes;
};
static std::vector<Region> g_regions;
static void check_global(const void* p, size_t bytes, const char* what) {
    const unsigned char* c = (const unsigned char*)p;
    for (const Region& r : g_regions)
        if (c >= r.begin && c + bytes <= r.begin + r.bytes) return;
    die(what);
}
static void check_shared(const void* p, size_t bytes, size_t align, const char* what) {
    const unsigned char* c = (const unsigned char*)p;
    if (((uintptr_t)c % align) != 0) die(what);
    if (c < att_smem || c + bytes > att_smem + g_smem_bytes) die(what);
}

// ---- cp.async ----
struct Copy {
    void* dst;
    const void* src;
    int bytes;
    bool valid;
};
static thread_local std::vector<std::vector<Copy>> t_groups;  // committed groups, oldest first
static thread_local std::vector<Copy> t_open;                 // issued, not yet committed
static void do_copy(const Copy& c) {
    if (c.valid)
        std::memcpy(c.dst, c.src, c.bytes);
    else
        std::memset(c.dst, 0, c.bytes);
}
static void cp_async(void* dst, const void* src, int bytes, bool valid) {
    check_shared(dst, bytes, bytes, "cp.async shared destination misaligned or out of bounds");
    if (((uintptr_t)src % bytes) != 0) die("cp.async global source misaligned");
    if (valid) check_global(src, bytes, "cp.async reads outside every global buffer");
    const Copy c{dst, src, bytes, valid};
    if (g_late_copies)
        t_open.push_back(c);
    else
        do_copy(c);
}
static inline void att_cp_async16(void* dst, const void* src, bool valid) { cp_async(dst, src, 16, valid); }
static inline void att_cp_async4(void* dst, const void* src, bool valid) { cp_async(dst, src, 4, valid); }
static inline void att_cp_commit() {
    t_groups.push_back(std::move(t_open));
    t_open.clear();
}
template <int N>
static inline void att_cp_wait() {
    t_proxy_dirty = true;
    while (t_groups.size() > (size_t)N) {
        for (const Copy& c : t_groups.front()) do_copy(c);
        t_groups.erase(t_groups.begin());
    }
}

// ---- ldmatrix ----
static inline u32 pack2(u16 lo, u16 hi) { return (u32)lo | ((u32)hi << 16); }
static inline void att_ldsm_x4(const void* p, u32 (&r)[4]) {
    check_shared(p, 16, 16, "ldmatrix row address misaligned or out of bounds");
    Slots& w = next_slots();
    w.addr[t_lane] = p;
    __syncwarp();
    for (int m = 0; m < 4; ++m) {
        const u16* row = (const u16*)w.addr[m * 8 + t_lane / 4];
        r[m] = pack2(row[2 * (t_lane % 4)], row[2 * (t_lane % 4) + 1]);
    }
}
static inline void att_ldsm_x4_trans(const void* p, u32 (&r)[4]) {
    check_shared(p, 16, 16, "ldmatrix.trans row address misaligned or out of bounds");
    Slots& w = next_slots();
    w.addr[t_lane] = p;
    __syncwarp();
    for (int m = 0; m < 4; ++m) {
        const u16* r0 = (const u16*)w.addr[m * 8 + 2 * (t_lane % 4)];
        const u16* r1 = (const u16*)w.addr[m * 8 + 2 * (t_lane % 4) + 1];
        r[m] = pack2(r0[t_lane / 4], r1[t_lane / 4]);
    }
}

// ---- mma.m16n8k16 bf16 -> f32 ----
static inline float half_bf16(u32 reg, int half) { return bf16_to_f32((u16)(reg >> (16 * half))); }
static inline void att_mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    Slots& w = next_slots();
    for (int i = 0; i < 4; ++i) w.a[t_lane][i] = a[i];
    w.b[t_lane][0] = b0;
    w.b[t_lane][1] = b1;
    __syncwarp();
    const int g = t_lane / 4, q = t_lane % 4;
    for (int e = 0; e < 4; ++e) {
        const int row = g + (e >= 2 ? 8 : 0), col = 2 * q + (e & 1);
        double s = 0.0;
        for (int k = 0; k < 16; ++k) {
            const float av = half_bf16(w.a[(row % 8) * 4 + (k % 8) / 2][(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k % 2);
            const float bv = half_bf16(w.b[col * 4 + (k % 8) / 2][k >= 8 ? 1 : 0], k % 2);
            s += (double)av * (double)bv;
        }
        c[e] = (float)((double)c[e] + s);
    }
}

static inline u32 att_pack_bf16(float lo, float hi) { return pack2(f32_to_bf16(lo), f32_to_bf16(hi)); }
static inline float att_ex2(float x) { return std::exp2(x); }
static std::mutex g_red_mutex;
static inline void att_red_add2(float* p, float a, float b) {
    if (((uintptr_t)p % 8) != 0) die("red.v2 address misaligned");
    check_global(p, 8, "red writes outside every global buffer");
    std::lock_guard<std::mutex> lock(g_red_mutex);
    p[0] += a;
    p[1] += b;
}

// ---- the shared window (wgmma descriptors hold shared-window addresses) ----
static const u32 kSmemWindow = 0x490;  // 16-byte aligned, not 1024-byte aligned
static inline u32 att_smem_u32(const void* p) {
    return kSmemWindow + (u32)((const unsigned char*)p - att_smem);
}
static inline const u16* smem_u16(u32 addr) {
    if (addr < kSmemWindow || addr - kSmemWindow + 2 > g_smem_bytes || (addr & 1) != 0)
        die("wgmma operand outside shared memory");
    return (const u16*)(att_smem + (addr - kSmemWindow));
}

// ---- wgmma ----
struct WgOp {
    bool rs = false;
    int n = 0, tnsp_a = 0, tnsp_b = 0, accumulate = 1;
    u64 da = 0, db = 0;
    u32 a[128][4];
    u64 operand_sum[4] = {0, 0, 0, 0};  // per warp: its shared-memory operand bits at issue (late mode)
};
// One warpgroup of the block being run: its barrier and a ring of issued operations (slot = issue count
// % 64; every thread issues the same sequence).
struct WarpGroup {
    std::unique_ptr<std::barrier<>> bar;
    WgOp ops[64];
};
static std::deque<WarpGroup> g_wgs;
// A thread's part of an issued operation: its accumulator, and the value before the operation (unless it
// continues an operation on the same accumulator still in flight, whose result it then starts from).
struct PendingWg {
    int op;
    float* d;
    bool chained;
    std::vector<float> saved;
};
static thread_local std::vector<PendingWg> t_wg_open;                // issued, not yet committed
static thread_local std::vector<std::vector<PendingWg>> t_wg_groups;  // committed batches, oldest first
static thread_local unsigned t_wg_issued = 0;
static thread_local bool t_wg_fenced = false;

static inline void att_fence_proxy_async() { t_proxy_dirty = false; }
static inline void att_wg_fence() { t_wg_fenced = true; }
static inline void att_wg_fence_reg(float&) {}
static inline void att_wg_fence_reg(u32&) {}

// Element (mn, k) of an operand through its descriptor (see the header).
static float wg_desc_elem(u64 desc, bool mn_major, int mn, int k) {
    if (((desc >> 62) & 3) != 1) die("wgmma descriptor: layout other than the 128-byte swizzle");
    if (((desc >> 49) & 7) != 0) die("wgmma descriptor: nonzero base offset");
    const u64 fields = 0x3FFFull | (0x3FFFull << 16) | (0x3FFFull << 32) | (7ull << 49) | (3ull << 62);
    if ((desc & ~fields) != 0) die("wgmma descriptor: reserved bits set");
    const u32 start = (u32)(desc & 0x3FFF) << 4, lbo = (u32)((desc >> 16) & 0x3FFF) << 4,
              sbo = (u32)((desc >> 32) & 0x3FFF) << 4;
    // With base offset 0 the swizzle phase is that of a start at row 0 of an atom.
    if (((start >> 7) & 7) != 0) die("wgmma descriptor: start not in row 0 of a swizzle atom");
    u32 addr;
    if (!mn_major) {
        if ((start & 127) + 32 > 128) die("wgmma descriptor: K-major k-step crosses a 128-byte row");
        addr = start + (u32)(mn / 8) * sbo + (u32)(mn % 8) * 128 + (u32)k * 2;
    } else {
        addr = start + (u32)(mn / 64) * lbo + (u32)(k / 8) * sbo + (u32)(k % 8) * 128 + (u32)(mn % 64) * 2;
    }
    addr ^= ((addr >> 7) & 7) << 4;
    return bf16_to_f32(*smem_u16(addr));
}

// This thread's accumulator registers after `op`, from `base` (its registers before the operation).
static void wg_complete(const WgOp& op, float* d, const float* base) {
    const int t = (int)(threadIdx.x & 127), w = t / 32, lane = t % 32, g = lane / 4, q = lane % 4;
    for (int v = 0; v < op.n / 2; ++v) {
        const int i = v / 4, hr = (v / 2) % 2, e = v % 2;
        const int row = 16 * w + g + 8 * hr, col = 8 * i + 2 * q + e;
        double sum = 0.0;
        for (int k = 0; k < 16; ++k) {
            float a;
            if (op.rs) {
                const int holder = 32 * (row / 16) + 4 * (row % 8) + (k % 8) / 2;
                a = half_bf16(op.a[holder][(row % 16 >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k % 2);
            } else {
                a = wg_desc_elem(op.da, op.tnsp_a != 0, row, k);
            }
            sum += (double)a * (double)wg_desc_elem(op.db, op.tnsp_b != 0, col, k);
        }
        d[v] = (float)((op.accumulate ? (double)base[v] : 0.0) + sum);
    }
}

// A checksum of the shared-memory operand elements warp w of the warpgroup reads for `op`: its 16 rows of
// A (unless A is in registers) and all of B. Taken at issue and again when the warp waits for the op
// (late mode): a difference means the kernel changed an operand of a wgmma in flight (another warp of the
// warpgroup may not yet have waited for it even where this one has).
static u64 wg_operand_sum(const WgOp& op, int w) {
    u64 h = 1469598103934665603ull;
    auto mix = [&h](float v) {
        u32 b;
        std::memcpy(&b, &v, 4);
        h = (h ^ b) * 1099511628211ull;
    };
    if (!op.rs)
        for (int r = 16 * w; r < 16 * w + 16; ++r)
            for (int k = 0; k < 16; ++k) mix(wg_desc_elem(op.da, op.tnsp_a != 0, r, k));
    for (int c = 0; c < op.n; ++c)
        for (int k = 0; k < 16; ++k) mix(wg_desc_elem(op.db, op.tnsp_b != 0, c, k));
    return h;
}

static void wg_issue(bool rs, int n, int tnsp_a, int tnsp_b, int accumulate, u64 da, u64 db, const u32* a,
                     float* d) {
    if (g_wgs.empty()) die("wgmma in a block that is not whole warpgroups");
    if (!t_wg_fenced) die("wgmma.mma_async without wgmma.fence since the last wgmma.wait_group");
    if (g_unfenced_smem) die("wgmma after a barrier that published cp.async data without fence.proxy.async");
    size_t in_flight = t_wg_open.size();
    for (const auto& grp : t_wg_groups) in_flight += grp.size();
    if (in_flight >= 32) die("more wgmma in flight than the emulator keeps");
    WarpGroup& G = g_wgs[t_warp / 4];
    const int idx = (int)(t_wg_issued++ % 64), t = (int)(threadIdx.x & 127);
    WgOp& op = G.ops[idx];
    if (t == 0) {
        op.rs = rs;
        op.n = n;
        op.tnsp_a = tnsp_a;
        op.tnsp_b = tnsp_b;
        op.accumulate = accumulate;
        op.da = da;
        op.db = db;
    }
    if (rs)
        for (int r = 0; r < 4; ++r) op.a[t][r] = a[r];
    if (t == 0 && g_late_copies)
        for (int w = 0; w < 4; ++w) op.operand_sum[w] = wg_operand_sum(op, w);
    G.bar->arrive_and_wait();
    if (op.rs != rs || op.n != n || op.tnsp_a != tnsp_a || op.tnsp_b != tnsp_b || op.accumulate != accumulate || (!rs && op.da != da) ||
        op.db != db)
        die("the threads of a warpgroup issued different wgmma");
    bool chained = false;
    for (const auto& p : t_wg_open) chained |= p.d == d;
    for (const auto& grp : t_wg_groups)
        for (const auto& p : grp) chained |= p.d == d;
    if (!g_late_copies) {
        const std::vector<float> base(d, d + n / 2);
        wg_complete(op, d, base.data());
        return;
    }
    PendingWg p{idx, d, chained, chained ? std::vector<float>() : std::vector<float>(d, d + n / 2)};
    if (!chained)
        for (int v = 0; v < n / 2; ++v) d[v] = NAN;
    t_wg_open.push_back(std::move(p));
}
static inline void att_wg_commit() {
    t_wg_groups.push_back(std::move(t_wg_open));
    t_wg_open.clear();
}
// wgmma.wait_group is .sync.aligned: the lanes of a warp execute it together, so none leaves before every
// lane's operands were read (a lane may then release shared memory for the whole warp).
template <int N>
static inline void att_wg_wait() {
    if (!t_wg_open.empty()) die("wgmma.wait_group with uncommitted wgmma");
    t_wg_fenced = false;
    // Late results with ATT_EMULATOR_SLOW_WARP_US set: the last warp of each warpgroup is that many
    // microseconds slow to complete its part at every wait, so the other warps run ahead of it as far as
    // the kernel lets them (a warp's wait covers only its own part of a wgmma, whose shared-memory
    // operands its slow sibling still reads; the operand check below then fails).
    if (g_late_copies && g_slow_warp_us > 0 && (t_warp % 4) == 3 && !t_wg_groups.empty())
        std::this_thread::sleep_for(std::chrono::microseconds(g_slow_warp_us));
    while (t_wg_groups.size() > (size_t)N) {
        for (PendingWg& p : t_wg_groups.front()) {
            const WgOp& op = g_wgs[t_warp / 4].ops[p.op];
            if (t_lane == 0 && wg_operand_sum(op, t_warp % 4) != op.operand_sum[t_warp % 4])
                die("a shared-memory operand of a wgmma changed before this warp waited for it");
            wg_complete(op, p.d, p.chained ? p.d : p.saved.data());
        }
        t_wg_groups.erase(t_wg_groups.begin());
    }
    __syncwarp();
}
template <int N>
struct AttWgmma {
    static void ss(float (&d)[N / 2], u64 da, u64 db, int accumulate) {
        wg_issue(false, N, 0, 0, accumulate, da, db, nullptr, d);
    }
    static void ss_tt(float (&d)[N / 2], u64 da, u64 db, int accumulate) {
        wg_issue(false, N, 1, 1, accumulate, da, db, nullptr, d);
    }
    static void rs_mn(float (&d)[N / 2], const u32 (&a)[4], u64 db) { wg_issue(true, N, 0, 1, 1, 0, db, a, d); }
};

// ---- mbarrier and TMA (attention_wgmma.cu's warp-specialised forward) ----
// A barrier per shared-window address, created by mbarrier.init: pending arrivals of the current phase,
// expected transaction bytes still to land, and the count of completed phases (the parity a waiter tests).
// TMA copies land at issue ("early") or only when a thread tests their barrier ("late": as late as a
// thread could notice); either way their bytes are then counted off the barrier's transaction count.
struct MBar {
    int count = 0, pending = 0;
    long long tx = 0;
    unsigned phases = 0;
    std::vector<std::function<void()>> late;
};
static std::mutex g_mbar_mutex;
static std::map<u32, MBar> g_mbars;  // reset for every block
static MBar& mbar_at(u32 bar) {
    if ((bar & 7) != 0 || bar < kSmemWindow || bar - kSmemWindow + 8 > g_smem_bytes)
        die("mbarrier address misaligned or outside shared memory");
    auto it = g_mbars.find(bar);
    if (it == g_mbars.end()) die("mbarrier used before mbarrier.init");
    return it->second;
}
static void mbar_settle(MBar& m) {
    for (auto& copy : m.late) copy();
    m.late.clear();
    if (m.pending == 0 && m.tx == 0) {
        ++m.phases;
        m.pending = m.count;
    }
}
static inline void att_mbar_init(u32 bar, u32 count) {
    std::lock_guard<std::mutex> lock(g_mbar_mutex);
    if ((bar & 7) != 0 || bar < kSmemWindow || bar - kSmemWindow + 8 > g_smem_bytes)
        die("mbarrier.init address misaligned or outside shared memory");
    MBar& m = g_mbars[bar];
    m = MBar{};
    m.count = m.pending = (int)count;
}
static inline void att_mbar_init_fence() {}
static void mbar_arrive(u32 bar, long long tx) {
    std::lock_guard<std::mutex> lock(g_mbar_mutex);
    MBar& m = mbar_at(bar);
    if (m.pending <= 0) die("mbarrier arrival beyond the phase's count");
    m.tx += tx;
    --m.pending;
    mbar_settle(m);
}
static inline void att_mbar_arrive(u32 bar) { mbar_arrive(bar, 0); }
static inline void att_mbar_arrive_expect_tx(u32 bar, u32 bytes) { mbar_arrive(bar, (long long)bytes); }
static inline bool att_mbar_try_wait(u32 bar, u32 parity) {
    using clock = std::chrono::steady_clock;
    static thread_local clock::time_point since;
    static thread_local u32 since_bar = ~0u;
    bool done;
    {
        std::lock_guard<std::mutex> lock(g_mbar_mutex);
        MBar& m = mbar_at(bar);
        mbar_settle(m);
        done = (m.phases & 1u) != (parity & 1u);
    }
    if (done) {
        since_bar = ~0u;
        return true;
    }
    if (since_bar != bar) {
        since_bar = bar;
        since = clock::now();
    } else if (clock::now() - since > std::chrono::seconds(20)) {
        die("mbarrier wait made no progress for 20 s (deadlock)");
    }
    std::this_thread::yield();
    return false;
}
// setmaxnreg: a block's registers are a pool fixed at launch, per thread the most the launch bounds
// allow (65536 / threads, rounded down to a multiple of 8, at most 255 rounded to 248: what ptxas gives a
// kernel that uses setmaxnreg); dec returns a warpgroup's surplus to the pool, inc waits until the pool
// holds what it asks for. A split whose warpgroups ask for more than the pool holds waits forever on a
// GPU: here it is a deadlock error after 20 s.
static std::mutex g_reg_mutex;
static std::vector<int> g_wg_regs;  // per warpgroup, per thread; reset by launch()
static int g_reg_pool = 0;          // registers per block
static void set_wg_regs(int n, bool inc) {
    if (n < 24 || n > 256 || n % 8 != 0) die("setmaxnreg count");
    using clock = std::chrono::steady_clock;
    const auto since = clock::now();
    const size_t wg = (size_t)t_warp / 4;
    for (;;) {
        {
            std::lock_guard<std::mutex> lock(g_reg_mutex);
            if (wg >= g_wg_regs.size()) die("setmaxnreg in a block that is not whole warpgroups");
            if (inc && n < g_wg_regs[wg]) die("setmaxnreg.inc below the warpgroup's registers");
            if (!inc && n > g_wg_regs[wg]) die("setmaxnreg.dec above the warpgroup's registers");
            int total = 0;
            for (size_t w = 0; w < g_wg_regs.size(); ++w) total += 128 * (w == wg ? n : g_wg_regs[w]);
            if (!inc || total <= g_reg_pool) {
                g_wg_regs[wg] = n;  // every thread of the warpgroup sets the same value
                return;
            }
        }
        if (clock::now() - since > std::chrono::seconds(20))
            die("setmaxnreg.inc waits for registers the block's pool never has (deadlock)");
        std::this_thread::yield();
    }
}
template <int N>
static inline void att_setmaxnreg_dec() {
    set_wg_regs(N, false);
}
template <int N>
static inline void att_setmaxnreg_inc() {
    set_wg_regs(N, true);
}
// The emulator's tensor map, in the 128 bytes of AttTmaMap: base address, the 4 dimensions, the byte
// strides of dimensions 1-3, the box, and the 128-byte swizzle (the only mode the kernels use).
static void tma_encode(void* map, const void* base, const u64 (&dims)[4], const u64 (&strides)[3],
                       const u32 (&box)[4]) {
    u64* f = (u64*)map;
    std::memset(f, 0, 128);
    f[0] = (u64)(uintptr_t)base;
    for (int i = 0; i < 4; ++i) f[1 + i] = dims[i], f[8 + i] = box[i];
    for (int i = 0; i < 3; ++i) f[5 + i] = strides[i];
}
static void tma_copy(u32 dst, const u64* f, const int (&c)[4]) {
    const unsigned char* base = (const unsigned char*)(uintptr_t)f[0];
    const u64 box0 = f[8], box1 = f[9], box2 = f[10], box3 = f[11];
    if (box0 * 2 != 128) die("TMA 128-byte swizzle needs a 128-byte inner box");
    for (u64 i3 = 0; i3 < box3; ++i3)
        for (u64 i2 = 0; i2 < box2; ++i2)
            for (u64 i1 = 0; i1 < box1; ++i1)
                for (u64 i0 = 0; i0 < box0; ++i0) {
                    const long long x[4] = {c[0] + (long long)i0, c[1] + (long long)i1, c[2] + (long long)i2,
                                            c[3] + (long long)i3};
                    bool in = true;
                    for (int d = 0; d < 4; ++d) in = in && x[d] >= 0 && (u64)x[d] < f[1 + d];
                    u16 v = 0;
                    if (in) {
                        const unsigned char* src = base + x[0] * 2 + x[1] * f[5] + x[2] * f[6] + x[3] * f[7];
                        check_global(src, 2, "TMA reads outside every global buffer");
                        std::memcpy(&v, src, 2);
                    }
                    u32 addr = dst + (u32)((((i3 * box2 + i2) * box1 + i1) * box0 + i0) * 2);
                    addr ^= ((addr >> 7) & 7) << 4;
                    if (addr < kSmemWindow || addr - kSmemWindow + 2 > g_smem_bytes) die("TMA writes outside shared memory");
                    std::memcpy(att_smem + (addr - kSmemWindow), &v, 2);
                }
}
static inline void att_tma_load_4d(u32 dst, const void* map, int c0, int c1, int c2, int c3, u32 bar) {
    if ((dst & 127) != 0) die("TMA shared destination not 128-byte aligned");
    const u64* f = (const u64*)map;
    const long long bytes = (long long)(f[8] * f[9] * f[10] * f[11] * 2);
    const int c[4] = {c0, c1, c2, c3};
    std::vector<u64> fields(f, f + 16);
    unsigned char* smem = att_smem;
    std::lock_guard<std::mutex> lock(g_mbar_mutex);
    MBar& m = mbar_at(bar);
    auto copy = [dst, fields, c, bytes, smem, &m] {
        unsigned char* keep = att_smem;
        att_smem = smem;  // the copy may run on another thread of the block
        tma_copy(dst, fields.data(), c);
        att_smem = keep;
        m.tx -= bytes;
    };
    if (g_late_copies) {
        m.late.push_back(copy);
    } else {
        copy();
        mbar_settle(m);
    }
}

// ---- bulk reductions and GPU-scope counters (the ordered wgmma backward's dQ writer) ----
// cp.reduce.async.bulk .add.f32: applied at issue ("early"), or ("late") its shared-memory source read
// only at the cp.async.bulk.wait_group.read or wait_group that retires it and its global writes made
// only at the wait_group, so a kernel that overwrites the source before the read wait, or lets another
// block's reduction go before the writes, fails. ld.acquire / red.release on a counter: under one mutex;
// a thread that polls a counter without seeing it change for 20 s is deadlocked.
struct BulkOp {
    float* dst;
    u32 src, bytes;
    bool add, read;
    std::vector<float> data;
};
static thread_local std::vector<BulkOp> t_bulk;
static void bulk_read(BulkOp& op) {
    if (op.read) return;
    const float* from = (const float*)(att_smem + (op.src - kSmemWindow));
    op.data.assign(from, from + op.bytes / 4);
    op.read = true;
}
static void bulk_write(const BulkOp& op) {
    std::lock_guard<std::mutex> lock(g_red_mutex);
    for (u32 k = 0; k < op.bytes / 4; ++k) op.dst[k] = op.add ? op.dst[k] + op.data[k] : op.data[k];
}
// One bulk operation from shared memory to global memory: an f32 reduction (add) or a copy.
static void bulk_op(float* dst, u32 src, u32 bytes, bool add) {
    if ((bytes % 16) != 0 || (src % 16) != 0 || ((uintptr_t)dst % 16) != 0) die("bulk operation misaligned");
    if (src < kSmemWindow || src - kSmemWindow + bytes > g_smem_bytes) die("bulk operation source outside shared memory");
    check_global(dst, bytes, "bulk operation writes outside every global buffer");
    BulkOp op{dst, src, bytes, add, false, {}};
    if (g_late_copies) {
        t_bulk.push_back(std::move(op));
    } else {
        bulk_read(op);
        bulk_write(op);
    }
}
static inline void att_bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) { bulk_op(dst, src, bytes, true); }
static inline void att_bulk_store(float* dst, u32 src, u32 bytes) { bulk_op(dst, src, bytes, false); }
static inline void att_bulk_commit() {}
static inline void att_bulk_wait_read_all() {
    for (auto& op : t_bulk) bulk_read(op);
}
static inline void att_bulk_wait_all() {
    for (auto& op : t_bulk) {
        bulk_read(op);
        bulk_write(op);
    }
    t_bulk.clear();
}
static inline void att_fence_proxy_async_global() {}
static inline u32 att_ld_acquire_gpu(const u32* p) {
    using clock = std::chrono::steady_clock;
    static thread_local clock::time_point since;
    static thread_local const u32* since_p = nullptr;
    static thread_local u32 since_v = 0;
    check_global(p, 4, "acquire load outside every global buffer");
    u32 v;
    {
        std::lock_guard<std::mutex> lock(g_red_mutex);
        v = *p;
    }
    if (since_p != p || since_v != v) {
        since_p = p, since_v = v, since = clock::now();
    } else if (clock::now() - since > std::chrono::seconds(20)) {
        die("a counter polled without change for 20 s (deadlock)");
    }
    std::this_thread::yield();
    return v;
}
static inline void att_trap() { die("trap"); }
static inline void att_red_release_gpu_add(u32* p, u32 v) {
    check_global(p, 4, "release add outside every global buffer");
    std::lock_guard<std::mutex> lock(g_red_mutex);
    *p += v;
}

#define ATT_HOST_EMULATION 1
#include "../../src/attention/attention_mma.cuh"
#include "../../src/attention/attention_rows.cu"
#include "../../src/attention/attention.cu"
#include "../../src/attention/attention_separate.cu"
#include "../../src/attention/attention_wgmma.cu"

// =====================================================================================================
// Launching
// =====================================================================================================

struct Launch {
    unsigned gx, gy, threads;
    size_t smem;
};

static void launch(const Launch& L, const std::function<void()>& body) {
    gridDim = Dim3{L.gx, L.gy, 1};
    blockDim = Dim3{L.threads, 1, 1};
    std::vector<unsigned char> smem(L.smem + 16);
    unsigned char* base = smem.data();
    while (((uintptr_t)base % 16) != 0) ++base;
    g_smem_bytes = L.smem;
    g_block_bar = std::make_unique<std::barrier<>>(L.threads);
    for (auto& b : g_named) b.reset();
    g_warps.clear();
    for (unsigned w = 0; w < L.threads / 32; ++w) {
        g_warps.emplace_back();
        g_warps.back().bar = std::make_unique<std::barrier<>>(32);
    }
    g_wgs.clear();
    {
        const int per_thread = std::min(248, (int)(65536 / L.threads) / 8 * 8);
        g_wg_regs.assign(L.threads / 128, per_thread);
        g_reg_pool = per_thread * (int)(L.threads / 128) * 128;
    }
    if (L.threads % 128 == 0)
        for (unsigned w = 0; w < L.threads / 128; ++w) {
            g_wgs.emplace_back();
            g_wgs.back().bar = std::make_unique<std::barrier<>>(128);
        }
    // One OS thread per CUDA thread of a block, reused for every block in launch order (x fastest).
    std::vector<std::thread> ts;
    ts.reserve(L.threads);
    for (unsigned t = 0; t < L.threads; ++t)
        ts.emplace_back([&, t] {
            threadIdx = Dim3{t, 0, 0};
            t_lane = (int)(t & 31);
            t_warp = (int)(t >> 5);
            att_smem = base;
            for (unsigned by = 0; by < L.gy; ++by)
                for (unsigned bx = 0; bx < L.gx; ++bx) {
                    blockIdx = Dim3{bx, by, 0};
                    if (t == 0) {
                        std::fill(g_wg_regs.begin(), g_wg_regs.end(), std::min(248, (int)(65536 / L.threads) / 8 * 8));
                        std::memset(smem.data(), 0xFF, smem.size());  // NaN in bf16 and f32
                        g_unfenced_smem = false;
                        g_mbars.clear();
                    }
                    g_block_bar->arrive_and_wait();
                    t_groups.clear();
                    t_open.clear();
                    t_phase = 0;
                    t_proxy_dirty = false;
                    t_wg_open.clear();
                    t_wg_groups.clear();
                    t_wg_issued = 0;
                    t_wg_fenced = false;
                    body();
                    if (!t_open.empty() || !t_groups.empty()) die("cp.async groups left in flight at exit");
                    if (!t_wg_open.empty() || !t_wg_groups.empty()) die("wgmma left in flight at exit");
                    if (!t_bulk.empty()) die("bulk reductions left in flight at exit");
                    g_block_bar->arrive_and_wait();  // the block is done before the next one starts
                }
        });
    for (auto& th : ts) th.join();
}

template <class T>
static std::vector<T> read_file(const std::string& path, size_t n) {
    std::vector<T> v(n);
    std::ifstream f(path, std::ios::binary);
    if (!f.read(reinterpret_cast<char*>(v.data()), n * sizeof(T))) die(("cannot read " + path).c_str());
    return v;
}
template <class T>
static void write_file(const std::string& path, const std::vector<T>& v) {
    std::ofstream f(path, std::ios::binary);
    f.write(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
    if (!f) die(("cannot write " + path).c_str());
}
template <class T>
static void reg(std::vector<T>& v) {
    g_regions.push_back(Region{reinterpret_cast<const unsigned char*>(v.data()), v.size() * sizeof(T)});
}

typedef void (*FwdMma)(const u16*, u16*, float*, int, int, int, float);
typedef void (*FwdSimple)(const u16*, u16*, float*, int, int, int, int, float);
typedef void (*BwdFused)(const u16*, const u16*, const float*, const float*, float*, u64, u16*, int, int, int,
                         float, float);
typedef void (*BwdSep)(const u16*, const u16*, const float*, const float*, u16*, int, int, int, float, float);
typedef void (*BwdSimple)(const u16*, const u16*, const float*, const float*, u16*, int, int, int, int, float);

// Every tensor-core variant by its kernel name, from the kernel files' own variant lists.
static std::map<std::string, FwdMma> g_fwd;
static std::map<std::string, FwdMma> g_wg_fwd;
typedef void (*FwdWs)(const u16*, u16*, float*, int, int, int, float, const AttTmaMap, const AttTmaMap);
static std::map<std::string, FwdWs> g_wg_fwd_ws;
#define REG_WG_FWD_WS(HD, NWG, BN) \
    g_wg_fwd_ws["attn_fwd_wgmma_g" #NWG "n" #BN "w_hd" #HD] = attn_fwd_wgmma_g##NWG##n##BN##w_hd##HD;
#define REG_WG_FWD(HD, NWG, BN, SUF) \
    g_wg_fwd["attn_fwd_wgmma_g" #NWG "n" #BN #SUF "_hd" #HD] = attn_fwd_wgmma_g##NWG##n##BN##SUF##_hd##HD;
static std::map<std::string, BwdSep> g_sep;
#define REG_WG_KV(HD, NWG) g_sep["attn_bwd_wgmma_kv_g" #NWG "_hd" #HD] = attn_bwd_wgmma_kv_g##NWG##_hd##HD;
typedef void (*BwdSepWs)(const u16*, const u16*, const float*, const float*, u16*, int, int, int, float, float,
                         const AttTmaMap, const AttTmaMap, const AttTmaMap);
static std::map<std::string, BwdSepWs> g_sep_ws;
#define REG_WG_KV_WS(HD, NWG) g_sep_ws["attn_bwd_wgmma_kv_g" #NWG "w_hd" #HD] = attn_bwd_wgmma_kv_g##NWG##w_hd##HD;
#define REG_WG_Q_WS(HD, NWG, BN) \
    g_sep_ws["attn_bwd_wgmma_q_g" #NWG "n" #BN "w_hd" #HD] = attn_bwd_wgmma_q_g##NWG##n##BN##w_hd##HD;
#define REG_WG_Q(HD, NWG, BN, SUF) \
    g_sep["attn_bwd_wgmma_q_g" #NWG "n" #BN #SUF "_hd" #HD] = attn_bwd_wgmma_q_g##NWG##n##BN##SUF##_hd##HD;
#define REG_FWD(HD, NW, MT, BN) g_fwd["attn_fwd_w" #NW "m" #MT "n" #BN "_hd" #HD] = attn_fwd_w##NW##m##MT##n##BN##_hd##HD;
#define REG_DKDV(HD, NW, MT, BM) \
    g_sep["attn_bwd_dkdv_w" #NW "m" #MT "q" #BM "_hd" #HD] = attn_bwd_dkdv_w##NW##m##MT##q##BM##_hd##HD;
#define REG_DKDV_PAIR(HD, NP, BM) g_sep["attn_bwd_dkdv_p" #NP "q" #BM "_hd" #HD] = attn_bwd_dkdv_p##NP##q##BM##_hd##HD;
#define REG_DQ(HD, NW, MT, BN) g_sep["attn_bwd_dq_w" #NW "m" #MT "n" #BN "_hd" #HD] = attn_bwd_dq_w##NW##m##MT##n##BN##_hd##HD;
typedef void (*BwdOrdered)(const u16*, const u16*, const float*, const float*, float*, u32*, u16*, int, int, int,
                           float, float, const AttTmaMap, const AttTmaMap, const AttTmaMap);
static void register_variants() {
    ATT_FOR_VARIANTS(ATT_FWD_VARIANTS_, REG_FWD)
    ATT_FOR_VARIANTS(ATT_DKDV_VARIANTS_, REG_DKDV)
    ATT_FOR_VARIANTS(ATT_DKDV_PAIR_VARIANTS_, REG_DKDV_PAIR)
    ATT_FOR_VARIANTS(ATT_DQ_VARIANTS_, REG_DQ)
    ATT_WG_FWD_VARIANTS_64(REG_WG_FWD)
    ATT_WG_FWD_VARIANTS_128(REG_WG_FWD)
    ATT_WG_FWD_WS_VARIANTS_64(REG_WG_FWD_WS)
    ATT_WG_FWD_WS_VARIANTS_128(REG_WG_FWD_WS)
    ATT_WG_KV_VARIANTS_64(REG_WG_KV)
    ATT_WG_KV_VARIANTS_128(REG_WG_KV)
    ATT_WG_Q_VARIANTS_64(REG_WG_Q)
    ATT_WG_Q_VARIANTS_128(REG_WG_Q)
    ATT_WG_Q_WS_VARIANTS_64(REG_WG_Q_WS)
    ATT_WG_KV_WS_VARIANTS(REG_WG_KV_WS)
    ATT_WG_Q_WS_VARIANTS_128(REG_WG_Q_WS)
}
template <class F>
static F lookup(const std::map<std::string, F>& m, const std::string& name) {
    auto it = m.find(name);
    if (it == m.end()) die(("no kernel " + name).c_str());
    return it->second;
}

#define PICK(NAME, HD) (HD == 32 ? NAME##_hd32 : HD == 64 ? NAME##_hd64 : NAME##_hd128)

static int run(int argc, char** argv) {
    if (argc != 13) die("usage: emulator run IN OUT B H KV T HD SCALE early|late FWD BWD");
    register_variants();
    const std::string in = argv[2], out_dir = argv[3];
    const int B = std::atoi(argv[4]), H = std::atoi(argv[5]), KV = std::atoi(argv[6]), T = std::atoi(argv[7]),
              HD = std::atoi(argv[8]);
    const float scale = std::strtof(argv[9], nullptr);
    g_late_copies = std::string(argv[10]) == "late";
    if (const char* us = std::getenv("ATT_EMULATOR_SLOW_WARP_US")) g_slow_warp_us = std::atoi(us);
    const std::string fwd = argv[11], bwd = argv[12];
    if (HD != 32 && HD != 64 && HD != 128) die("head dim");
    if (KV < 1 || H % KV != 0) die("kv heads must divide heads");
    const std::string hd_tag = "_hd" + std::to_string(HD);
    const size_t n = (size_t)B * T * H * HD, nl = (size_t)B * H * T, nqkv = (size_t)B * T * (H + 2 * KV) * HD;
    std::vector<u16> qkv = read_file<u16>(in + "/qkv.bin", nqkv);
    std::vector<u16> dout = read_file<u16>(in + "/dout.bin", n);
    std::vector<u16> out(n, 0xFFFF), dqkv(nqkv, 0xFFFF);
    std::vector<float> lse(nl, NAN), dvec(nl, NAN);
    reg(qkv), reg(dout), reg(out), reg(dqkv), reg(lse), reg(dvec);
    const float scale_log2 = scale * 1.4426950408889634f;
    const size_t rows = (size_t)B * H * T;
    const unsigned pairs = (unsigned)(B * H), kv_pairs = (unsigned)(B * KV);
    const auto blocks = [&](int per_block) { return (unsigned)((T + per_block - 1) / per_block); };

    // Forward.
    if (fwd == "simple") {
        FwdSimple f = PICK(attn_fwd_simple, HD);
        launch({(unsigned)std::min<size_t>(rows, 8), 1, 128, 0},
               [&] { f(qkv.data(), out.data(), lse.data(), B, T, H, KV, scale); });
    } else if (fwd.rfind("wg:", 0) == 0 && fwd.back() == 'w') {
        // The warp-specialised forward: tensor maps of qkv as [B][T][H + 2 KV][HD], boxes of 64 columns.
        int nwg, bn;
        if (std::sscanf(fwd.c_str(), "wg:g%dn%d", &nwg, &bn) != 2) die("wgmma forward variant");
        FwdWs f = lookup(g_wg_fwd_ws, "attn_fwd_wgmma_" + fwd.substr(3) + hd_tag);
        const int bm = 64 * nwg;
        const u64 heads = (u64)(H + 2 * KV), dims[4] = {(u64)HD, heads, (u64)T, (u64)B},
                  strides[3] = {(u64)HD * 2, heads * HD * 2, (u64)T * heads * HD * 2};
        AttTmaMap tq, tkv;
        tma_encode(&tq, qkv.data(), dims, strides, {64, 1, (u32)bm, 1});
        tma_encode(&tkv, qkv.data(), dims, strides, {64, 1, (u32)bn, 1});
        const size_t smem = (size_t)(bm + 2 * ATT_WS_STAGES * bn) * HD * 2 + (1 + 4 * ATT_WS_STAGES) * 8 + 1024;
        launch({pairs, blocks(bm), (unsigned)(128 * (nwg + 1)), smem},
               [&] { f(qkv.data(), out.data(), lse.data(), T, H, KV, scale_log2, tq, tkv); });
    } else if (fwd.rfind("wg:", 0) == 0) {
        int nwg, bn;
        if (std::sscanf(fwd.c_str(), "wg:g%dn%d", &nwg, &bn) != 2) die("wgmma forward variant");
        FwdMma f = lookup(g_wg_fwd, "attn_fwd_wgmma_" + fwd.substr(3) + hd_tag);
        const int bm = 64 * nwg, vbuf = fwd.back() == 'p' ? 3 : 2;
        const size_t smem = (size_t)(bm + (2 + vbuf) * bn) * HD * 2 + 1024;
        launch({pairs, blocks(bm), (unsigned)(128 * nwg), smem},
               [&] { f(qkv.data(), out.data(), lse.data(), T, H, KV, scale_log2); });
    } else {
        int nw, mt, bn;
        if (std::sscanf(fwd.c_str(), "w%dm%dn%d", &nw, &mt, &bn) != 3) die("forward variant");
        FwdMma f = lookup(g_fwd, "attn_fwd_" + fwd + hd_tag);
        const int bm = 16 * mt * nw;
        const size_t smem = (size_t)(bm + 4 * bn) * (HD + 8) * 2;
        launch({pairs, blocks(bm), (unsigned)(32 * nw), smem},
               [&] { f(qkv.data(), out.data(), lse.data(), T, H, KV, scale_log2); });
    }
    if (bwd == "none") {  // the forward alone (dqkv stays NaN)
        write_file(out_dir + "/out.bin", out);
        write_file(out_dir + "/lse.bin", lse);
        write_file(out_dir + "/dqkv.bin", dqkv);
        return 0;
    }
    // Backward: D, then the kernels.
    launch({(unsigned)std::min<size_t>((rows + 7) / 8, 4), 1, 256, 0},
           [&] { attn_bwd_dot_rows(out.data(), dout.data(), dvec.data(), B, T, H, HD); });
    if (bwd == "simple") {
        BwdSimple a = PICK(attn_bwd_simple_dq, HD), b = PICK(attn_bwd_simple_dkdv, HD);
        const unsigned g = (unsigned)std::min<size_t>(rows, 8);
        launch({g, 1, 128, 0},
               [&] { a(qkv.data(), dout.data(), lse.data(), dvec.data(), dqkv.data(), B, T, H, KV, scale); });
        launch({g, 1, 128, 0},
               [&] { b(qkv.data(), dout.data(), lse.data(), dvec.data(), dqkv.data(), B, T, H, KV, scale); });
    } else if (bwd.rfind("wgsep:", 0) == 0) {
        int kg, qg, qn;
        char kw = 0;
        const bool kws = std::sscanf(bwd.c_str(), "wgsep:g%d%c:g%dn%d", &kg, &kw, &qg, &qn) == 4 && kw == 'w';
        if (!kws && std::sscanf(bwd.c_str(), "wgsep:g%d:g%dn%d", &kg, &qg, &qn) != 3)
            die("wgmma separate backward variant");
        const bool qpipe = bwd.back() == 'p', qws = bwd.back() == 'w';
        const std::string qname = "attn_bwd_wgmma_q_g" + std::to_string(qg) + "n" + std::to_string(qn) +
                                  (qpipe ? "p" : qws ? "w" : "") + hd_tag;
        // Tensor maps of qkv and dout as [B][T][heads][HD], boxes of 64 columns (the warp-specialised
        // kernels).
        const u64 heads = (u64)(H + 2 * KV), dims[4] = {(u64)HD, heads, (u64)T, (u64)B},
                  strides[3] = {(u64)HD * 2, heads * HD * 2, (u64)T * heads * HD * 2},
                  odims[4] = {(u64)HD, (u64)H, (u64)T, (u64)B},
                  ostrides[3] = {(u64)HD * 2, (u64)H * HD * 2, (u64)T * H * HD * 2};
        if (kws) {
            BwdSepWs a = lookup(g_sep_ws, "attn_bwd_wgmma_kv_g" + std::to_string(kg) + "w" + hd_tag);
            AttTmaMap tkv, tq, tdo;
            tma_encode(&tkv, qkv.data(), dims, strides, {64, 1, (u32)(64 * kg), 1});
            tma_encode(&tq, qkv.data(), dims, strides, {64, 1, 64, 1});
            tma_encode(&tdo, dout.data(), odims, ostrides, {64, 1, 64, 1});
            launch({kv_pairs, blocks(64 * kg), (unsigned)(128 * (kg + 1)), (size_t)ATT_WG_KV_WS_SMEM(HD, kg)}, [&] {
                a(qkv.data(), dout.data(), lse.data(), dvec.data(), dqkv.data(), T, H, KV, scale, scale_log2, tkv, tq,
                  tdo);
            });
        } else {
            BwdSep a = lookup(g_sep, "attn_bwd_wgmma_kv_g" + std::to_string(kg) + hd_tag);
            launch({kv_pairs, blocks(64 * kg), (unsigned)(128 * kg), (size_t)ATT_WG_BWD_SMEM(HD, kg, 0)}, [&] {
                a(qkv.data(), dout.data(), lse.data(), dvec.data(), dqkv.data(), T, H, KV, scale, scale_log2);
            });
        }
        if (qws) {
            // The warp-specialised dQ kernel: tensor maps of Q (qkv), dO (dout) and K/V (qkv).
            BwdSepWs b = lookup(g_sep_ws, qname);
            const int bm = 64 * qg;
            AttTmaMap tq, tdo, tkv;
            tma_encode(&tq, qkv.data(), dims, strides, {64, 1, (u32)bm, 1});
            tma_encode(&tdo, dout.data(), odims, ostrides, {64, 1, (u32)bm, 1});
            tma_encode(&tkv, qkv.data(), dims, strides, {64, 1, (u32)qn, 1});
            const size_t smem = (size_t)(2 * bm + 2 * ATT_WS_STAGES * qn) * HD * 2 + (1 + 4 * ATT_WS_STAGES) * 8 + 1024;
            launch({pairs, blocks(bm), (unsigned)(128 * (qg + 1)), smem}, [&] {
                b(qkv.data(), dout.data(), lse.data(), dvec.data(), dqkv.data(), T, H, KV, scale, scale_log2, tq,
                  tdo, tkv);
            });
        } else {
            BwdSep b = lookup(g_sep, qname);
            launch({pairs, blocks(64 * qg), (unsigned)(128 * qg), (size_t)ATT_WG_DQ_SMEM(HD, qg, qn, qpipe ? 3 : 2)},
                   [&] { b(qkv.data(), dout.data(), lse.data(), dvec.data(), dqkv.data(), T, H, KV, scale, scale_log2); });
        }
    } else if (bwd == "wgord" || bwd == "wgordc") {
        // The ordered wgmma backward (wgordc: dQ's columns split between the warpgroups, head dim 128):
        // tensor maps of K/V (128-row boxes), Q and dO (64 rows); the turn counters start at zero.
        if (HD == 32) die("the wgmma backward has head dims 64 and 128");
        if (bwd == "wgordc" && HD != 128)
            die("the ordered backward splits dQ's columns at head dim 128 only");
        BwdOrdered f = bwd == "wgordc" ? attn_bwd_wgmma_ordered_cols_hd128
                       : HD == 64      ? attn_bwd_wgmma_ordered_hd64
                                       : attn_bwd_wgmma_ordered_hd128;
        const u64 heads = (u64)(H + 2 * KV), dims[4] = {(u64)HD, heads, (u64)T, (u64)B},
                  strides[3] = {(u64)HD * 2, heads * HD * 2, (u64)T * heads * HD * 2},
                  odims[4] = {(u64)HD, (u64)H, (u64)T, (u64)B},
                  ostrides[3] = {(u64)HD * 2, (u64)H * HD * 2, (u64)T * H * HD * 2};
        AttTmaMap tkv, tq, tdo;
        tma_encode(&tkv, qkv.data(), dims, strides, {64, 1, 128, 1});
        tma_encode(&tq, qkv.data(), dims, strides, {64, 1, 64, 1});
        tma_encode(&tdo, dout.data(), odims, ostrides, {64, 1, 64, 1});
        const int nqb = (T + 63) / 64, nkb = (T + 127) / 128;
        // The accumulator starts as NaN (key block 0 stores each tile first); the counters at zero.
        std::vector<float> acc((size_t)B * H * nqb * 64 * HD, NAN);
        std::vector<u32> turn((size_t)B * H * nqb, 0);
        reg(acc), reg(turn);
        launch({kv_pairs, blocks(128), 384, (size_t)ATT_WG_ORDERED_SMEM(HD)}, [&] {
            f(qkv.data(), dout.data(), lse.data(), dvec.data(), acc.data(), turn.data(), dqkv.data(), T, H, KV, scale,
              scale_log2, tkv, tq, tdo);
        });
        // Every tile was added once by each key block that reaches it.
        for (size_t tile = 0; tile < turn.size(); ++tile) {
            const int i = (int)(tile % nqb), want = std::min(i / 2, nkb - 1) + 1;
            if (turn[tile] != (u32)want) die("a dQ tile's turn counter ended wrong");
        }
        launch({(unsigned)std::min<size_t>((n + 255) / 256, 4), 1, 256, 0},
               [&] { attn_bwd_dq_tiles_convert(acc.data(), dqkv.data(), B, T, H, KV, HD, scale); });
        g_regions.pop_back();
        g_regions.pop_back();
    } else if (bwd.rfind("sep:", 0) == 0) {
        int kw, km, kq, qw, qm, qn, np = 0;
        const bool paired = std::sscanf(bwd.c_str(), "sep:p%dq%d:w%dm%dn%d", &np, &kq, &qw, &qm, &qn) == 5;
        if (paired) {
            kw = 2 * np;
            km = 2;
        } else if (std::sscanf(bwd.c_str(), "sep:w%dm%dq%d:w%dm%dn%d", &kw, &km, &kq, &qw, &qm, &qn) != 6) {
            die("separate backward variant");
        }
        const std::string kv_tag = bwd.substr(4, bwd.find(':', 4) - 4), dq_tag = bwd.substr(bwd.find(':', 4) + 1);
        BwdSep a = lookup(g_sep, "attn_bwd_dkdv_" + kv_tag + hd_tag), b = lookup(g_sep, "attn_bwd_dq_" + dq_tag + hd_tag);
        const int bn = paired ? 32 * np : 16 * km * kw, bm = 16 * qm * qw;
        const size_t smem_a = (size_t)(2 * bn + 4 * kq) * (HD + 8) * 2 + 4 * kq * 4 + (paired ? (size_t)bn * kq * 4 : 0);
        const size_t smem_b = (size_t)(2 * bm + 4 * qn) * (HD + 8) * 2;
        launch({kv_pairs, blocks(bn), (unsigned)(32 * kw), smem_a}, [&] {
            a(qkv.data(), dout.data(), lse.data(), dvec.data(), dqkv.data(), T, H, KV, scale, scale_log2);
        });
        launch({pairs, blocks(bm), (unsigned)(32 * qw), smem_b}, [&] {
            b(qkv.data(), dout.data(), lse.data(), dvec.data(), dqkv.data(), T, H, KV, scale, scale_log2);
        });
    } else {
        int bwd_rows = 0, splits_arg = 0;
        char mode[16] = {0};
        const bool wg = bwd.rfind("wg:", 0) == 0;  // the wgmma backward: wg:det:<SPLITS> | wg:atomic
        if (wg) {
            bwd_rows = 64;
            if (std::sscanf(bwd.c_str(), "wg:%15[a-z]:%d", mode, &splits_arg) < 1) die("backward variant");
        } else if (std::sscanf(bwd.c_str(), "fused:q%d:%15[a-z]:%d", &bwd_rows, mode, &splits_arg) < 2) {
            die("backward variant");
        }
        const bool atomic = std::string(mode) == "atomic";
        const int nkb = (T + 63) / 64;
        int splits, nbuf;
        if (atomic) {
            splits = nkb;
            nbuf = 1;
        } else {
            const int np = std::max(1, B * KV);
            splits = splits_arg > 0 ? splits_arg : (2 * 132 + np - 1) / np;
            splits = std::max(1, std::min(splits, nkb));
            nbuf = splits;
        }
        std::vector<float> acc((size_t)nbuf * n, 0.0f);
        reg(acc);
        const u64 stride = nbuf > 1 ? (u64)n : 0;
        BwdFused f = bwd_rows == 64 ? PICK(attn_bwd_fused_q64, HD) : PICK(attn_bwd_fused_q32, HD);
        size_t smem = (size_t)(2 * 64 + 4 * bwd_rows) * (HD + 8) * 2 + 64 * (bwd_rows + 8) * 2 + 4 * bwd_rows * 4;
        if (wg) {
            if (HD == 32) die("the wgmma backward has head dims 64 and 128");
            f = HD == 64 ? attn_bwd_wgmma_fused_hd64 : attn_bwd_wgmma_fused_hd128;
            smem = ATT_WG_BWD_SMEM(HD, 1, 1);
        }
        launch({kv_pairs, (unsigned)splits, 128, smem}, [&] {
            f(qkv.data(), dout.data(), lse.data(), dvec.data(), acc.data(), stride, dqkv.data(), T, H, KV, scale,
              scale_log2);
        });
        launch({(unsigned)std::min<size_t>((n + 255) / 256, 4), 1, 256, 0},
               [&] { attn_bwd_dq_convert(acc.data(), nbuf, (u64)n, dqkv.data(), (u64)n, H, KV, HD, scale); });
        g_regions.pop_back();
    }
    write_file(out_dir + "/out.bin", out);
    write_file(out_dir + "/lse.bin", lse);
    write_file(out_dir + "/dqkv.bin", dqkv);
    return 0;
}

static int probe(int argc, char** argv) {
    if (argc != 5) die("usage: emulator probe abt|pb|atb IN OUT");
    const std::string which = argv[2], in = argv[3], out_dir = argv[4];
    std::vector<u16> b = read_file<u16>(in + "/b.bin", 4096);
    std::vector<float> out(4096, NAN);
    reg(b), reg(out);
    const size_t smem = 4 * 64 * 72 * 2;
    if (which == "pb") {
        std::vector<float> a = read_file<float>(in + "/a.bin", 4096);
        reg(a);
        launch({1, 1, 128, smem}, [&] { attn_probe_pb(a.data(), b.data(), out.data()); });
    } else {
        std::vector<u16> a = read_file<u16>(in + "/a.bin", 4096);
        reg(a);
        if (which == "abt")
            launch({1, 1, 128, smem}, [&] { attn_probe_abt(a.data(), b.data(), out.data()); });
        else
            launch({1, 1, 128, smem}, [&] { attn_probe_atb(a.data(), b.data(), out.data()); });
    }
    write_file(out_dir + "/out.bin", out);
    return 0;
}

// emulator wgprobe abt16|abt|pv HD IN OUT: IN/a.bin (bf16 [64][64] for abt16, [64][HD] for abt; f32
// [64][64] for pv), IN/b.bin (bf16 [64][HD]) -> OUT/out.bin (f32 [64][64], [64][HD] for pv).
static int wgprobe(int argc, char** argv) {
    if (argc != 6) die("usage: emulator wgprobe abt16|abt|pv HD IN OUT");
    const std::string which = argv[2], in = argv[4], out_dir = argv[5];
    const int hd = std::atoi(argv[3]);
    if (hd != 64 && hd != 128) die("wgmma probe head dim");
    std::vector<u16> b = read_file<u16>(in + "/b.bin", (size_t)64 * hd);
    std::vector<float> out((size_t)64 * (which == "pv" ? hd : 64), NAN);
    reg(b), reg(out);
    const Launch L{1, 1, 128, ATT_WG_PROBE_SMEM};
    if (which == "pv") {
        std::vector<float> p = read_file<float>(in + "/a.bin", 64 * 64);
        reg(p);
        if (hd == 64)
            launch(L, [&] { attn_wg_probe_pv_hd64(p.data(), b.data(), out.data(), 64 * 128, 1024); });
        else
            launch(L, [&] { attn_wg_probe_pv_hd128(p.data(), b.data(), out.data(), 64 * 128, 1024); });
    } else {
        std::vector<u16> a = read_file<u16>(in + "/a.bin", (size_t)64 * (which == "abt" ? hd : 64));
        reg(a);
        if (which == "abt16")
            launch(L, [&] { attn_wg_probe_abt16(a.data(), b.data(), out.data()); });
        else if (hd == 64)
            launch(L, [&] { attn_wg_probe_abt_hd64(a.data(), b.data(), out.data()); });
        else
            launch(L, [&] { attn_wg_probe_abt_hd128(a.data(), b.data(), out.data()); });
    }
    write_file(out_dir + "/out.bin", out);
    return 0;
}

int main(int argc, char** argv) {
    if (argc >= 2 && std::string(argv[1]) == "run") return run(argc, argv);
    if (argc >= 2 && std::string(argv[1]) == "probe") return probe(argc, argv);
    if (argc >= 2 && std::string(argv[1]) == "wgprobe") return wgprobe(argc, argv);
    die("usage: emulator run ... | emulator probe ... | emulator wgprobe ...");
}
