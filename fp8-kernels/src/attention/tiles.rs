//! Tile shapes of the tensor-core kernels: the variants compiled into the CUDA modules, and the default
//! choice per head dim ([`DEFAULT_TILES`], the table to edit after an `attention_bench --sweep` run).
//!
//! The variant lists mirror the X-macros of `attention.cu` (`ATT_FWD_VARIANTS_<hd>`) and
//! `attention_separate.cu` (`ATT_DKDV_VARIANTS_<hd>`, `ATT_DKDV_PAIR_VARIANTS_<hd>`,
//! `ATT_DQ_VARIANTS_<hd>`); the NVRTC test
//! `attention_module_compiles_for_sm90` checks that the PTX holds exactly these entry points. The wgmma
//! forward's list mirrors `ATT_WG_FWD_VARIANTS_<hd>` of `attention_wgmma.cu`
//! (`wgmma_module_compiles_for_sm90a` checks it).

use std::fmt;

/// Tiles of a kernel that walks query blocks (the forward, and the separate backward's dQ kernel):
/// `warps` warps of `16 * row_tiles` query rows each, so `16 * row_tiles * warps` query rows per block,
/// and key blocks of `key_rows` rows streamed through shared memory. Two row tiles per warp halve the
/// shared-memory reads per tensor-core operation and double the accumulator registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QueryTiles {
    /// Warps per block (4 or 8).
    pub warps: usize,
    /// 16-row tiles per warp (1 or 2).
    pub row_tiles: usize,
    /// Keys per streamed block.
    pub key_rows: usize,
}

impl QueryTiles {
    /// `warps` warps of `16 * row_tiles` rows, key blocks of `key_rows`.
    pub const fn new(warps: usize, row_tiles: usize, key_rows: usize) -> Self {
        QueryTiles {
            warps,
            row_tiles,
            key_rows,
        }
    }

    /// Query rows per block.
    pub fn block_rows(&self) -> usize {
        16 * self.row_tiles * self.warps
    }
}

/// `w<warps>m<row_tiles>n<key_rows>`, as in the kernel names (`attn_fwd_w4m1n64_hd64`).
impl fmt::Display for QueryTiles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "w{}m{}n{}", self.warps, self.row_tiles, self.key_rows)
    }
}

/// Tiles and schedule of the forward on Hopper's warpgroup MMA (`attn_fwd_wgmma_*`,
/// [`super::AttentionKernel::Wgmma`]): `warpgroups` warpgroups (128 threads each) of 64 query rows, so
/// `64 * warpgroups` query rows per block, and key blocks of `key_rows` keys streamed through shared
/// memory; `pipelined`: a warpgroup's softmax of key block `j` runs while its `P V` product of block
/// `j - 1` is in flight (FlashAttention-3's intra-warpgroup overlap, three value buffers) instead of after
/// it; `specialized`: the pipelined schedule with warp specialisation, a producer warpgroup loading every tile
/// with TMA into a [`WS_STAGES`]-deep pipeline of mbarriers while the warpgroups only compute (forward
/// only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WgmmaTiles {
    /// Warpgroups per block (1 to 3; the consumer warpgroups when `specialized`).
    pub warpgroups: usize,
    /// Keys per streamed block (64 or 128).
    pub key_rows: usize,
    /// The overlapped schedule.
    pub pipelined: bool,
    /// A producer warpgroup with TMA loads (implies `pipelined`).
    pub specialized: bool,
}

/// Key/value stages of the warp-specialised forward and dQ kernels (`ATT_WS_STAGES` of
/// attention_wgmma.cu).
pub const WS_STAGES: usize = 2;

/// Query-tile stages of the warp-specialised dK/dV kernel at `head_dim` (`ATT_KV_WS_STAGES`): three at
/// head dim 64, two at 128 (an H100, 2026-12-06: three took the hd-64 default pair from 2.185 to 2.070 ms
/// at the llama-1b shape; a build with three stages in every kernel was slower at hd 128).
pub fn kv_ws_stages(head_dim: usize) -> usize {
    if head_dim == 64 {
        3
    } else {
        2
    }
}

impl WgmmaTiles {
    /// `warpgroups` warpgroups of 64 rows, key blocks of `key_rows`, each product waited for before its
    /// result is used.
    pub const fn new(warpgroups: usize, key_rows: usize) -> Self {
        WgmmaTiles {
            warpgroups,
            key_rows,
            pipelined: false,
            specialized: false,
        }
    }

    /// As [`WgmmaTiles::new`], the softmax overlapping the previous block's `P V`.
    pub const fn pipelined(warpgroups: usize, key_rows: usize) -> Self {
        WgmmaTiles {
            warpgroups,
            key_rows,
            pipelined: true,
            specialized: false,
        }
    }

    /// As [`WgmmaTiles::pipelined`], with a producer warpgroup that loads the tiles by TMA (the forward).
    pub const fn warp_specialized(warpgroups: usize, key_rows: usize) -> Self {
        WgmmaTiles {
            warpgroups,
            key_rows,
            pipelined: true,
            specialized: true,
        }
    }

    /// `ATT_ONLY_C` of the kernel's single-kernel module: 0 plain, 1 pipelined, 2 warp-specialised.
    pub(crate) fn schedule_selector(&self) -> usize {
        if self.specialized {
            2
        } else {
            usize::from(self.pipelined)
        }
    }

    /// Threads per block: 128 per warpgroup, and a producer warpgroup's 128 when specialised.
    pub fn threads(&self) -> usize {
        128 * (self.warpgroups + usize::from(self.specialized))
    }

    /// Query rows per block.
    pub fn block_rows(&self) -> usize {
        64 * self.warpgroups
    }

    /// Value blocks in shared memory at once: two, three when pipelined, [`WS_STAGES`] when specialised.
    pub fn value_buffers(&self) -> usize {
        if self.specialized {
            WS_STAGES
        } else if self.pipelined {
            3
        } else {
            2
        }
    }

    /// Key blocks in shared memory at once: two, [`WS_STAGES`] when specialised.
    pub fn key_buffers(&self) -> usize {
        if self.specialized {
            WS_STAGES
        } else {
            2
        }
    }
}

/// `g<warpgroups>n<key_rows>`, with a `p` when pipelined or a `w` when warp-specialised, as in the
/// kernel names (`attn_fwd_wgmma_g2n128_hd128`, `..._g2n128p_hd128`, `..._g2n128w_hd128`).
impl fmt::Display for WgmmaTiles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = if self.specialized {
            "w"
        } else if self.pipelined {
            "p"
        } else {
            ""
        };
        write!(f, "g{}n{}{p}", self.warpgroups, self.key_rows)
    }
}

/// Head dims of the wgmma forward.
pub const WGMMA_HEAD_DIMS: [usize; 2] = [64, 128];

/// The wgmma forward's variants per head dim (`ATT_WG_FWD_VARIANTS_<hd>` and, warp-specialised,
/// `ATT_WG_FWD_WS_VARIANTS_<hd>` in attention_wgmma.cu), in the order of [`WGMMA_HEAD_DIMS`]; the first
/// is the default.
const WGMMA_FORWARD_VARIANTS: [&[WgmmaTiles]; 2] = [
    &[
        WgmmaTiles::new(2, 64),
        WgmmaTiles::new(2, 128),
        WgmmaTiles::new(3, 128),
        WgmmaTiles::pipelined(2, 128),
        WgmmaTiles::pipelined(3, 128),
        WgmmaTiles::warp_specialized(2, 64),
        WgmmaTiles::warp_specialized(2, 128),
        // FlashAttention-3's head-dim-64 forward tile: 192 query rows, key blocks of 128.
        WgmmaTiles::warp_specialized(3, 128),
    ],
    &[
        WgmmaTiles::warp_specialized(2, 128),
        WgmmaTiles::new(2, 128),
        WgmmaTiles::new(2, 64),
        WgmmaTiles::new(1, 128),
        WgmmaTiles::pipelined(2, 128),
        WgmmaTiles::pipelined(2, 64),
        WgmmaTiles::warp_specialized(2, 64),
    ],
];

/// The wgmma forward tiles compiled for `head_dim` (empty for a head dim it does not support).
pub fn wgmma_forward_variants(head_dim: usize) -> &'static [WgmmaTiles] {
    WGMMA_HEAD_DIMS
        .iter()
        .position(|&h| h == head_dim)
        .map_or(&[], |i| WGMMA_FORWARD_VARIANTS[i])
}

/// The wgmma forward tiles used when [`super::AttentionTiles::wgmma_forward`] is `None`, the fastest of
/// each head dim's variants on an H100 (`attention_bench --wgmma`, 2026-12-06): at head dim 64 two
/// warpgroups with the plain schedule and key blocks of 64 (1.17x the `mma.sync` forward at the
/// llama-1b shape; the warp-specialised g2n128w 1.12x, g2n64w 1.06x); at head dim 128 the
/// warp-specialised g2n128w (TMA producer warpgroup: 1.37x and 1.83x the `mma.sync` forward at B4 H20
/// T2048 and the llama-8b shape, 608 TFLOP/s there, against 1.23x and 1.37x for the plain g2n128).
pub fn default_wgmma_tiles(head_dim: usize) -> Option<WgmmaTiles> {
    wgmma_forward_variants(head_dim).first().copied()
}

/// The deterministic wgmma backward's two kernels (`attention_wgmma.cu`): the dK/dV kernel with
/// `kv_warpgroups` warpgroups of 64 keys per block (1 or 2; with `kv_specialized`, two consumer
/// warpgroups and a producer warpgroup loading by TMA), and the dQ kernel with `dq` tiles (warpgroups of
/// 64 query rows, key blocks of `dq.key_rows`).
///
/// Or, with `ordered` ([`WgmmaBackwardTiles::ORDERED`]), one fused kernel
/// (`attn_bwd_wgmma_ordered_hd<hd>`): the warp-specialised dK/dV kernel's blocks of 128 keys also
/// compute dQ per query tile and add it into an F32 accumulator with one bulk reduction per tile, the
/// key blocks taking turns in a fixed order (a counter per tile), so it is deterministic too: five
/// products per tile pair instead of seven. Its `kv_*` and `dq` fields are unused; `dq_columns`
/// ([`WgmmaBackwardTiles::ORDERED_COLUMNS`], head dim 128) splits dQ's columns between its two
/// consumer warpgroups instead of its keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WgmmaBackwardTiles {
    /// Warpgroups of the dK/dV kernel (64 keys each; the consumer warpgroups when specialised).
    pub kv_warpgroups: usize,
    /// The warp-specialised dK/dV kernel (two warpgroups only).
    pub kv_specialized: bool,
    /// Tiles of the dQ kernel.
    pub dq: WgmmaTiles,
    /// The fused kernel with the ordered dQ reduction instead of the two kernels.
    pub ordered: bool,
    /// With `ordered`: each consumer warpgroup computes half of dQ's columns over the block's 128 keys
    /// (head dim 128 only), instead of its 64 keys' part of every column summed with the other's.
    pub dq_columns: bool,
}

impl WgmmaBackwardTiles {
    /// The fused deterministic backward (one kernel, dQ reduced tile by tile in key-block order).
    pub const ORDERED: Self = WgmmaBackwardTiles {
        kv_warpgroups: 2,
        kv_specialized: true,
        dq: WgmmaTiles::new(1, 64),
        ordered: true,
        dq_columns: false,
    };

    /// [`WgmmaBackwardTiles::ORDERED`] with dQ's columns split between the consumer warpgroups (head
    /// dim 128): no per-tile meeting of the two warpgroups' sums, two block barriers per tile instead.
    pub const ORDERED_COLUMNS: Self = WgmmaBackwardTiles {
        dq_columns: true,
        ..Self::ORDERED
    };

    /// The plain dK/dV kernel with `kv_warpgroups` warpgroups and the dQ kernel with `dq`.
    pub const fn new(kv_warpgroups: usize, dq: WgmmaTiles) -> Self {
        WgmmaBackwardTiles {
            kv_warpgroups,
            kv_specialized: false,
            dq,
            ordered: false,
            dq_columns: false,
        }
    }

    /// The warp-specialised dK/dV kernel (two consumer warpgroups) and the dQ kernel with `dq`.
    pub const fn specialized_kv(dq: WgmmaTiles) -> Self {
        WgmmaBackwardTiles {
            kv_warpgroups: 2,
            kv_specialized: true,
            dq,
            ordered: false,
            dq_columns: false,
        }
    }

    /// Threads per block of the dK/dV kernel.
    pub fn kv_threads(&self) -> usize {
        128 * (self.kv_warpgroups + usize::from(self.kv_specialized))
    }
}

/// `kv g<kv_warpgroups>[w] q <dq>`, as in the kernel names (`attn_bwd_wgmma_kv_g2_hd128`,
/// `attn_bwd_wgmma_kv_g2w_hd128`, `attn_bwd_wgmma_q_g2n64_hd128`).
impl fmt::Display for WgmmaBackwardTiles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.ordered {
            return f.write_str(if self.dq_columns {
                "fused ordered cols"
            } else {
                "fused ordered"
            });
        }
        let w = if self.kv_specialized { "w" } else { "" };
        write!(f, "kv g{}{w} q {}", self.kv_warpgroups, self.dq)
    }
}

/// The dK/dV kernel's warpgroup counts per head dim (`ATT_WG_KV_VARIANTS_<hd>` in attention_wgmma.cu).
const WGMMA_KV_VARIANTS: [[usize; 2]; 2] = [[1, 2], [1, 2]];
/// The dQ kernel's tiles per head dim (`ATT_WG_Q_VARIANTS_<hd>`; pipelined: the next block's scores
/// overlap the previous block's `dQ += dS K`).
const WGMMA_DQ_VARIANTS_64: [WgmmaTiles; 8] = [
    WgmmaTiles::new(1, 64),
    WgmmaTiles::new(2, 64),
    WgmmaTiles::new(1, 128),
    WgmmaTiles::new(2, 128),
    WgmmaTiles::pipelined(1, 64),
    WgmmaTiles::pipelined(2, 64),
    WgmmaTiles::warp_specialized(2, 64),
    WgmmaTiles::warp_specialized(2, 128),
];
const WGMMA_DQ_VARIANTS_128: [WgmmaTiles; 4] = [
    WgmmaTiles::new(1, 64),
    WgmmaTiles::new(2, 64),
    WgmmaTiles::pipelined(1, 64),
    WgmmaTiles::warp_specialized(2, 64),
];

/// The dK/dV kernel warpgroup counts compiled for `head_dim` (empty where the wgmma kernels do not
/// exist).
pub fn wgmma_kv_variants(head_dim: usize) -> &'static [usize] {
    WGMMA_HEAD_DIMS
        .iter()
        .position(|&h| h == head_dim)
        .map_or(&[], |i| &WGMMA_KV_VARIANTS[i])
}

/// The dQ kernel tiles compiled for `head_dim` (empty where the wgmma kernels do not exist).
pub fn wgmma_dq_variants(head_dim: usize) -> &'static [WgmmaTiles] {
    match head_dim {
        64 => &WGMMA_DQ_VARIANTS_64,
        128 => &WGMMA_DQ_VARIANTS_128,
        _ => &[],
    }
}

/// Every compiled pair of wgmma dK/dV and dQ kernels for `head_dim`: each plain dK/dV kernel
/// ([`wgmma_kv_variants`]) and the warp-specialised one (`ATT_WG_KV_WS_VARIANTS`, two warpgroups at
/// both head dims) with each dQ kernel; then the fused ordered kernel ([`WgmmaBackwardTiles::ORDERED`],
/// and at head dim 128 [`WgmmaBackwardTiles::ORDERED_COLUMNS`]).
pub fn wgmma_backward_variants(head_dim: usize) -> Vec<WgmmaBackwardTiles> {
    let dq = wgmma_dq_variants(head_dim);
    let plain = wgmma_kv_variants(head_dim)
        .iter()
        .flat_map(|&kv| dq.iter().map(move |&dq| WgmmaBackwardTiles::new(kv, dq)));
    let specialized = dq
        .iter()
        .filter(|_| WGMMA_HEAD_DIMS.contains(&head_dim))
        .map(|&dq| WgmmaBackwardTiles::specialized_kv(dq));
    let ordered = WGMMA_HEAD_DIMS
        .contains(&head_dim)
        .then_some(WgmmaBackwardTiles::ORDERED);
    let columns = (head_dim == 128).then_some(WgmmaBackwardTiles::ORDERED_COLUMNS);
    plain
        .chain(specialized)
        .chain(ordered)
        .chain(columns)
        .collect()
}

/// The wgmma backward tiles used when [`super::AttentionTiles::wgmma_backward`] is `None`: the
/// warp-specialised dK/dV kernel (two warpgroups of 64 keys, a TMA producer warpgroup) with, at head dim
/// 128, the warp-specialised dQ kernel (two warpgroups, key blocks of 64) and, at head dim 64, the plain
/// one-warpgroup dQ kernel. The fastest pairs on an H100 (`attention_bench --wgmma`, 2026-12-06, one
/// call): 0.636 / 3.014 ms at B4 H20 T2048 hd128 / the llama-8b shape against 0.699 / 3.436 ms for the
/// earlier default (plain kv g1, q g1n64); 2.195 ms at the llama-1b shape (hd 64) against 2.296 (the
/// warp-specialised dQ kernel there: 2.192 with key blocks of 128, 2.274 with 64), 2.070 with the
/// dK/dV kernel's three stages ([`kv_ws_stages`]).
pub fn default_wgmma_backward_tiles(head_dim: usize) -> Option<WgmmaBackwardTiles> {
    match head_dim {
        64 => Some(WgmmaBackwardTiles::specialized_kv(WgmmaTiles::new(1, 64))),
        128 => Some(WgmmaBackwardTiles::specialized_kv(
            WgmmaTiles::warp_specialized(2, 64),
        )),
        _ => None,
    }
}

/// Tiles of a kernel that walks key blocks (the separate backward's dK/dV kernel): `warps` warps of
/// `16 * key_tiles` keys each, and query blocks of `query_rows` rows streamed through shared memory.
/// With `paired`, warps work in pairs on `16 * key_tiles` keys (`key_tiles` = 2): one computes P^T and
/// dV, the other dP^T, dS^T and dK, each holding one accumulator where an unpaired warp holds two.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyTiles {
    /// Warps per block (4 or 8).
    pub warps: usize,
    /// 16-key tiles per warp, or per pair of warps with `paired` (1 or 2).
    pub key_tiles: usize,
    /// Queries per streamed block.
    pub query_rows: usize,
    /// Whether warps work in pairs (see above).
    pub paired: bool,
}

impl KeyTiles {
    /// `warps` warps of `16 * key_tiles` keys, query blocks of `query_rows`.
    pub const fn new(warps: usize, key_tiles: usize, query_rows: usize) -> Self {
        KeyTiles {
            warps,
            key_tiles,
            query_rows,
            paired: false,
        }
    }

    /// `pairs` pairs of warps on 32 keys each, query blocks of `query_rows`.
    pub const fn pairs(pairs: usize, query_rows: usize) -> Self {
        KeyTiles {
            warps: 2 * pairs,
            key_tiles: 2,
            query_rows,
            paired: true,
        }
    }

    /// Keys per block.
    pub fn block_keys(&self) -> usize {
        let keys = 16 * self.key_tiles * self.warps;
        if self.paired {
            keys / 2
        } else {
            keys
        }
    }
}

/// `w<warps>m<key_tiles>q<query_rows>`, or `p<pairs>q<query_rows>` with `paired`, as in the kernel names
/// (`attn_bwd_dkdv_w4m1q64_hd64`, `attn_bwd_dkdv_p4q64_hd128`).
impl fmt::Display for KeyTiles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.paired {
            write!(f, "p{}q{}", self.warps / 2, self.query_rows)
        } else {
            write!(f, "w{}m{}q{}", self.warps, self.key_tiles, self.query_rows)
        }
    }
}

/// How the tensor-core backward is organised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackwardKernels {
    /// One kernel over key blocks of 64 (4 warps) that computes dK and dV and adds dQ into F32
    /// accumulators, walking query blocks of `query_rows` (32 or 64); then a kernel that converts the
    /// accumulators. dQ is summed by [`super::DqAccumulation`]: one buffer per split (deterministic) or
    /// atomics. 5 matrix products per tile pair.
    Fused {
        /// Queries per streamed block: 32 or 64.
        query_rows: usize,
    },
    /// A dK/dV kernel over key blocks and a dQ kernel over query blocks, each recomputing P from the
    /// forward's lse (FlashAttention-2's deterministic scheme): 7 matrix products per tile pair, but no
    /// dQ accumulators, atomics or reduction, and deterministic whatever [`super::DqAccumulation`] says.
    Separate {
        /// The dK/dV kernel's tiles (one of [`dkdv_variants`]).
        dkdv: KeyTiles,
        /// The dQ kernel's tiles (one of [`dq_variants`]).
        dq: QueryTiles,
    },
}

/// `fused q64` or `separate dkdv w4m1q64 dq w4m1n64`.
impl fmt::Display for BackwardKernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackwardKernels::Fused { query_rows } => write!(f, "fused q{query_rows}"),
            BackwardKernels::Separate { dkdv, dq } => write!(f, "separate dkdv {dkdv} dq {dq}"),
        }
    }
}

const fn q(warps: usize, row_tiles: usize, key_rows: usize) -> QueryTiles {
    QueryTiles::new(warps, row_tiles, key_rows)
}

const fn k(warps: usize, key_tiles: usize, query_rows: usize) -> KeyTiles {
    KeyTiles::new(warps, key_tiles, query_rows)
}

/// Forward variants per head dim (`ATT_FWD_VARIANTS_<hd>` in attention.cu), in the order of
/// [`super::HEAD_DIMS`].
const FORWARD_VARIANTS: [[QueryTiles; 5]; 3] = [
    [
        q(4, 1, 64),
        q(8, 1, 64),
        q(4, 2, 64),
        q(4, 2, 128),
        q(8, 2, 64),
    ],
    [
        q(4, 1, 64),
        q(8, 1, 64),
        q(4, 2, 64),
        q(4, 2, 128),
        q(8, 2, 64),
    ],
    [
        q(4, 1, 64),
        q(8, 1, 64),
        q(4, 2, 64),
        q(4, 2, 32),
        q(8, 2, 32),
    ],
];

/// dK/dV kernel variants per head dim (`ATT_DKDV_VARIANTS_<hd>`, then `ATT_DKDV_PAIR_VARIANTS_<hd>`, in
/// attention_separate.cu).
const DKDV_32: [KeyTiles; 6] = [
    k(4, 1, 64),
    k(8, 1, 64),
    k(4, 2, 64),
    k(4, 2, 32),
    KeyTiles::pairs(4, 64),
    KeyTiles::pairs(2, 64),
];
const DKDV_64: [KeyTiles; 6] = [
    k(4, 1, 64),
    k(8, 1, 64),
    k(4, 1, 32),
    k(4, 2, 32),
    KeyTiles::pairs(4, 64),
    KeyTiles::pairs(2, 64),
];
const DKDV_128: [KeyTiles; 7] = [
    k(4, 1, 64),
    k(8, 1, 64),
    k(4, 1, 32),
    k(8, 1, 32),
    KeyTiles::pairs(4, 64),
    KeyTiles::pairs(2, 32),
    KeyTiles::pairs(4, 32),
];
const DKDV_VARIANTS: [&[KeyTiles]; 3] = [&DKDV_32, &DKDV_64, &DKDV_128];

/// dQ kernel variants per head dim (`ATT_DQ_VARIANTS_<hd>` in attention_separate.cu).
const DQ_VARIANTS: [[QueryTiles; 4]; 3] = [
    [q(4, 1, 64), q(8, 1, 64), q(4, 2, 64), q(4, 1, 128)],
    [q(4, 1, 64), q(8, 1, 64), q(4, 2, 64), q(4, 1, 128)],
    [q(4, 1, 64), q(8, 1, 64), q(4, 1, 128), q(8, 1, 128)],
];

/// Query rows per block of the fused backward's variants.
pub const FUSED_QUERY_ROWS: [usize; 2] = [64, 32];

fn hd_index(head_dim: usize) -> Option<usize> {
    super::HEAD_DIMS.iter().position(|&h| h == head_dim)
}

/// The forward tiles compiled for `head_dim` (empty for an unsupported head dim).
pub fn forward_variants(head_dim: usize) -> &'static [QueryTiles] {
    hd_index(head_dim).map_or(&[], |i| &FORWARD_VARIANTS[i])
}

/// The dK/dV kernel tiles compiled for `head_dim`.
pub fn dkdv_variants(head_dim: usize) -> &'static [KeyTiles] {
    hd_index(head_dim).map_or(&[], |i| DKDV_VARIANTS[i])
}

/// The dQ kernel tiles compiled for `head_dim`.
pub fn dq_variants(head_dim: usize) -> &'static [QueryTiles] {
    hd_index(head_dim).map_or(&[], |i| &DQ_VARIANTS[i])
}

/// Every backward organisation compiled for `head_dim`: the fused kernel's query rows and every pair of
/// dK/dV and dQ variants.
pub fn backward_variants(head_dim: usize) -> Vec<BackwardKernels> {
    let mut v: Vec<BackwardKernels> = FUSED_QUERY_ROWS
        .iter()
        .map(|&query_rows| BackwardKernels::Fused { query_rows })
        .collect();
    for &dkdv in dkdv_variants(head_dim) {
        for &dq in dq_variants(head_dim) {
            v.push(BackwardKernels::Separate { dkdv, dq });
        }
    }
    v
}

/// The tiles used when [`super::AttentionTiles`] leaves a choice open, for one head dim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileDefaults {
    /// The head dim these apply to.
    pub head_dim: usize,
    /// Forward tiles.
    pub forward: QueryTiles,
    /// Backward with [`super::DqAccumulation::Deterministic`] (the default mode).
    pub deterministic: BackwardKernels,
    /// Query rows of the fused backward with [`super::DqAccumulation::Atomic`].
    pub atomic_query_rows: usize,
}

/// The defaults per head dim. Edit after `attention_bench --sweep` on the target GPU: the sweep ends by
/// printing this table's lines for its fastest variants. Every entry must be a compiled variant
/// ([`forward_variants`], [`backward_variants`]); a unit test checks that.
///
/// Current values: not yet measured for the variants added with the separate backward (the forward
/// with two row tiles per warp, the dK/dV kernels with and without warp pairs, the dQ kernel); chosen by
/// their shared-memory reads per tensor-core operation (`ldmatrix.x4` per `mma` in the main loops' SASS:
/// forward 0.25 / 0.25 / 0.38 for hd 32 / 64 / 128 against 0.56 in the first version; dK/dV 0.5 / 0.5 /
/// 0.31, the last with warp pairs, against 0.56 without; dQ 0.5; docs/attention.md) and register counts
/// (ptxas for sm_90, no spills), the fused kernel's query rows from the H200 sweep of 2026-12-03
/// (`docs/results/transformer-h200-1/attention_bench.log`).
pub const DEFAULT_TILES: [TileDefaults; 3] = [
    TileDefaults {
        head_dim: 32,
        forward: q(4, 2, 64),
        deterministic: BackwardKernels::Separate {
            dkdv: k(4, 1, 64),
            dq: q(4, 1, 64),
        },
        atomic_query_rows: 64,
    },
    TileDefaults {
        head_dim: 64,
        forward: q(4, 2, 64),
        deterministic: BackwardKernels::Separate {
            dkdv: k(4, 1, 64),
            dq: q(4, 1, 64),
        },
        atomic_query_rows: 64,
    },
    TileDefaults {
        head_dim: 128,
        forward: q(4, 2, 32),
        deterministic: BackwardKernels::Separate {
            dkdv: KeyTiles::pairs(4, 64),
            dq: q(4, 1, 64),
        },
        atomic_query_rows: 64,
    },
];

/// The defaults for `head_dim` (`None` for an unsupported head dim).
pub fn default_tiles(head_dim: usize) -> Option<&'static TileDefaults> {
    DEFAULT_TILES.iter().find(|d| d.head_dim == head_dim)
}

/// Whether `b` is compiled for `head_dim`.
pub fn is_backward_variant(head_dim: usize, b: &BackwardKernels) -> bool {
    match b {
        BackwardKernels::Fused { query_rows } => FUSED_QUERY_ROWS.contains(query_rows),
        BackwardKernels::Separate { dkdv, dq } => {
            dkdv_variants(head_dim).contains(dkdv) && dq_variants(head_dim).contains(dq)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_compiled_variants() {
        for hd in super::super::HEAD_DIMS {
            let d = default_tiles(hd).unwrap();
            assert!(forward_variants(hd).contains(&d.forward), "hd {hd}");
            assert!(is_backward_variant(hd, &d.deterministic), "hd {hd}");
            assert!(FUSED_QUERY_ROWS.contains(&d.atomic_query_rows), "hd {hd}");
        }
        assert_eq!(DEFAULT_TILES.len(), super::super::HEAD_DIMS.len());
    }

    #[test]
    fn wgmma_tiles_name_and_defaults() {
        assert_eq!(WgmmaTiles::new(2, 128).to_string(), "g2n128");
        assert_eq!(WgmmaTiles::pipelined(2, 64).to_string(), "g2n64p");
        assert_eq!(WgmmaTiles::pipelined(2, 64).value_buffers(), 3);
        assert_eq!(WgmmaTiles::new(3, 64).block_rows(), 192);
        for hd in WGMMA_HEAD_DIMS {
            let d = default_wgmma_tiles(hd).unwrap();
            assert!(wgmma_forward_variants(hd).contains(&d), "hd {hd}");
            assert!(super::super::HEAD_DIMS.contains(&hd));
        }
        assert!(wgmma_forward_variants(32).is_empty());
        assert!(default_wgmma_tiles(32).is_none());
    }

    #[test]
    fn names_match_the_kernel_names() {
        assert_eq!(q(4, 2, 64).to_string(), "w4m2n64");
        assert_eq!(k(8, 1, 32).to_string(), "w8m1q32");
        assert_eq!(q(4, 2, 64).block_rows(), 128);
        assert_eq!(k(8, 1, 32).block_keys(), 128);
        assert_eq!(KeyTiles::pairs(4, 64).to_string(), "p4q64");
        assert_eq!(KeyTiles::pairs(4, 64).block_keys(), 128);
        assert_eq!(
            BackwardKernels::Separate {
                dkdv: k(4, 1, 64),
                dq: q(4, 1, 64)
            }
            .to_string(),
            "separate dkdv w4m1q64 dq w4m1n64"
        );
    }
}
