// Segmented and offset kernels for flat FSDP buffers. Prepended with common.cuh.
//
// A segment table is a device array of u64 triples (start, end, slot): element range [start, end) of a
// flat buffer belongs to the weight whose amax / scale pair lives at `slot`. One launch covers every
// segment of a unit (gridDim.y = number of segments), so a step issues one launch per unit, not one per
// weight. Loads are scalar: segment starts need not be 16-byte aligned (a shard may cut a weight).

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

// ---- dst[offset + i] += src[i] (a parameter's gradient into its flat buffer) ----
extern "C" __global__ void add_at_f32(float* dst, u64 offset, const float* src, u64 n) {
    for (u64 i = global_thread(); i < n; i += grid_threads()) dst[offset + i] = add_rn(dst[offset + i], src[i]);
}
extern "C" __global__ void add_at_bf16(float* dst, u64 offset, const u16* src, u64 n) {
    for (u64 i = global_thread(); i < n; i += grid_threads())
        dst[offset + i] = add_rn(dst[offset + i], bf16_to_f32(src[i]));
}

// ---- BF16 destinations (BF16 gradient shards): dst = bf16_rne(f32(dst) + src), one f32 add, one rounding ----
template <class S>
__device__ void add_at_to_bf16_impl(u16* dst, u64 offset, const typename S::T* src, u64 n) {
    for (u64 i = global_thread(); i < n; i += grid_threads())
        dst[offset + i] = f32_to_bf16(add_rn(bf16_to_f32(dst[offset + i]), S::load(src, i)));
}
extern "C" __global__ void add_at_f32_to_bf16(u16* dst, u64 offset, const float* src, u64 n) {
    add_at_to_bf16_impl<TF32>(dst, offset, src, n);
}
extern "C" __global__ void add_at_bf16_to_bf16(u16* dst, u64 offset, const u16* src, u64 n) {
    add_at_to_bf16_impl<TBF16>(dst, offset, src, n);
}

// ---- dst[i] += decode(q[i]) * scale_inv[0] (a reduced FP8 gradient chunk into its F32 shard) ----
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

// ---- dst = bf16_rne(f32(dst) + decode(q[i]) * scale_inv[0]) (into a BF16 shard) ----
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

// ---- gradient statistics before an FP8 cast: amax of the finite values, count of non-finite ones ----
// amax[0] = max(amax[0], max finite |x|); count[0] += number of NaN/inf (a saturating cast hides them).
extern "C" __global__ void finite_amax_count_f32(const float* x, float* amax, u32* count, u64 n) {
    int m = 0;
    u32 bad = 0;
    for (u64 i = global_thread(); i < n; i += grid_threads()) {
        const u32 a = __float_as_uint(x[i]) & 0x7FFFFFFFu;
        if (a >= 0x7F800000u) {
            ++bad;
        } else {
            m = max(m, (int)a);
        }
    }
    bad = __reduce_add_sync(0xFFFFFFFFu, bad);
    if ((threadIdx.x & 31) == 0 && bad != 0) atomicAdd(count, bad);
    block_amax_commit(m, amax);
}

// ---- scale of an FP8 gradient reduction from its all-reduced amax (one thread) ----
// The previous scale is 1 (fp8-core's convention for the gradient path): with amax 0 every value is 0.
extern "C" __global__ void grad_scale_from_amax(const float* amax, float* scale, float* scale_inv, float fmax,
                                                int margin) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const float s = compute_scale_dev(*amax, fmax, margin, 0, 1.0f);
    *scale = s;
    *scale_inv = div_rn(1.0f, s);
}
