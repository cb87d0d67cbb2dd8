// Token (+ position) embeddings: forward gather and the deterministic backward. Prepended with common.cuh.
// src/embedding/mod.rs states the definitions; cpu.rs performs the same operations in the same order.
//
// Work items are (row, vector j of 8 columns): consecutive threads take consecutive vectors of one row, so
// loads and stores are coalesced 16-byte accesses when d is a multiple of 8 (element accesses otherwise, in
// the same order). The backward reads the host-built grouping of the batch (RowGroups): positions sorted by
// (id, position), cut into chunks of at most EMBEDDING_CHUNK positions that never span two ids.

__device__ __forceinline__ bool emb_aligned16(const void* p) { return ((unsigned long long)p & 15) == 0; }

// out[p] = table[ids[p]] (+ pos[p % seq]), f32 sum rounded once to the output type. An id outside 0..vocab
// (rejected when the RowGroups was built) reads nothing and writes zeros.
template <class E, class O>
__device__ void emb_fwd_impl(const typename E::T* table, const typename E::T* pos, const int* ids,
                             typename O::T* out, int n, int d, int vocab, int seq) {
    const int nvec = (d + 7) >> 3;
    const bool vec = (d & 7) == 0 && emb_aligned16(table) && emb_aligned16(out) && (pos == nullptr || emb_aligned16(pos));
    const u64 items = (u64)n * nvec;
    for (u64 it = global_thread(); it < items; it += grid_threads()) {
        const int p = (int)(it / nvec), j = (int)(it % nvec);
        const int id = ids[p];
        float v[8];
        if (id >= 0 && id < vocab) {
            load_vec8<E>(table + (u64)id * d, j, d, vec, v);
            if (pos != nullptr) {
                float w[8];
                load_vec8<E>(pos + (u64)(p % seq) * d, j, d, vec, w);
#pragma unroll
                for (int q = 0; q < 8; ++q) v[q] = add_rn(v[q], w[q]);
            }
        } else {
#pragma unroll
            for (int q = 0; q < 8; ++q) v[q] = 0.0f;
        }
        store_vec8<O>(out + (u64)p * d, j, d, vec, v);
    }
}

// Backward, level 1. index: order[n] (positions sorted by (id, position)), chunk_start[chunks + 1],
// chunk_dest[chunks] (a table row, or 0x80000000 | partial slot for ids with several chunks). Item
// (chunk c, vector j) sums dy over the chunk's positions in order from zero, then either adds the sum into
// d_table's row (d_table = D(d_table + sum)) or stores it as a partial.
template <class G, class D>
__device__ void emb_bwd_chunks_impl(const typename G::T* dy, const u32* order, const u32* chunk_start,
                                    const u32* chunk_dest, int chunks, int d, typename D::T* d_table, float* partial) {
    const int nvec = (d + 7) >> 3;
    const bool vec = (d & 7) == 0 && emb_aligned16(dy) && emb_aligned16(d_table);
    const u64 items = (u64)chunks * nvec;
    for (u64 it = global_thread(); it < items; it += grid_threads()) {
        const int c = (int)(it / nvec), j = (int)(it % nvec);
        float s[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) s[q] = 0.0f;
        const u32 q1 = chunk_start[c + 1];
#pragma unroll 4
        for (u32 k = chunk_start[c]; k < q1; ++k) {
            float v[8];
            load_vec8<G>(dy + (u64)order[k] * d, j, d, vec, v);
#pragma unroll
            for (int q = 0; q < 8; ++q) s[q] = add_rn(s[q], v[q]);
        }
        const u32 dest = chunk_dest[c];
        if (dest & 0x80000000u) {
            float* prow = partial + (u64)(dest & 0x7FFFFFFFu) * d;
            const int n = min(8, d - 8 * j);
            for (int q = 0; q < n; ++q) prow[8 * j + q] = s[q];
        } else {
            typename D::T* row = d_table + (u64)dest * d;
            float old[8];
            load_vec8<D>(row, j, d, vec, old);
#pragma unroll
            for (int q = 0; q < 8; ++q) old[q] = add_rn(old[q], s[q]);
            store_vec8<D>(row, j, d, vec, old);
        }
    }
}

// Backward, level 2, for ids with several chunks: multi_row[g] is the table row, partial slots
// multi_first[g] .. multi_first[g + 1] hold its chunk sums in chunk order; they are added left to right
// starting from the first, then into d_table's row.
template <class D>
__device__ void emb_bwd_multi_impl(const float* partial, const u32* multi_row, const u32* multi_first, int groups,
                                   int d, typename D::T* d_table) {
    const int nvec = (d + 7) >> 3;
    const bool vec = (d & 7) == 0 && emb_aligned16(d_table);
    const u64 items = (u64)groups * nvec;
    for (u64 it = global_thread(); it < items; it += grid_threads()) {
        const int g = (int)(it / nvec), j = (int)(it % nvec);
        const int n = min(8, d - 8 * j);
        const u32 k0 = multi_first[g], k1 = multi_first[g + 1];
        float s[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) s[q] = q < n ? partial[(u64)k0 * d + 8 * j + q] : 0.0f;
        for (u32 k = k0 + 1; k < k1; ++k) {
#pragma unroll
            for (int q = 0; q < 8; ++q)
                if (q < n) s[q] = add_rn(s[q], partial[(u64)k * d + 8 * j + q]);
        }
        typename D::T* row = d_table + (u64)multi_row[g] * d;
        float old[8];
        load_vec8<D>(row, j, d, vec, old);
#pragma unroll
        for (int q = 0; q < 8; ++q) old[q] = add_rn(old[q], s[q]);
        store_vec8<D>(row, j, d, vec, old);
    }
}

// Position-table gradient: d_pos[t] = D(d_pos[t] + sum over b in order of dy[b seq + t]), for t < seq.
template <class G, class D>
__device__ void emb_bwd_pos_impl(const typename G::T* dy, int batch, int seq, int d, typename D::T* d_pos) {
    const int nvec = (d + 7) >> 3;
    const bool vec = (d & 7) == 0 && emb_aligned16(dy) && emb_aligned16(d_pos);
    const u64 items = (u64)seq * nvec;
    for (u64 it = global_thread(); it < items; it += grid_threads()) {
        const int t = (int)(it / nvec), j = (int)(it % nvec);
        float s[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) s[q] = 0.0f;
#pragma unroll 4
        for (int b = 0; b < batch; ++b) {
            float v[8];
            load_vec8<G>(dy + ((u64)b * seq + t) * d, j, d, vec, v);
#pragma unroll
            for (int q = 0; q < 8; ++q) s[q] = add_rn(s[q], v[q]);
        }
        typename D::T* row = d_pos + (u64)t * d;
        float old[8];
        load_vec8<D>(row, j, d, vec, old);
#pragma unroll
        for (int q = 0; q < 8; ++q) old[q] = add_rn(old[q], s[q]);
        store_vec8<D>(row, j, d, vec, old);
    }
}

#define EMB_FWD_ENTRY(TN, E, ON, O)                                                                                  \
    extern "C" __global__ void embedding_fwd_##TN##_##ON(const E::T* table, const E::T* pos, const int* ids,       \
                                                         O::T* out, int n, int d, int vocab, int seq) {             \
        emb_fwd_impl<E, O>(table, pos, ids, out, n, d, vocab, seq);                                                 \
    }
EMB_FWD_ENTRY(f32, TF32, f32, TF32)
EMB_FWD_ENTRY(f32, TF32, bf16, TBF16)
EMB_FWD_ENTRY(bf16, TBF16, f32, TF32)
EMB_FWD_ENTRY(bf16, TBF16, bf16, TBF16)

#define EMB_BWD_ENTRIES(GN, G, DN, D)                                                                                \
    extern "C" __global__ void embedding_bwd_chunks_##GN##_##DN(const G::T* dy, const u32* order,                  \
                                                                const u32* chunk_start, const u32* chunk_dest,     \
                                                                int chunks, int d, D::T* d_table, float* partial) { \
        emb_bwd_chunks_impl<G, D>(dy, order, chunk_start, chunk_dest, chunks, d, d_table, partial);                 \
    }                                                                                                               \
    extern "C" __global__ void embedding_bwd_pos_##GN##_##DN(const G::T* dy, int batch, int seq, int d,            \
                                                             D::T* d_pos) {                                         \
        emb_bwd_pos_impl<G, D>(dy, batch, seq, d, d_pos);                                                           \
    }
EMB_BWD_ENTRIES(f32, TF32, f32, TF32)
EMB_BWD_ENTRIES(f32, TF32, bf16, TBF16)
EMB_BWD_ENTRIES(bf16, TBF16, f32, TF32)
EMB_BWD_ENTRIES(bf16, TBF16, bf16, TBF16)

#define EMB_MULTI_ENTRY(DN, D)                                                                                       \
    extern "C" __global__ void embedding_bwd_multi_##DN(const float* partial, const u32* multi_row,                \
                                                        const u32* multi_first, int groups, int d, D::T* d_table) { \
        emb_bwd_multi_impl<D>(partial, multi_row, multi_first, groups, d, d_table);                                 \
    }
EMB_MULTI_ENTRY(f32, TF32)
EMB_MULTI_ENTRY(bf16, TBF16)
