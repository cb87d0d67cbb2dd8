// Fused Adam / AdamW over a range of buffers, one pass (see src/adam/mod.rs for the exact definition), with
// the coefficients passed by value or read from a device buffer (with a skip flag).
//
// Compiled after cuda/common.cuh. Every floating-point operation is an explicit, separately rounded PTX
// instruction (mul_rn, add_rn, div_rn, sqrt_rn; no FMA contraction, no flush-to-zero) in the same order as
// the CPU implementation, so CPU and GPU produce identical bits.

// Mirrors fp8_kernels::adam::AdamCoefficients (#[repr(C)]).
struct AdamCoef {
    float beta1, one_minus_beta1, beta2, one_minus_beta2;
    float step_size, bc2_sqrt, eps, weight_decay, decay, grad_scale;
    int maximize, l2, decoupled, pad;
};

#define F16_MAX 65504.0f
// Word of a coefficient buffer holding the skip flag (after the 14 words of AdamCoef).
#define COEF_SKIP 14

__device__ __forceinline__ float sqrt_rn(float x) {
    float r;
    asm("sqrt.rn.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// Round to f16, saturating finite values at +-65504 (NaN stays NaN).
__device__ __forceinline__ u16 f32_to_f16_sat(float x) {
    if (fabsf(x) > F16_MAX) x = copysignf(F16_MAX, x);
    return f32_to_f16(x);
}

__device__ __forceinline__ void adam_element(const AdamCoef& c, float g_raw, float& w, float& m, float& v) {
    float g = mul_rn(g_raw, c.grad_scale);
    if (c.maximize) g = -g;
    if (c.l2) g = add_rn(g, mul_rn(c.weight_decay, w));
    m = add_rn(mul_rn(m, c.beta1), mul_rn(g, c.one_minus_beta1));
    v = add_rn(mul_rn(v, c.beta2), mul_rn(mul_rn(g, g), c.one_minus_beta2));
    if (c.decoupled) w = mul_rn(w, c.decay);
    const float denom = add_rn(div_rn(sqrt_rn(v), c.bc2_sqrt), c.eps);
    w = add_rn(w, -mul_rn(c.step_size, div_rn(m, denom)));
}

// ---- F32 states: master, m, v in f32; amax of the new master into amax[amax_slot] (if amax != null) ----
template <class G>
__device__ void adam_f32_impl(float* master, float* m, float* v, const typename G::T* grad, u64 offset,
                              u64 n, AdamCoef c, float* amax, u64 amax_slot) {
    int aw = 0;
    const u64 nvec = (offset % 8 == 0) ? n / 8 : 0;
    for (u64 t = global_thread(); t < nvec; t += grid_threads()) {
        const u64 i = offset + t * 8;
        float g[8], w[8], mm[8], vv[8];
        G::load8(grad, i, g);
        TF32::load8(master, i, w);
        TF32::load8(m, i, mm);
        TF32::load8(v, i, vv);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            adam_element(c, g[k], w[k], mm[k], vv[k]);
            aw = imax(aw, abs_bits_no_nan(w[k]));
        }
        TF32::store8(master, i, w);
        TF32::store8(m, i, mm);
        TF32::store8(v, i, vv);
    }
    for (u64 j = nvec * 8 + global_thread(); j < n; j += grid_threads()) {
        const u64 i = offset + j;
        float w = master[i], mm = m[i], vv = v[i];
        adam_element(c, G::load(grad, i), w, mm, vv);
        aw = imax(aw, abs_bits_no_nan(w));
        master[i] = w;
        m[i] = mm;
        v[i] = vv;
    }
    block_amax_commit(aw, amax ? amax + amax_slot : nullptr);
}

// ---- Low-precision states: master f16, m E4M3, v f16, each with a read scale_inv and a write scale ----
// scales[sbase + 0..6] = master scale_inv, master scale, m scale_inv, m scale, v scale_inv, v scale.
// amax[abase + 0..3] is raised to the amax of the new master, m and v (f32 values before rounding).
template <class G>
__device__ void adam_lp_impl(u16* master, u8* m8, u16* v16, const typename G::T* grad, u64 offset, u64 n,
                             AdamCoef c, const float* scales, u64 sbase, float* amax, u64 abase) {
    const float w_si = scales[sbase + 0], w_s = scales[sbase + 1];
    const float m_si = scales[sbase + 2], m_s = scales[sbase + 3];
    const float v_si = scales[sbase + 4], v_s = scales[sbase + 5];
    int aw = 0, am = 0, av = 0;
    const u64 nvec = (offset % 8 == 0) ? n / 8 : 0;
    for (u64 t = global_thread(); t < nvec; t += grid_threads()) {
        const u64 i = offset + t * 8;
        float g[8], w[8], mm[8], vv[8];
        G::load8(grad, i, g);
        TF16::load8(master, i, w);
        TF16::load8(v16, i, vv);
        const uint2 mc = *reinterpret_cast<const uint2*>(m8 + i);
        fp8x2_decode<FP8_E4M3>((u16)(mc.x & 0xFFFFu), mm[0], mm[1]);
        fp8x2_decode<FP8_E4M3>((u16)(mc.x >> 16), mm[2], mm[3]);
        fp8x2_decode<FP8_E4M3>((u16)(mc.y & 0xFFFFu), mm[4], mm[5]);
        fp8x2_decode<FP8_E4M3>((u16)(mc.y >> 16), mm[6], mm[7]);
        u16 wh[8], vh[8];
        float ms[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            w[k] = mul_rn(w[k], w_si);
            mm[k] = mul_rn(mm[k], m_si);
            vv[k] = mul_rn(vv[k], v_si);
            adam_element(c, g[k], w[k], mm[k], vv[k]);
            aw = imax(aw, abs_bits_no_nan(w[k]));
            am = imax(am, abs_bits_no_nan(mm[k]));
            av = imax(av, abs_bits_no_nan(vv[k]));
            wh[k] = f32_to_f16_sat(mul_rn(w[k], w_s));
            vh[k] = f32_to_f16_sat(mul_rn(vv[k], v_s));
            ms[k] = mul_rn(mm[k], m_s);
        }
        *reinterpret_cast<uint4*>(master + i) = pack_u16x8(wh);
        *reinterpret_cast<uint4*>(v16 + i) = pack_u16x8(vh);
        const u32 lo = (u32)fp8x2<FP8_E4M3>(ms[0], ms[1]) | ((u32)fp8x2<FP8_E4M3>(ms[2], ms[3]) << 16);
        const u32 hi = (u32)fp8x2<FP8_E4M3>(ms[4], ms[5]) | ((u32)fp8x2<FP8_E4M3>(ms[6], ms[7]) << 16);
        *reinterpret_cast<uint2*>(m8 + i) = make_uint2(lo, hi);
    }
    for (u64 j = nvec * 8 + global_thread(); j < n; j += grid_threads()) {
        const u64 i = offset + j;
        float w = mul_rn(f16_to_f32(master[i]), w_si);
        float mlo, mhi;
        fp8x2_decode<FP8_E4M3>((u16)m8[i], mlo, mhi);
        float mm = mul_rn(mlo, m_si);
        float vv = mul_rn(f16_to_f32(v16[i]), v_si);
        adam_element(c, G::load(grad, i), w, mm, vv);
        aw = imax(aw, abs_bits_no_nan(w));
        am = imax(am, abs_bits_no_nan(mm));
        av = imax(av, abs_bits_no_nan(vv));
        master[i] = f32_to_f16_sat(mul_rn(w, w_s));
        v16[i] = f32_to_f16_sat(mul_rn(vv, v_s));
        m8[i] = (u8)(fp8x2<FP8_E4M3>(mul_rn(mm, m_s), 0.0f) & 0xFFu);
    }
    // block_amax_commit reuses one shared array: separate the three reductions.
    block_amax_commit(aw, amax ? amax + abase + 0 : nullptr);
    __syncthreads();
    block_amax_commit(am, amax ? amax + abase + 1 : nullptr);
    __syncthreads();
    block_amax_commit(av, amax ? amax + abase + 2 : nullptr);
}

#define ADAM_KERNELS(GNAME, G)                                                                            \
    extern "C" __global__ void adam_f32_g_##GNAME(float* master, float* m, float* v, const G::T* grad,     \
                                                  u64 offset, u64 n, AdamCoef c, float* amax, u64 slot) {   \
        adam_f32_impl<G>(master, m, v, grad, offset, n, c, amax, slot);                                    \
    }                                                                                                      \
    extern "C" __global__ void adam_lp_g_##GNAME(u16* master, u8* m, u16* v, const G::T* grad, u64 offset, \
                                                 u64 n, AdamCoef c, const float* scales, u64 sbase,         \
                                                 float* amax, u64 abase) {                                  \
        adam_lp_impl<G>(master, m, v, grad, offset, n, c, scales, sbase, amax, abase);                     \
    }

ADAM_KERNELS(f32, TF32)
ADAM_KERNELS(bf16, TBF16)

// ---- Adam with coefficients (and the skip flag) read from the device; f32 or bf16 gradients ----
#define ADAM_CTL_KERNELS(GNAME, G)                                                                         \
    extern "C" __global__ void adam_f32_ctl_g_##GNAME(float* master, float* m, float* v, const G::T* grad, \
                                                      u64 offset, u64 n, const float* coef, float* amax,    \
                                                      u64 slot) {                                           \
        if (coef[COEF_SKIP] != 0.0f) return;                                                                \
        const AdamCoef c = *reinterpret_cast<const AdamCoef*>(coef);                                        \
        adam_f32_impl<G>(master, m, v, grad, offset, n, c, amax, slot);                                     \
    }                                                                                                       \
    extern "C" __global__ void adam_lp_ctl_g_##GNAME(u16* master, u8* m, u16* v, const G::T* grad,         \
                                                     u64 offset, u64 n, const float* coef,                  \
                                                     const float* scales, u64 sbase, float* amax,           \
                                                     u64 abase) {                                           \
        if (coef[COEF_SKIP] != 0.0f) return;                                                                \
        const AdamCoef c = *reinterpret_cast<const AdamCoef*>(coef);                                        \
        adam_lp_impl<G>(master, m, v, grad, offset, n, c, scales, sbase, amax, abase);                      \
    }

ADAM_CTL_KERNELS(f32, TF32)
ADAM_CTL_KERNELS(bf16, TBF16)
