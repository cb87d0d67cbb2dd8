// Device-side control of an Adam step (see src/adam/control.rs for the definitions): the coefficients of
// the next step (or a skip) from reduced gradient statistics, the write scales of low-precision states,
// the commit of agreed amaxes, the values FP8 weights are cast from, and the casts of per-tensor and of 128x128
// block-scaled FP8 weights from their masters.
//
// Compiled after cuda/common.cuh, src/block_quantize/blocks128.cuh (bq_128x128_impl) and adam.cu (it uses
// AdamCoef, F16_MAX and COEF_SKIP). The control kernel works in f64 with explicitly rounded operations
// (__dadd_rn, __dmul_rn, __ddiv_rn, __dsqrt_rn; powers by squaring) in the order of the CPU implementation, so
// both devices derive the same coefficients and state scales bit for bit.

// Word offsets of the control buffer (mirrors adam::ctl).
#define CTL_STEP 0
#define CTL_SKIP_COUNT 1
#define CTL_LAST_SKIP 2
#define CTL_LAST_NONFINITE 3
#define CTL_LAST_SUMSQ 4
#define CTL_LEN 8
// Mirrors adam::control::ControlRepr (#[repr(C)]). decay_mode: 1 L2, 2 decoupled; max_grad_norm <= 0: no
// clipping; low != 0: low-precision states (write scales computed with the margins, slack and ratio factor).
struct StepParams {
    double lr, beta1, beta2, eps, weight_decay, max_grad_norm, clip_eps, bound_slack, ratio_factor;
    int maximize, decay_mode, low, master_margin, m_margin, v_margin;
    u64 slots, world_size;
};

__device__ __forceinline__ double powi_sq(double a, int b) {
    double r = 1.0;
    while (true) {
        if (b & 1) r = __dmul_rn(r, a);
        b >>= 1;
        if (b == 0) break;
        a = __dmul_rn(a, a);
    }
    return r;
}

// ---- the bound rule of the state scales (adam::control::state_bounds) ----
__device__ double update_ratio_bound(const StepParams& p, int t) {
    if (p.beta2 <= 0.0) return __longlong_as_double(0x7FF0000000000000LL);
    const double gamma = __ddiv_rn(__dmul_rn(p.beta1, p.beta1), p.beta2);
    double sum;
    if (fabs(__dadd_rn(gamma, -1.0)) < 1e-12) {
        sum = (double)t;
    } else {
        sum = __ddiv_rn(__dadd_rn(1.0, -powi_sq(gamma, t)), __dadd_rn(1.0, -gamma));
    }
    const double bc2_sqrt = __dsqrt_rn(__dadd_rn(1.0, -powi_sq(p.beta2, t)));
    const double a = __ddiv_rn(__dmul_rn(bc2_sqrt, __dadd_rn(1.0, -p.beta1)), __dsqrt_rn(__dadd_rn(1.0, -p.beta2)));
    return __dmul_rn(a, __dsqrt_rn(fmax(sum, 0.0)));
}

__device__ float scale_from_bound(double bound, float fmax_, int margin, float previous) {
    const double b = isnan(bound) ? 0.0 : fmin(bound, (double)3.40282346638528859812e+38);
    return compute_scale_dev(__double2float_rn(b), fmax_, margin, 0, previous);
}

// ---- skip decision, clipping, coefficients, write scales (one block) ----
extern "C" __global__ void adam_coefficients_from_stats(StepParams p, const float* sums, float* ctl, float* coef_out,
                                        const float* amaxes, const float* scales, float* write,
                                        float* kernel_scales, float* report) {
    const float nonfinite = sums[0];
    const float sumsq = sums[1];
    const double norm = __dsqrt_rn((double)sumsq);
    const bool skip = nonfinite != 0.0f || !isfinite(norm);
    const u32 step = __float_as_uint(ctl[CTL_STEP]);
    const u32 skipped = __float_as_uint(ctl[CTL_SKIP_COUNT]);
    if (skip) {
        __syncthreads();
        if (threadIdx.x == 0) {
            ctl[CTL_SKIP_COUNT] = __uint_as_float(skipped + 1);
            ctl[CTL_LAST_SKIP] = 1.0f;
            ctl[CTL_LAST_NONFINITE] = nonfinite;
            ctl[CTL_LAST_SUMSQ] = sumsq;
            coef_out[COEF_SKIP] = 1.0f;
            for (int k = 0; k < CTL_LEN; ++k) report[k] = ctl[k];
        }
        return;
    }
    double clip = 1.0;
    if (p.max_grad_norm > 0.0) clip = fmin(__ddiv_rn(p.max_grad_norm, __dadd_rn(norm, p.clip_eps)), 1.0);
    const u32 t_u = step + 1;
    const int t = (int)(t_u > 0x7FFFFFFFu ? 0x7FFFFFFFu : t_u);
    AdamCoef c;
    const double bc1 = __dadd_rn(1.0, -powi_sq(p.beta1, t));
    const double bc2 = __dadd_rn(1.0, -powi_sq(p.beta2, t));
    const bool wd = p.weight_decay != 0.0;
    c.beta1 = __double2float_rn(p.beta1);
    c.one_minus_beta1 = __double2float_rn(__dadd_rn(1.0, -p.beta1));
    c.beta2 = __double2float_rn(p.beta2);
    c.one_minus_beta2 = __double2float_rn(__dadd_rn(1.0, -p.beta2));
    c.step_size = __double2float_rn(__ddiv_rn(p.lr, bc1));
    c.bc2_sqrt = __double2float_rn(__dsqrt_rn(bc2));
    c.eps = __double2float_rn(p.eps);
    c.weight_decay = __double2float_rn(p.weight_decay);
    c.decay = __double2float_rn(__dadd_rn(1.0, -__dmul_rn(p.lr, p.weight_decay)));
    c.grad_scale = __double2float_rn(clip);
    c.maximize = p.maximize;
    c.l2 = (wd && p.decay_mode == 1) ? 1 : 0;
    c.decoupled = (wd && p.decay_mode == 2) ? 1 : 0;
    c.pad = 0;
    if (p.low) {
        const double ub = update_ratio_bound(p, t);
        for (u64 i = threadIdx.x; i < p.slots; i += blockDim.x) {
            float gmax = 0.0f;
            for (u64 r = 0; r < p.world_size; ++r) gmax = fmaxf(gmax, sums[2 + r * p.slots + i]);
            const double aw = __dmul_rn((double)amaxes[3 * i + 0], 1.0 + 1.0 / 2048.0);
            const double am = __dmul_rn((double)amaxes[3 * i + 1], 1.0 + 1.0 / 16.0);
            const double av = __dmul_rn((double)amaxes[3 * i + 2], 1.0 + 1.0 / 2048.0);
            double g = __dmul_rn((double)gmax, fabs((double)c.grad_scale));
            if (c.l2) g = __dadd_rn(g, __dmul_rn((double)c.weight_decay, aw));
            const double bm = __dadd_rn(__dmul_rn(p.beta1, am), __dmul_rn(__dadd_rn(1.0, -p.beta1), g));
            const double bv =
                __dadd_rn(__dmul_rn(p.beta2, av), __dmul_rn(__dmul_rn(__dadd_rn(1.0, -p.beta2), g), g));
            const double ratio = fmin(__ddiv_rn(bm, p.eps), __dmul_rn(p.ratio_factor, ub));
            const double decay = c.decoupled ? fmax(fabs((double)c.decay), 1.0) : 1.0;
            const double bw = __dadd_rn(__dmul_rn(aw, decay), __dmul_rn(fabs((double)c.step_size), ratio));
            const float sw = scale_from_bound(__dmul_rn(bw, p.bound_slack), F16_MAX, p.master_margin, scales[3 * i + 0]);
            const float sm = scale_from_bound(__dmul_rn(bm, p.bound_slack), 448.0f, p.m_margin, scales[3 * i + 1]);
            const float sv = scale_from_bound(__dmul_rn(bv, p.bound_slack), F16_MAX, p.v_margin, scales[3 * i + 2]);
            write[3 * i + 0] = sw;
            write[3 * i + 1] = sm;
            write[3 * i + 2] = sv;
            float* k = kernel_scales + 6 * i;
            k[0] = div_rn(1.0f, scales[3 * i + 0]);
            k[1] = sw;
            k[2] = div_rn(1.0f, scales[3 * i + 1]);
            k[3] = sm;
            k[4] = div_rn(1.0f, scales[3 * i + 2]);
            k[5] = sv;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const float* cw = reinterpret_cast<const float*>(&c);
        for (int k = 0; k < 14; ++k) coef_out[k] = cw[k];
        coef_out[COEF_SKIP] = 0.0f;
        ctl[CTL_STEP] = __uint_as_float(t_u);
        ctl[CTL_LAST_SKIP] = 0.0f;
        ctl[CTL_LAST_NONFINITE] = nonfinite;
        ctl[CTL_LAST_SUMSQ] = sumsq;
        for (int k = 0; k < CTL_LEN; ++k) report[k] = ctl[k];
    }
}

// ---- after the MAX all-reduce: agreed amaxes, new scales, the weights' amax vector ----
extern "C" __global__ void adam_commit_amaxes(const float* coef, const float* agreed, u64 per_slot, u64 slots,
                                       float* amaxes, float* scales, const float* write, float* weight_amax) {
    const bool skip = coef[COEF_SKIP] != 0.0f;
    for (u64 i = global_thread(); i < slots; i += grid_threads()) {
        if (skip) {
            // Zero keeps every weight's scale.
            weight_amax[i] = 0.0f;
            continue;
        }
        for (u64 k = 0; k < 3; ++k) amaxes[3 * i + k] = k < per_slot ? agreed[per_slot * i + k] : 0.0f;
        if (write != nullptr)
            for (u64 k = 0; k < 3; ++k) scales[3 * i + k] = write[3 * i + k];
        weight_amax[i] = agreed[per_slot * i];
    }
}

// The F32 values of a master (adam::control::MasterSource): master32[i], or the F16 master16[i] times msi, the
// inverse of its state scale (div_rn(1, scale), as the CPU computes it).
struct MasterValues {
    const float* master32;
    const u16* master16;
    float msi;
    __device__ __forceinline__ float operator()(u64 i) const {
        if (master16 != nullptr) return mul_rn(f16_to_f32(master16[i]), msi);
        return master32[i];
    }
};

// The F32 value element i of an FP8 weight is cast from (see weight_source_values below).
__device__ __forceinline__ float source_value(bool skip, const u8* fp8, u64 i, float wsi, MasterValues master) {
    if (skip) {
        float lo, hi;
        fp8x2_decode<FP8_E4M3>((u16)fp8[i], lo, hi);
        return mul_rn(lo, wsi);
    }
    return master(i);
}

// ---- the F32 values the FP8 weights are cast from, over out[off..off+n) ----
// Skipped: the current FP8 weight decoded (its cast with the kept scale gives the same codes back).
// Otherwise the F32 master (f16_master == null) or the F16 master times 1 / its scale.
extern "C" __global__ void weight_source_values(const float* coef, float* out, u64 off, u64 n, const u8* fp8,
                                        const float* weight_scales, u64 wslot, const float* master32,
                                        const u16* master16, const float* state_scales, u64 gslot) {
    const bool skip = coef[COEF_SKIP] != 0.0f;
    const float wsi = weight_scales[2 * wslot + 1];
    const float msi = master16 != nullptr ? div_rn(1.0f, state_scales[3 * gslot]) : 1.0f;
    for (u64 j = global_thread(); j < n; j += grid_threads()) {
        const u64 i = off + j;
        const float x = source_value(skip, fp8, i, wsi, MasterValues{master32, master16, msi});
        out[i] = x;
    }
}

// ---- weight_source_values fused with the weight cast, in place over fp8[off..off+n) ----
// x as weight_source_values computes it (with the weight's scale_inv AFTER segmented_scales: on a skipped step the
// amax is 0 and the scale pair is kept, so it is the same value), then fp8[i] = encode(x * scale) as
// segmented_cast does: the codes are bit-identical to weight_source_values + segmented_cast, without the F32
// buffer between them.
extern "C" __global__ void cast_weight_source(const float* coef, u8* fp8, u64 off, u64 n,
                                            const float* weight_scales, u64 wslot, const float* master32,
                                            const u16* master16, const float* state_scales, u64 gslot) {
    const bool skip = coef[COEF_SKIP] != 0.0f;
    const float ws = weight_scales[2 * wslot];
    const float wsi = weight_scales[2 * wslot + 1];
    const float msi = master16 != nullptr ? div_rn(1.0f, state_scales[3 * gslot]) : 1.0f;
    for (u64 j = global_thread(); j < n; j += grid_threads()) {
        const u64 i = off + j;
        const float x = source_value(skip, fp8, i, wsi, MasterValues{master32, master16, msi});
        fp8[i] = (u8)(fp8x2<FP8_E4M3>(mul_rn(x, ws), 0.0f) & 0xFFu);
    }
}

// ---- the 128x128 block-scaled cast of one weight piece from its master (adam::control::cast_weight_blocks) ----
// The master values of codes[off .. off + rows * cols), a row-major [rows, cols] piece, cast to E4M3 exactly as
// block_quantize's bq_128x128 kernels cast them (the same bq_128x128_impl): power-of-two scales (exact = 0), only
// the inverse scales written, block (i, j)'s at scale_inv[soff + i * ld + j]. A skipped step writes nothing. One
// block of 256 threads per 128x128 block; every thread reads the same skip flag, so the early return is uniform.
extern "C" __global__ void cast_weight_blocks(const float* coef, u8* codes, u64 off, int rows, int cols,
                                              float* scale_inv, u64 soff, u64 ld, float fmax, const float* master32,
                                              const u16* master16, const float* state_scales, u64 gslot) {
    if (coef[COEF_SKIP] != 0.0f) return;
    const float msi = master16 != nullptr ? div_rn(1.0f, state_scales[3 * gslot]) : 1.0f;
    const MasterValues master{master32 != nullptr ? master32 + off : nullptr,
                              master16 != nullptr ? master16 + off : nullptr, msi};
    bq_128x128_impl<FP8_E4M3>(master, codes + off, nullptr, scale_inv + soff, ld, 1, fmax, 0, rows, cols);
}
