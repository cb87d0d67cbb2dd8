// FP8 casts, amax, dequantization (also accumulated into a destination), cast+transpose and 16/32-bit
// conversions (see src/cast/mod.rs). Compiled after cuda/common.cuh. Kernel names:
// <op>_<input type>[_<fp8 format>].

// Elements per thread per grid-stride step of the vectorised kernels: 16 inputs -> one 16-byte FP8 store.
#define CAST_VEC 16

// ---- amax ----
template <class In>
__device__ void amax_impl(const typename In::T* x, float* amax, int slot, u64 n) {
    int m = 0;
    // 16 elements per step: two independent 8-element loads in flight per thread.
    const u64 groups = n / 16;
    for (u64 g = global_thread(); g < groups; g += grid_threads()) {
        float a[8], b[8];
        In::load8(x, g * 16, a);
        In::load8(x, g * 16 + 8, b);
#pragma unroll
        for (int k = 0; k < 8; ++k) m = max(m, max(abs_bits_no_nan(a[k]), abs_bits_no_nan(b[k])));
    }
    for (u64 i = groups * 16 + global_thread(); i < n; i += grid_threads()) m = max(m, abs_bits_no_nan(In::load(x, i)));
    block_amax_commit(m, amax + slot);
}

// ---- one-pass cast with a device-resident scale, optional amax output (delayed scaling) ----
template <class In, int FMT>
__device__ __forceinline__ void cast16(const typename In::T* x, u8* y, u64 base, float scale, int& m) {
    float a[8], b[8];
    In::load8(x, base, a);
    In::load8(x, base + 8, b);
    float v[16];
#pragma unroll
    for (int k = 0; k < 8; ++k) { v[k] = a[k]; v[k + 8] = b[k]; }
    u32 w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int j = 4 * k;
#pragma unroll
        for (int t = 0; t < 4; ++t) m = max(m, abs_bits_no_nan(v[j + t]));
        const u16 a = fp8x2<FMT>(mul_rn(v[j], scale), mul_rn(v[j + 1], scale));
        const u16 b = fp8x2<FMT>(mul_rn(v[j + 2], scale), mul_rn(v[j + 3], scale));
        w[k] = (u32)a | ((u32)b << 16);
    }
    *reinterpret_cast<uint4*>(y + base) = make_uint4(w[0], w[1], w[2], w[3]);
}

// REVERSE walks the groups from the end: the current-scaling cast runs right after an amax pass that
// walked forward, so the tail of the input is still in L2 when it starts.
template <class In, int FMT, bool REVERSE>
__device__ __forceinline__ void cast_body(const typename In::T* x, u8* y, float scale, u64 n, int& m) {
    const u64 groups = n / CAST_VEC;
    for (u64 g = global_thread(); g < groups; g += grid_threads())
        cast16<In, FMT>(x, y, (REVERSE ? groups - 1 - g : g) * CAST_VEC, scale, m);
    for (u64 i = groups * CAST_VEC + global_thread(); i < n; i += grid_threads()) {
        const float v = In::load(x, i);
        m = max(m, abs_bits_no_nan(v));
        y[i] = (u8)(fp8x2<FMT>(mul_rn(v, scale), 0.0f) & 0xFF);
    }
}

template <class In, int FMT>
__device__ void cast_impl(const typename In::T* x, u8* y, const float* scale, float* amax, int slot, u64 n) {
    const float s = *scale;
    int m = 0;
    cast_body<In, FMT, false>(x, y, s, n, m);
    if (amax != nullptr) block_amax_commit(m, amax + slot);
}

// ---- current scaling: the scale is computed here from the amax of a previous pass ----
// Every block computes the same scale; block 0 also stores it and its inverse. A block may read *scale
// after block 0 wrote it: harmless, because the result does not depend on `previous` when the amax is
// usable and equals `previous` when it is not (the update is idempotent).
template <class In, int FMT>
__device__ void cast_current_impl(const typename In::T* x, u8* y, float* scale, float* scale_inv,
                                  const float* amax, float fmax, int margin, int exact, u64 n) {
    __shared__ float s_scale;
    if (threadIdx.x == 0) {
        const float s = compute_scale_dev(*amax, fmax, margin, exact, *scale);
        s_scale = s;
        if (blockIdx.x == 0) {
            *scale = s;
            *scale_inv = div_rn(1.0f, s);
        }
    }
    __syncthreads();
    int m = 0;
    cast_body<In, FMT, true>(x, y, s_scale, n, m);
}

// ---- dequantize: y = decode(q) * scale_inv ----
template <class Out, int FMT>
__device__ void dequant_impl(const u8* q, typename Out::T* y, const float* scale_inv, u64 n) {
    const float si = *scale_inv;
    const u64 groups = n / 16;
    for (u64 g = global_thread(); g < groups; g += grid_threads()) {
        const uint4 w = *reinterpret_cast<const uint4*>(q + g * 16);
        const u32 ws[4] = {w.x, w.y, w.z, w.w};
        float v[16];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            fp8x2_decode<FMT>((u16)(ws[k] & 0xFFFF), v[4 * k], v[4 * k + 1]);
            fp8x2_decode<FMT>((u16)(ws[k] >> 16), v[4 * k + 2], v[4 * k + 3]);
        }
        float a[8], b[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) { a[k] = mul_rn(v[k], si); b[k] = mul_rn(v[k + 8], si); }
        Out::store8(y, g * 16, a);
        Out::store8(y, g * 16 + 8, b);
    }
    for (u64 i = groups * 16 + global_thread(); i < n; i += grid_threads()) {
        float lo, hi;
        fp8x2_decode<FMT>((u16)q[i], lo, hi);
        Out::store(y, i, mul_rn(lo, si));
    }
}

// ---- cast + transpose: x [rows, cols] row-major -> yt [cols, rows] (and optionally y [rows, cols]) ----
// The tiles and the amax are common.cuh's cast_transpose_values, shared with the fused GELU casts.
template <class In, int FMT>
__device__ void cast_transpose_impl(const typename In::T* x, u8* y, u8* yt, const float* scale, float* amax, int slot,
                                    int rows, int cols) {
    cast_transpose_values<In, FMT>(x, nullptr, y, yt, scale, amax, slot, rows, cols, CastValue<In>());
}

// ---- conversions between f32, bf16, f16 ----
template <class Src, class Dst>
__device__ void convert_impl(const typename Src::T* x, typename Dst::T* y, u64 n) {
    const u64 groups = n / 8;
    for (u64 g = global_thread(); g < groups; g += grid_threads()) {
        float v[8];
        Src::load8(x, g * 8, v);
        Dst::store8(y, g * 8, v);
    }
    for (u64 i = groups * 8 + global_thread(); i < n; i += grid_threads()) Dst::store(y, i, Src::load(x, i));
}

// ---- extern "C" entry points ----
#define AMAX_ENTRY(NAME, IN) \
    extern "C" __global__ void amax_##NAME(const IN::T* x, float* amax, int slot, u64 n) { amax_impl<IN>(x, amax, slot, n); }
AMAX_ENTRY(f32, TF32)
AMAX_ENTRY(bf16, TBF16)
AMAX_ENTRY(f16, TF16)

#define CAST_ENTRY(NAME, IN, FNAME, FMT)                                                                     \
    extern "C" __global__ void cast_fp8_##NAME##_##FNAME(const IN::T* x, u8* y, const float* scale, float* amax, \
                                                         int slot, u64 n) {                                  \
        cast_impl<IN, FMT>(x, y, scale, amax, slot, n);                                                      \
    }                                                                                                        \
    extern "C" __global__ void cast_fp8_current_##NAME##_##FNAME(const IN::T* x, u8* y, float* scale,         \
                                                                 float* scale_inv, const float* amax,         \
                                                                 float fmax, int margin, int exact, u64 n) {  \
        cast_current_impl<IN, FMT>(x, y, scale, scale_inv, amax, fmax, margin, exact, n);                    \
    }                                                                                                        \
    extern "C" __global__ void cast_transpose_##NAME##_##FNAME(const IN::T* x, u8* y, u8* yt, const float* scale, \
                                                               float* amax, int slot, int rows, int cols) {     \
        cast_transpose_impl<IN, FMT>(x, y, yt, scale, amax, slot, rows, cols);                               \
    }
CAST_ENTRY(f32, TF32, e4m3, FP8_E4M3)
CAST_ENTRY(f32, TF32, e5m2, FP8_E5M2)
CAST_ENTRY(bf16, TBF16, e4m3, FP8_E4M3)
CAST_ENTRY(bf16, TBF16, e5m2, FP8_E5M2)
CAST_ENTRY(f16, TF16, e4m3, FP8_E4M3)
CAST_ENTRY(f16, TF16, e5m2, FP8_E5M2)

#define DEQUANT_ENTRY(FNAME, FMT, NAME, OUT)                                                                  \
    extern "C" __global__ void dequant_##FNAME##_##NAME(const u8* q, OUT::T* y, const float* scale_inv, u64 n) { \
        dequant_impl<OUT, FMT>(q, y, scale_inv, n);                                                           \
    }
DEQUANT_ENTRY(e4m3, FP8_E4M3, f32, TF32)
DEQUANT_ENTRY(e4m3, FP8_E4M3, bf16, TBF16)
DEQUANT_ENTRY(e4m3, FP8_E4M3, f16, TF16)
DEQUANT_ENTRY(e5m2, FP8_E5M2, f32, TF32)
DEQUANT_ENTRY(e5m2, FP8_E5M2, bf16, TBF16)
DEQUANT_ENTRY(e5m2, FP8_E5M2, f16, TF16)

#define CONVERT_ENTRY(SN, S, DN, D) \
    extern "C" __global__ void convert_##SN##_##DN(const S::T* x, D::T* y, u64 n) { convert_impl<S, D>(x, y, n); }
CONVERT_ENTRY(f32, TF32, bf16, TBF16)
CONVERT_ENTRY(f32, TF32, f16, TF16)
CONVERT_ENTRY(bf16, TBF16, f32, TF32)
CONVERT_ENTRY(f16, TF16, f32, TF32)
CONVERT_ENTRY(bf16, TBF16, f16, TF16)
CONVERT_ENTRY(f16, TF16, bf16, TBF16)

// ---- dequantize and accumulate: dst[i] += decode(q[i]) * scale_inv[0] (f32 destination) ----
template <int FMT>
__device__ void add_decoded_impl(float* dst, const u8* q, const float* scale_inv, u64 n) {
    const float si = *scale_inv;
    for (u64 i = global_thread(); i < n; i += grid_threads()) {
        float lo, hi;
        fp8x2_decode<FMT>((u16)q[i], lo, hi);
        dst[i] = add_rn(dst[i], mul_rn(lo, si));
    }
}
extern "C" __global__ void add_decoded_e4m3(float* dst, const u8* q, const float* scale_inv, u64 n) {
    add_decoded_impl<FP8_E4M3>(dst, q, scale_inv, n);
}
extern "C" __global__ void add_decoded_e5m2(float* dst, const u8* q, const float* scale_inv, u64 n) {
    add_decoded_impl<FP8_E5M2>(dst, q, scale_inv, n);
}

// ---- dst = bf16_rne(f32(dst) + decode(q[i]) * scale_inv[0]) (bf16 destination) ----
template <int FMT>
__device__ void add_decoded_to_bf16_impl(u16* dst, const u8* q, const float* scale_inv, u64 n) {
    const float si = *scale_inv;
    for (u64 i = global_thread(); i < n; i += grid_threads()) {
        float lo, hi;
        fp8x2_decode<FMT>((u16)q[i], lo, hi);
        dst[i] = f32_to_bf16(add_rn(bf16_to_f32(dst[i]), mul_rn(lo, si)));
    }
}
extern "C" __global__ void add_decoded_e4m3_to_bf16(u16* dst, const u8* q, const float* scale_inv, u64 n) {
    add_decoded_to_bf16_impl<FP8_E4M3>(dst, q, scale_inv, n);
}
extern "C" __global__ void add_decoded_e5m2_to_bf16(u16* dst, const u8* q, const float* scale_inv, u64 n) {
    add_decoded_to_bf16_impl<FP8_E5M2>(dst, q, scale_inv, n);
}

// ---- every f32 bit pattern through the FP8 conversion (exhaustive check) ----
// y[i] = encode(float(bits = start + i)) at scale 1. canonical_nan = 1: the function every cast kernel uses
// (NaN fixed up to 0x7F); canonical_nan = 0: the bare hardware instruction, to learn what it does with NaN.
template <int FMT>
__device__ void fp8_bits_impl(u8* y, u32 start, u64 n, int canonical_nan) {
    for (u64 i = global_thread(); i < n; i += grid_threads()) {
        const float v = __uint_as_float(start + (u32)i);
        const u16 r = canonical_nan ? fp8x2<FMT>(mul_rn(v, 1.0f), 0.0f) : fp8x2_raw<FMT>(v, 0.0f);
        y[i] = (u8)(r & 0xFF);
    }
}
extern "C" __global__ void fp8_bits_e4m3(u8* y, u32 start, u64 n, int canonical_nan) {
    fp8_bits_impl<FP8_E4M3>(y, start, n, canonical_nan);
}
extern "C" __global__ void fp8_bits_e5m2(u8* y, u32 start, u64 n, int canonical_nan) {
    fp8_bits_impl<FP8_E5M2>(y, start, n, canonical_nan);
}
