// Row gather for data loading. Prepended with common.cuh.
//
// out[r * row_len + j] = src[index[first + r] * row_len + j] for r < count, j < row_len, on 32-bit words
// (f32 pixels and i32 labels alike). Indices were validated on the host when the index buffer was built;
// an index at or past `rows` still cannot read out of bounds: its row is written as zero words.
extern "C" __global__ void gather_rows_b32(const u32* src, u64 rows, u64 row_len, const u32* index, u64 first,
                                           u64 count, u32* out) {
    const u64 n = count * row_len;
    for (u64 i = global_thread(); i < n; i += grid_threads()) {
        const u64 r = i / row_len, j = i - r * row_len;
        const u64 s = index[first + r];
        out[i] = s < rows ? src[s * row_len + j] : 0u;
    }
}
