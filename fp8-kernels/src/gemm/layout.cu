// Layout helpers for cuBLASLt FP8 GEMMs (see src/gemm/cuda.rs): Hopper FP8 GEMMs take only K-major ("TN")
// operands with dimensions that are multiples of 16, so other shapes are re-laid out into zero-padded
// temporaries here, and the padded f32 result is copied back out with the beta term.
//
// Compiled after cuda/common.cuh (bf16 conversion, FP8 decode, grid-stride helpers).

#define TILE 32
#define ROWS_PER_PASS 8

// dst[i, j] (dst_rows x dst_cols, row-major) = op(src)[i, j] where op(src) is src (src_rows x src_cols) or
// its transpose; positions outside op(src) are zero. 32x32 tiles through shared memory keep both the
// reads and the writes coalesced when transposing. Launch with blockDim (32, 8).
extern "C" __global__ void gemm_relayout_u8(const unsigned char* __restrict__ src, long long src_rows,
                                            long long src_cols, int transpose,
                                            unsigned char* __restrict__ dst, long long dst_rows,
                                            long long dst_cols) {
    __shared__ unsigned char tile[TILE][TILE + 1];
    long long op_rows = transpose ? src_cols : src_rows;
    long long op_cols = transpose ? src_rows : src_cols;
    long long tiles_y = (dst_rows + TILE - 1) / TILE;
    for (long long ty = blockIdx.y; ty < tiles_y; ty += gridDim.y) {
        long long r0 = ty * TILE;
        long long c0 = (long long)blockIdx.x * TILE;
        if (transpose) {
            // Read the source tile (rows c0.., cols r0..) coalesced along the source rows.
            for (int dy = threadIdx.y; dy < TILE; dy += ROWS_PER_PASS) {
                long long sr = c0 + dy;   // source row = op column
                long long sc = r0 + threadIdx.x;  // source col = op row
                unsigned char v = 0;
                if (sr < op_cols && sc < op_rows) v = src[sr * src_cols + sc];
                tile[threadIdx.x][dy] = v;
            }
            __syncthreads();
            for (int dy = threadIdx.y; dy < TILE; dy += ROWS_PER_PASS) {
                long long r = r0 + dy;
                long long c = c0 + threadIdx.x;
                if (r < dst_rows && c < dst_cols) dst[r * dst_cols + c] = tile[dy][threadIdx.x];
            }
            __syncthreads();
        } else {
            for (int dy = threadIdx.y; dy < TILE; dy += ROWS_PER_PASS) {
                long long r = r0 + dy;
                long long c = c0 + threadIdx.x;
                if (r < dst_rows && c < dst_cols) {
                    unsigned char v = 0;
                    if (r < op_rows && c < op_cols) v = src[r * src_cols + c];
                    dst[r * dst_cols + c] = v;
                }
            }
        }
    }
}

// The transposing case of gemm_relayout_u8 with 4-byte accesses: dst[i, j] = src[j, i] inside src, zero
// outside, for src_cols and dst_cols multiples of 4 (so every word read or written lies wholly inside or
// wholly outside its matrix's columns). A block moves a 64 x 64 tile: 256 threads each read 4 words of 4
// source rows, write them to shared memory, then each gather 4 words of the transpose (one byte from each
// of 4 tile rows per word) and write them. A byte per access in gemm_relayout_u8 left the transposes
// bound by instruction issue, not by memory.
#define T4 64
#define T4_STRIDE (T4 + 4)
extern "C" __global__ void __launch_bounds__(256) gemm_transpose_u8_v4(const unsigned char* __restrict__ src,
                                                                      long long src_rows, long long src_cols,
                                                                      unsigned char* __restrict__ dst,
                                                                      long long dst_rows, long long dst_cols) {
    __shared__ __align__(16) unsigned char tile[T4][T4_STRIDE];
    const int w = threadIdx.x & 15, sub = threadIdx.x >> 4;
    const long long tiles_y = (dst_rows + T4 - 1) / T4;
    for (long long ty = blockIdx.y; ty < tiles_y; ty += gridDim.y) {
        const long long r0 = ty * T4;                   // dst rows = source columns
        const long long c0 = (long long)blockIdx.x * T4;  // dst columns = source rows
        const long long sc = r0 + 4 * w;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int tr = sub + 16 * i;
            const long long sr = c0 + tr;
            unsigned int v = 0;
            if (sr < src_rows && sc < src_cols) v = *reinterpret_cast<const unsigned int*>(src + sr * src_cols + sc);
            *reinterpret_cast<unsigned int*>(&tile[tr][4 * w]) = v;
        }
        __syncthreads();
        const long long dc = c0 + 4 * w;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = sub + 16 * i;
            const long long dr = r0 + r;
            if (dr < dst_rows && dc < dst_cols) {
                const unsigned int v = (unsigned int)tile[4 * w][r] | ((unsigned int)tile[4 * w + 1][r] << 8) |
                                       ((unsigned int)tile[4 * w + 2][r] << 16) |
                                       ((unsigned int)tile[4 * w + 3][r] << 24);
                *reinterpret_cast<unsigned int*>(dst + dr * dst_cols + dc) = v;
            }
        }
        __syncthreads();
    }
}

// c[i, j] = tmp[i * ld + j] + beta * c[i, j] for i < rows, j < cols (c is rows x cols, f32).
// beta == 0 does not read c.
extern "C" __global__ void gemm_unpad_f32(const float* __restrict__ tmp, long long ld, long long rows,
                                          long long cols, float beta, float* __restrict__ c) {
    long long total = rows * cols;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        long long i = idx / cols, j = idx - i * cols;
        float v = tmp[i * ld + j];
        if (beta != 0.0f) v = add_rn(v, mul_rn(beta, c[idx]));
        c[idx] = v;
    }
}

// As gemm_unpad_f32 with a bf16 output (rounded once, to nearest even).
extern "C" __global__ void gemm_unpad_bf16(const float* __restrict__ tmp, long long ld, long long rows,
                                           long long cols, float beta, unsigned short* __restrict__ c) {
    long long total = rows * cols;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        long long i = idx / cols, j = idx - i * cols;
        float v = tmp[i * ld + j];
        if (beta != 0.0f) v = add_rn(v, mul_rn(beta, bf16_to_f32(c[idx])));
        c[idx] = f32_to_bf16(v);
    }
}

// dst[i] = bf16(decode(src[i]) * scale_inv[scale_idx]): FP8 operands of a GEMM that cuBLASLt cannot run
// in FP8 (E5M2 x E5M2). Exact when scale_inv is a power of two in range.
extern "C" __global__ void gemm_fp8_to_bf16(const unsigned char* __restrict__ src, int format,
                                            const float* __restrict__ scale_inv, long long scale_idx,
                                            unsigned short* __restrict__ dst, long long n) {
    float s = scale_inv[scale_idx];
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (long long)gridDim.x * blockDim.x) {
        float lo, hi;
        if (format == FP8_E4M3) {
            fp8x2_decode<FP8_E4M3>((u16)src[idx], lo, hi);
        } else {
            fp8x2_decode<FP8_E5M2>((u16)src[idx], lo, hi);
        }
        dst[idx] = f32_to_bf16(mul_rn(lo, s));
    }
}

// Block scales into the order cuBLASLt's block-scaled GEMMs read (src/gemm/block.rs): dst[i * dst_rs + j *
// dst_cs] = src[i * src_rs + j * src_cs] over a rows x cols grid of blocks. A transpose of the grid is the
// same copy with the source strides swapped. Padding entries of dst are not written.
extern "C" __global__ void gemm_block_scales_copy(const float* __restrict__ src, long long src_rs, long long src_cs,
                                                  float* __restrict__ dst, long long dst_rs, long long dst_cs,
                                                  long long rows, long long cols) {
    long long total = rows * cols;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        long long i = idx / cols, j = idx - i * cols;
        dst[i * dst_rs + j * dst_cs] = src[i * src_rs + j * src_cs];
    }
}
