// Rotary position embedding, rotate-half (see src/rope/mod.rs for the definitions). Compiled after
// cuda/common.cuh. One thread per pair (x[i], x[i + hd/2]) of a head: item = (token * slots + slot) * half + i
// with slots = H + 2 KV; slots below H + KV (the Q and K heads) are rotated, the V heads copied. f32 math
// with one rounding per operation (mul_rn/add_rn, never fused), as the CPU computes it.

template <class E>
__device__ void rope_impl(const typename E::T* x, typename E::T* out, const float* cos_t, const float* sin_t,
                          u64 tokens, int seq, int start_pos, int slots, int rotated_slots, int half,
                          int backward) {
    const u64 n = tokens * (u64)slots * (u64)half;
    const int hd = 2 * half;
    for (u64 item = global_thread(); item < n; item += grid_threads()) {
        const int i = (int)(item % (u64)half);
        const u64 head = item / (u64)half;  // token * slots + slot
        const int slot = (int)(head % (u64)slots);
        const u64 token = head / (u64)slots;
        const u64 base = head * (u64)hd;
        if (slot < rotated_slots) {
            const float x1 = E::load(x, base + i), x2 = E::load(x, base + i + half);
            const u64 t = (u64)start_pos + token % (u64)seq;
            const float c = cos_t[t * half + i];
            const float s0 = sin_t[t * half + i];
            const float s = backward ? -s0 : s0;
            E::store(out, base + i, add_rn(mul_rn(x1, c), -mul_rn(x2, s)));
            E::store(out, base + i + half, add_rn(mul_rn(x2, c), mul_rn(x1, s)));
        } else {
            // The stored words themselves: V passes bit for bit (NaN payloads included).
            out[base + i] = x[base + i];
            out[base + i + half] = x[base + i + half];
        }
    }
}

#define ROPE_ENTRY(NAME, E)                                                                                       \
    extern "C" __global__ void rope_##NAME(const E::T* x, E::T* out, const float* cos_t, const float* sin_t,       \
                                           u64 tokens, int seq, int start_pos, int slots, int rotated_slots,       \
                                           int half, int backward) {                                               \
        rope_impl<E>(x, out, cos_t, sin_t, tokens, seq, start_pos, slots, rotated_slots, half, backward);          \
    }
ROPE_ENTRY(f32, TF32)
ROPE_ENTRY(bf16, TBF16)
ROPE_ENTRY(f16, TF16)
