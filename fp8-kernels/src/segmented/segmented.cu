// Kernels over a table of segments of a flat buffer (see src/segmented/mod.rs). Compiled after
// cuda/common.cuh.
//
// A segment table is a device array of u64 triples (start, end, slot): element range [start, end) of the
// buffer belongs to `slot`, whose amax and scale pair the kernels read or write. One launch covers every
// segment (gridDim.y = number of segments), however many there are. Loads are scalar: segment starts need
// not be 16-byte aligned.

// ---- per-segment amax: out[base + slot] = max(out[base + slot], max |x[start..end]|) ----
extern "C" __global__ void segmented_amax_f32(const float* x, const u64* table, float* out, u64 base) {
    const u64 start = table[3 * blockIdx.y], end = table[3 * blockIdx.y + 1], slot = table[3 * blockIdx.y + 2];
    int m = 0;
    for (u64 i = start + global_thread(); i < end; i += grid_threads()) m = max(m, abs_bits_no_nan(x[i]));
    block_amax_commit(m, out + base + slot);
}

// ---- per-weight scales from all-reduced amaxes: scales[2i] = scale, scales[2i+1] = 1 / scale ----
// A zero or non-finite amax keeps the previous scale (compute_scale_dev's rule).
extern "C" __global__ void segmented_scales(const float* amax, u64 base, u64 count, float* scales, float fmax,
                                            int margin) {
    for (u64 i = global_thread(); i < count; i += grid_threads()) {
        const float s = compute_scale_dev(amax[base + i], fmax, margin, 0, scales[2 * i]);
        scales[2 * i] = s;
        scales[2 * i + 1] = div_rn(1.0f, s);
    }
}

// ---- per-segment cast: y[i] = encode(x[i] * scales[2 * slot]) for i in the segment ----
template <int FMT>
__device__ void segmented_cast_impl(const float* x, u8* y, const u64* table, const float* scales) {
    const u64 start = table[3 * blockIdx.y], end = table[3 * blockIdx.y + 1], slot = table[3 * blockIdx.y + 2];
    const float s = scales[2 * slot];
    for (u64 i = start + global_thread(); i < end; i += grid_threads()) {
        const u16 r = fp8x2<FMT>(mul_rn(x[i], s), 0.0f);
        y[i] = (u8)(r & 0xFFu);
    }
}
extern "C" __global__ void segmented_cast_f32_e4m3(const float* x, u8* y, const u64* table, const float* scales) {
    segmented_cast_impl<FP8_E4M3>(x, y, table, scales);
}
extern "C" __global__ void segmented_cast_f32_e5m2(const float* x, u8* y, const u64* table, const float* scales) {
    segmented_cast_impl<FP8_E5M2>(x, y, table, scales);
}
