// Common definitions shared by every kernel module of fp8-kernels.
//
// NVRTC compiles each module as one string: this header is prepended with concat!, so it must not
// #include anything (NVRTC has no CUDA toolkit headers here). bf16 and f16 travel as raw 16-bit words
// and are converted with PTX instructions.
//
// The modules are compiled WITHOUT --use_fast_math and with --fmad=false: no flush-to-zero, IEEE
// division, no multiply-add contraction, so elementwise results equal the CPU (Rust) implementation bit
// for bit where the operation is a single rounding. The explicit mul_rn/add_rn below make that true even
// if the options change.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define FP8_E4M3 0
#define FP8_E5M2 1
// Mirrors fp8_core::SCALE_EXP_LIMIT.
#define SCALE_EXP_LIMIT 125

// f32 multiply / add, round to nearest even, subnormals kept (no .ftz), never fused.
__device__ __forceinline__ float mul_rn(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float add_rn(float a, float b) {
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float div_rn(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// ---- 16-bit float conversions (round to nearest even, like the `half` crate) ----
__device__ __forceinline__ float bf16_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
    return r;
}
__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// Element type tags: storage type T, load to f32, store from f32 (one rounding).
struct TF32 {
    typedef float T;
    static __device__ __forceinline__ float load(const float* p, u64 i) { return p[i]; }
    static __device__ __forceinline__ void store(float* p, u64 i, float v) { p[i] = v; }
    // 8 consecutive elements starting at i (i multiple of 8; buffers are 256-byte aligned).
    static __device__ __forceinline__ void load8(const float* p, u64 i, float (&v)[8]) {
        float4 a = *reinterpret_cast<const float4*>(p + i);
        float4 b = *reinterpret_cast<const float4*>(p + i + 4);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    }
    static __device__ __forceinline__ void store8(float* p, u64 i, const float (&v)[8]) {
        *reinterpret_cast<float4*>(p + i) = make_float4(v[0], v[1], v[2], v[3]);
        *reinterpret_cast<float4*>(p + i + 4) = make_float4(v[4], v[5], v[6], v[7]);
    }
};
__device__ __forceinline__ void unpack_u16x8(uint4 w, u16 (&h)[8]) {
    h[0] = (u16)(w.x & 0xFFFF); h[1] = (u16)(w.x >> 16);
    h[2] = (u16)(w.y & 0xFFFF); h[3] = (u16)(w.y >> 16);
    h[4] = (u16)(w.z & 0xFFFF); h[5] = (u16)(w.z >> 16);
    h[6] = (u16)(w.w & 0xFFFF); h[7] = (u16)(w.w >> 16);
}
__device__ __forceinline__ uint4 pack_u16x8(const u16 (&h)[8]) {
    return make_uint4((u32)h[0] | ((u32)h[1] << 16), (u32)h[2] | ((u32)h[3] << 16),
                      (u32)h[4] | ((u32)h[5] << 16), (u32)h[6] | ((u32)h[7] << 16));
}
// A 16-bit element type from its two conversions; store8 rounds element by element.
template <float (*TO_F32)(u16), u16 (*FROM_F32)(float)>
struct TU16 {
    typedef u16 T;
    static __device__ __forceinline__ float load(const u16* p, u64 i) { return TO_F32(p[i]); }
    static __device__ __forceinline__ void store(u16* p, u64 i, float v) { p[i] = FROM_F32(v); }
    static __device__ __forceinline__ void load8(const u16* p, u64 i, float (&v)[8]) {
        u16 h[8];
        unpack_u16x8(*reinterpret_cast<const uint4*>(p + i), h);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = TO_F32(h[k]);
    }
    static __device__ __forceinline__ void store8(u16* p, u64 i, const float (&v)[8]) {
        u16 h[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) h[k] = FROM_F32(v[k]);
        *reinterpret_cast<uint4*>(p + i) = pack_u16x8(h);
    }
};
struct TBF16 : TU16<bf16_to_f32, f32_to_bf16> {
    // Pairs rounded by one cvt.rn.bf16x2.f32 each (the same rounding as f32_to_bf16, half the conversion
    // instructions): the value of the first operand goes to the upper half, so element 2k + 1 comes first.
    static __device__ __forceinline__ void store8(u16* p, u64 i, const float (&v)[8]) {
        u32 w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[k]) : "f"(v[2 * k + 1]), "f"(v[2 * k]));
        *reinterpret_cast<uint4*>(p + i) = make_uint4(w[0], w[1], w[2], w[3]);
    }
};
struct TF16 : TU16<f16_to_f32, f32_to_f16> {};

// Vector j (elements 8j .. 8j+7) of a row of `len` elements: one 16-byte access when `vec`, else element
// accesses of the valid ones (the load gives 0 past the end, the store leaves it alone).
template <class E>
__device__ __forceinline__ void load_vec8(const typename E::T* row, int j, int len, bool vec, float (&v)[8]) {
    if (vec) {
        E::load8(row, (u64)8 * j, v);
    } else {
        const int n = min(8, len - 8 * j);
#pragma unroll
        for (int q = 0; q < 8; ++q) v[q] = q < n ? E::load(row, (u64)8 * j + q) : 0.0f;
    }
}
template <class E>
__device__ __forceinline__ void store_vec8(typename E::T* row, int j, int len, bool vec, const float (&v)[8]) {
    if (vec) {
        E::store8(row, (u64)8 * j, v);
    } else {
        const int n = min(8, len - 8 * j);
#pragma unroll
        for (int q = 0; q < 8; ++q)
            if (q < n) E::store(row, (u64)8 * j + q, v[q]);
    }
}

// ---- FP8 encode / decode with the hardware instructions ----
// The raw instruction: `lo` goes to the low byte, `hi` to the high byte.
template <int FMT>
__device__ __forceinline__ u16 fp8x2_raw(float lo, float hi) {
    u16 r;
    if (FMT == FP8_E4M3) {
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    }
    return r;
}
// As fp8_core::Fp8Format::encode: NaN becomes the canonical 0x7F whatever the hardware gives for it
// (two selects per pair; the kernels are memory bound).
template <int FMT>
__device__ __forceinline__ u16 fp8x2(float lo, float hi) {
    u16 r = fp8x2_raw<FMT>(lo, hi);
    if (lo != lo) r = (u16)((r & 0xFF00u) | 0x007Fu);
    if (hi != hi) r = (u16)((r & 0x00FFu) | 0x7F00u);
    return r;
}
// Two FP8 codes (low byte first) to two floats, exactly.
template <int FMT>
__device__ __forceinline__ void fp8x2_decode(u16 codes, float& lo, float& hi) {
    u32 h2;
    if (FMT == FP8_E4M3) {
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(codes));
    } else {
        // E5M2 is the top byte of an f16.
        h2 = ((u32)(codes & 0xFFu) << 8) | ((u32)(codes & 0xFF00u) << 16);
    }
    lo = f16_to_f32((u16)(h2 & 0xFFFFu));
    hi = f16_to_f32((u16)(h2 >> 16));
}

// |v| as ordered integer bits, NaN counted as 0 (NaN never raises an amax, as in fp8-core).
__device__ __forceinline__ int abs_bits_no_nan(float v) {
    u32 a = __float_as_uint(v) & 0x7FFFFFFFu;
    return a > 0x7F800000u ? 0 : (int)a;
}

// Block-wide max of non-negative int bits, then one atomicMax into *dst (as int: non-negative floats order
// like integers). Every thread of the block must call it. Any block shape whose thread count is a multiple
// of 32, <= 1024 (threads are numbered x fastest).
__device__ __forceinline__ void block_amax_commit(int m, float* dst) {
    __shared__ int warp_max[32];
    m = __reduce_max_sync(0xFFFFFFFFu, m);
    const int flat = threadIdx.y * blockDim.x + threadIdx.x;
    const int lane = flat & 31, warp = flat >> 5;
    if (lane == 0) warp_max[warp] = m;
    __syncthreads();
    if (warp == 0) {
        const int nw = (blockDim.x * blockDim.y + 31) >> 5;
        int v = lane < nw ? warp_max[lane] : 0;
        v = __reduce_max_sync(0xFFFFFFFFu, v);
        if (lane == 0 && dst != nullptr) atomicMax(reinterpret_cast<int*>(dst), v);
    }
}

// fp8_core::compute_scale, operation for operation (the f64 division and exponent read included).
__device__ __forceinline__ float pow2f_exact(int e) { return __uint_as_float((u32)(e + 127) << 23); }
__device__ float compute_scale_dev(float amax, float fmax, int margin, int exact, float previous) {
    if (!(isfinite(amax) && amax > 0.0f)) return previous;
    const double ratio = __ddiv_rn((double)fmax, (double)amax);
    const int floor_log2 = (int)((__double_as_longlong(ratio) >> 52) & 0x7FF) - 1023;
    const int e = floor_log2 - margin;
    const int ec = e < -SCALE_EXP_LIMIT ? -SCALE_EXP_LIMIT : (e > SCALE_EXP_LIMIT ? SCALE_EXP_LIMIT : e);
    if (!exact || e != ec) return pow2f_exact(ec);
    const double p = __longlong_as_double((i64)(margin + 1023) << 52);
    float s = __double2float_rn(__ddiv_rn(ratio, p));
    while (mul_rn(amax, s) > fmax) s = __uint_as_float(__float_as_uint(s) - 1u);
    return s;
}

// Butterfly sum over a warp: lane l ends with the same value in every lane; the CPU reproduces the order
// (32 lane-strided partial sums, then xor-pairs at distances 16, 8, 4, 2, 1).
__device__ __forceinline__ float warp_sum_butterfly(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = add_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
    return v;
}

__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

// Grid-stride helpers.
__device__ __forceinline__ u64 global_thread() { return (u64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ u64 grid_threads() { return (u64)gridDim.x * blockDim.x; }

// q = i / n and r = i % n, in 32 bits where both fit: a 64-bit division is a long software routine, and the
// value functors below find an element's row and column once per 8 values.
__device__ __forceinline__ void divmod_u64(u64 i, u64 n, u64& q, u64& r) {
    if (((i | n) >> 32) == 0) {
        const u32 a = (u32)i, b = (u32)n, qq = a / b;
        q = qq;
        r = a - qq * b;
    } else {
        q = i / n;
        r = i - q * n;
    }
}

// Eight values scaled by s and encoded into two words of four codes (element k in byte k % 4 of word
// k / 4); their |value| bits accumulate into m (the amax, NaN ignored).
template <int FMT>
__device__ __forceinline__ void encode8(const float (&h)[8], float s, int& m, u32 (&w)[2]) {
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        const int k = 4 * q;
        m = max(m, max(max(abs_bits_no_nan(h[k]), abs_bits_no_nan(h[k + 1])),
                       max(abs_bits_no_nan(h[k + 2]), abs_bits_no_nan(h[k + 3]))));
        const u32 lo = fp8x2<FMT>(mul_rn(h[k], s), mul_rn(h[k + 1], s));
        const u32 hi = fp8x2<FMT>(mul_rn(h[k + 2], s), mul_rn(h[k + 3], s));
        w[q] = lo | (hi << 16);
    }
}

// ---- vectorised FP8 cast + transpose over 64x64 tiles ----
// One block of 256 threads (blockDim (256, 1, 1)) per tile at a time: each thread loads 8 consecutive
// elements per pass with 16-byte loads, stores their 8 codes with one 8-byte store, and packs them into a
// shared tile; then each thread writes 16 consecutive codes of one transposed row with one 16-byte store.
// The value cast from element k is VAL::value(x, dy, i) (already rounded as its unfused kernel stores it),
// so each code and the amax equal those of the element-wise kernels bit for bit. Needs rows and cols to be
// multiples of 64 (the caller checks) and 16-byte aligned pointers (checked here; otherwise a plain
// element-wise loop runs instead). `m` accumulates the |value| bits for the caller's block amax.
#define CT64 64
template <class E, int FMT, class VAL>
__device__ void cast_transpose64(const typename E::T* x, const typename E::T* dy, u8* y, u8* yt, float s, int& m,
                                 int rows, int cols, const VAL& val) {
    __shared__ u32 tile[CT64][CT64 / 4 + 1];
    const unsigned long long align =
        (unsigned long long)x | (unsigned long long)dy | (unsigned long long)y | (unsigned long long)yt;
    if ((align & 15) != 0) {
        const u64 n = (u64)rows * cols;
        for (u64 i = global_thread(); i < n; i += grid_threads()) {
            const float h = val.value(x, dy, i);
            m = max(m, abs_bits_no_nan(h));
            const u8 code = (u8)(fp8x2<FMT>(mul_rn(h, s), 0.0f) & 0xFF);
            if (y != nullptr) y[i] = code;
            yt[(i % cols) * rows + i / cols] = code;
        }
        return;
    }
    const int tid = threadIdx.x;
    const int tiles_c = cols / CT64, tiles = (rows / CT64) * tiles_c;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        const int r0 = (t / tiles_c) * CT64, c0 = (t % tiles_c) * CT64;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int lr = (tid >> 3) + 32 * j, lc = (tid & 7) * 8;
            const u64 i = (u64)(r0 + lr) * cols + c0 + lc;
            float h[8];
            val.value8(x, dy, i, h);
            u32 w[2];
            encode8<FMT>(h, s, m, w);
            if (y != nullptr) *reinterpret_cast<uint2*>(y + i) = make_uint2(w[0], w[1]);
            tile[lr][lc / 4] = w[0];
            tile[lr][lc / 4 + 1] = w[1];
        }
        __syncthreads();
        {
            const int c = tid >> 2, rr = (tid & 3) * 16;
            const int word = c >> 2, shift = (c & 3) * 8;
            u32 out[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                u32 v = 0;
#pragma unroll
                for (int b = 0; b < 4; ++b) v |= ((tile[rr + 4 * q + b][word] >> shift) & 0xFFu) << (8 * b);
                out[q] = v;
            }
            *reinterpret_cast<uint4*>(yt + (u64)(c0 + c) * rows + r0 + rr) = make_uint4(out[0], out[1], out[2], out[3]);
        }
        __syncthreads();
    }
}

// The element type's rounding of an f32 (what storing an unfused kernel's output and reloading it does):
// the fused casts (GELU, SwiGLU) cast this value, so their codes equal the unfused kernel + cast.
template <class E>
__device__ __forceinline__ float round_through(float v) {
    typename E::T tmp[1];
    E::store(tmp, 0, v);
    return E::load(tmp, 0);
}

// The plain cast's value: the input element itself.
template <class E>
struct CastValue {
    __device__ __forceinline__ float value(const typename E::T* x, const typename E::T*, u64 i) const {
        return E::load(x, i);
    }
    __device__ __forceinline__ void value8(const typename E::T* x, const typename E::T*, u64 i, float (&h)[8]) const {
        E::load8(x, i, h);
    }
};

// ---- FP8 cast + transpose over 32x32 tiles, any shape: block (32, 8) ----
// Each tile's codes go through a shared tile; thread (x, y) covers rows y, y + 8, ... of the tile, then
// writes column elements of the transposed tile. The value of element i is VAL::value(x, dy, i), as in
// cast_transpose64. `m` accumulates the |value| bits for the caller's block amax.
#define CT32 32
template <class E, int FMT, class VAL>
__device__ void cast_transpose32(const typename E::T* x, const typename E::T* dy, u8* y, u8* yt, float s, int& m,
                                 int rows, int cols, const VAL& val) {
    __shared__ u8 tile[CT32][CT32 + 4];
    const int tiles_c = (cols + CT32 - 1) / CT32;
    const int tiles_r = (rows + CT32 - 1) / CT32;
    for (int t = blockIdx.x; t < tiles_r * tiles_c; t += gridDim.x) {
        const int r0 = (t / tiles_c) * CT32, c0 = (t % tiles_c) * CT32;
        for (int k = threadIdx.y; k < CT32; k += blockDim.y) {
            const int r = r0 + k, c = c0 + threadIdx.x;
            u8 code = 0;
            if (r < rows && c < cols) {
                const u64 i = (u64)r * cols + c;
                const float h = val.value(x, dy, i);
                m = max(m, abs_bits_no_nan(h));
                code = (u8)(fp8x2<FMT>(mul_rn(h, s), 0.0f) & 0xFF);
                if (y != nullptr) y[i] = code;
            }
            tile[k][threadIdx.x] = code;
        }
        __syncthreads();
        for (int k = threadIdx.y; k < CT32; k += blockDim.y) {
            const int c = c0 + k, r = r0 + threadIdx.x;
            if (r < rows && c < cols) yt[(u64)c * rows + r] = tile[threadIdx.x][k];
        }
        __syncthreads();
    }
}

// The row-major codes alone (no transpose wanted): a grid-stride loop over the block's threads, 8 values
// and one 8-byte store per step where the launch is the vectorised one (blockDim.y == 1: rows and cols
// multiples of 64, which VAL::value8 assumes: SwiGLU's backward reads 8 elements of one half of a row)
// and the pointers are 16-byte aligned, else one value at a time. The same values, codes and amax bits
// as the tiles.
template <class E, int FMT, class VAL>
__device__ void cast_values_rows(const typename E::T* x, const typename E::T* dy, u8* y, float s, int& m, int rows,
                                 int cols, const VAL& val) {
    const u64 n = (u64)rows * cols;
    const u64 tid = (u64)blockIdx.x * blockDim.x * blockDim.y + (u64)threadIdx.y * blockDim.x + threadIdx.x;
    const u64 nthreads = (u64)gridDim.x * blockDim.x * blockDim.y;
    const unsigned long long align = (unsigned long long)x | (unsigned long long)dy | (unsigned long long)y;
    if (blockDim.y == 1 && (align & 15) == 0) {
        for (u64 v = tid; v < n / 8; v += nthreads) {
            float h[8];
            val.value8(x, dy, 8 * v, h);
            u32 w[2];
            encode8<FMT>(h, s, m, w);
            *reinterpret_cast<uint2*>(y + 8 * v) = make_uint2(w[0], w[1]);
        }
        return;
    }
    for (u64 i = tid; i < n; i += nthreads) {
        const float h = val.value(x, dy, i);
        m = max(m, abs_bits_no_nan(h));
        y[i] = (u8)(fp8x2<FMT>(mul_rn(h, s), 0.0f) & 0xFF);
    }
}

// The FP8 cast + transpose of the cast and fused-GELU families: x [rows, cols] -> y = codes [rows, cols]
// (skipped when null), yt = codes of the transpose [cols, rows] (skipped when null: then the row-major
// codes alone, without the shared tiles), the amax of the values into amax[slot] (when not null). A
// one-dimensional block selects the vectorised 64x64 path (the caller launches it for shapes in multiples
// of 64), the (32, 8) block the 32x32 tiles.
template <class E, int FMT, class VAL>
__device__ void cast_transpose_values(const typename E::T* x, const typename E::T* dy, u8* y, u8* yt,
                                      const float* scale, float* amax, int slot, int rows, int cols, const VAL& val) {
    const float s = *scale;
    int m = 0;
    if (yt == nullptr) cast_values_rows<E, FMT>(x, dy, y, s, m, rows, cols, val);
    else if (blockDim.y == 1) cast_transpose64<E, FMT>(x, dy, y, yt, s, m, rows, cols, val);
    else cast_transpose32<E, FMT>(x, dy, y, yt, s, m, rows, cols, val);
    block_amax_commit(m, amax == nullptr ? nullptr : amax + slot);
}
