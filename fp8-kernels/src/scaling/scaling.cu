// Scales from amaxes (see src/scaling/mod.rs). Compiled after cuda/common.cuh, whose compute_scale_dev
// reproduces fp8_core::compute_scale operation by operation.

// ---- scaling-meta update (one thread) ----
// state = [ring position, recorded (low 32 bits), recorded (high 32 bits)]; history is a ring whose
// entry at `position` is the oldest. Mirrors fp8_core::ScalingMeta::update_from_amax.
extern "C" __global__ void scaling_meta_update(float* scale, float* scale_inv, float* history, u32* state,
                                               float* amax_src, int slot, int reset_src, int history_len,
                                               int window_max, float fmax, int margin, int exact) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const float a = fabsf(amax_src[slot]);
    if (reset_src) amax_src[slot] = 0.0f;
    u32 pos = state[0];
    history[pos] = a;
    pos = (pos + 1) % (u32)history_len;
    state[0] = pos;
    const u64 rec = ((u64)state[2] << 32 | state[1]) + 1;
    state[1] = (u32)rec;
    state[2] = (u32)(rec >> 32);
    float w = 0.0f;
    if (window_max) {
        for (int i = 0; i < history_len; ++i) {
            const float h = history[i];
            if (isfinite(h) && h > w) w = h;
        }
    } else {
        const float h = history[(pos + history_len - 1) % history_len];
        w = isfinite(h) ? h : 0.0f;
    }
    const float s = compute_scale_dev(w, fmax, margin, exact, *scale);
    *scale = s;
    *scale_inv = div_rn(1.0f, s);
}

// ---- a scale from one amax (one thread), the previous scale taken as 1 (with amax 0 every value is 0) ----
extern "C" __global__ void scale_from_amax(const float* amax, float* scale, float* scale_inv, float fmax,
                                                int margin) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const float s = compute_scale_dev(*amax, fmax, margin, 0, 1.0f);
    *scale = s;
    *scale_inv = div_rn(1.0f, s);
}
