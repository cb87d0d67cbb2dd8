// The two small kernels of every tensor-core backward (mma.sync and wgmma): D = rowsum(dO * O) before the
// backward, and the conversion of the F32 dQ accumulators into dqkv after it. Prepended with common.cuh;
// included in the mma source (attention.cu's module) and in the wgmma module, so each backward's module
// holds them.

// D[(b*H + h)*T + t] = sum_d dout[b,t,h,d] * out[b,t,h,d] (f32), one warp per (b, t, h) row, lanes over d
// in a fixed order, so the result does not depend on the launch.
extern "C" __global__ void attn_bwd_dot_rows(const u16* __restrict__ out, const u16* __restrict__ dout,
                                             float* __restrict__ dvec, int B, int T, int H, int HD) {
    const u64 rows = (u64)B * T * H;
    const int lane = threadIdx.x & 31;
    const u64 warps = (u64)gridDim.x * (blockDim.x >> 5);
    for (u64 r = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
        float s = 0.0f;
        for (int d = lane; d < HD; d += 32)
            s = __fmaf_rn(bf16_to_f32(dout[r * HD + d]), bf16_to_f32(out[r * HD + d]), s);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) {
            const u64 bt = r / H;
            const int h = (int)(r - bt * H);
            const u64 b = bt / T, t = bt - b * T;
            dvec[(b * H + h) * T + t] = s;
        }
    }
}

// dq slot of dqkv = bf16(scale * sum_{s < nbuf} acc[s * stride + i]) for every i of [B, T, H, HD], the
// buffers summed in order s = 0, 1, ... (deterministic).
extern "C" __global__ void attn_bwd_dq_convert(const float* __restrict__ acc, int nbuf, u64 stride,
                                               u16* __restrict__ dqkv, u64 n, int H, int KV, int HD,
                                               float scale) {
    const u64 row_len = (u64)H * HD, qkv_row = (u64)(H + 2 * KV) * HD;
    for (u64 i = global_thread(); i < n; i += grid_threads()) {
        float s = acc[i];
        for (int k = 1; k < nbuf; ++k) s += acc[(u64)k * stride + i];
        const u64 row = i / row_len, c = i - row * row_len;
        dqkv[row * qkv_row + c] = f32_to_bf16(s * scale);
    }
}

// The ordered wgmma backward's dQ (attn_bwd_wgmma_ordered, attention_wgmma.cu): the q slot of dqkv =
// bf16(scale * acc) from its accumulator of 64 x HD f32 tiles, tile (b * H + h) * nqb + i holding query rows
// 64 i .. 64 i + 63 of head h in the consumers' register order (element ((c * 4 + w) * 8 + r4) * 128 +
// 4 lane + j: row 16 w + lane / 4 + 8 (j / 2), column 64 c + 8 r4 + 2 (lane % 4) + j % 2). One thread per
// pair of adjacent columns (j even); rows >= T are skipped.
extern "C" __global__ void attn_bwd_dq_tiles_convert(const float* __restrict__ acc, u16* __restrict__ dqkv,
                                                     int B, int T, int H, int KV, int HD, float scale) {
    const int nqb = (T + 63) / 64;
    const u64 tile_len = (u64)64 * HD, pairs = (u64)B * H * nqb * tile_len / 2;
    const u64 qkv_row = (u64)(H + 2 * KV) * HD;
    for (u64 p = global_thread(); p < pairs; p += grid_threads()) {
        const u64 e = 2 * p, tile = e / tile_len;
        const int x = (int)(e - tile * tile_len);
        const int c = x >> 12, w = (x >> 10) & 3, r4 = (x >> 7) & 7, lane = (x >> 2) & 31, j = x & 3;
        const int row = 16 * w + (lane >> 2) + 8 * (j >> 1), col = 64 * c + 8 * r4 + 2 * (lane & 3);
        const u64 bh = tile / nqb;
        const int i = (int)(tile - bh * nqb), t = 64 * i + row;
        if (t >= T) continue;
        const u64 b = bh / H, h = bh - b * H;
        u16* dst = dqkv + ((u64)b * T + t) * qkv_row + h * HD + col;
        dst[0] = f32_to_bf16(acc[e] * scale);
        dst[1] = f32_to_bf16(acc[e + 1] * scale);
    }
}
