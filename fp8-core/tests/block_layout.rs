//! Property tests of block layouts and the block scale rule: the blocks partition the matrix, each element
//! maps to the one block whose extent holds it, only the last block row and column are partial, the
//! transposed layout mirrors the blocks, and block scales keep the block's amax within the format.

use fp8_core::{
    block_scale, BlockLayout, Fp8Error, Fp8Format, ScaleRounding, ScalingGranularity, BLOCK_SIZE,
};
use proptest::prelude::*;

fn granularity() -> impl Strategy<Value = ScalingGranularity> {
    prop_oneof![
        Just(ScalingGranularity::PerTensor),
        Just(ScalingGranularity::Block1x128),
        Just(ScalingGranularity::Block128x128),
    ]
}

/// A layout of one of the granularities, or of an arbitrary block shape (the 128x1 tiles included), over
/// shapes around and across multiples of 128.
fn layout() -> impl Strategy<Value = BlockLayout> {
    let side = prop_oneof![0usize..20, 120usize..140, 250usize..400];
    let named = (side.clone(), side.clone(), granularity())
        .prop_map(|(r, c, g)| BlockLayout::new(r, c, g).unwrap());
    let any_shape = (
        side.clone(),
        side,
        prop_oneof![Just(128usize), 1usize..200],
        prop_oneof![Just(1usize), 1usize..200],
    )
        .prop_map(|(r, c, br, bc)| BlockLayout::with_block_shape(r, c, br, bc).unwrap());
    prop_oneof![named, any_shape]
}

proptest! {
    #[test]
    fn blocks_partition_the_matrix(l in layout()) {
        let (rows, cols) = (l.rows(), l.cols());
        let [br, bc] = l.block_shape();
        let [gr, gc] = l.grid();
        prop_assert_eq!(gr, rows / br + usize::from(rows % br != 0));
        prop_assert_eq!(gc, cols / bc + usize::from(cols % bc != 0));
        // Each element's block holds it; counting elements per block gives each extent's length.
        let mut count = vec![0usize; l.num_blocks()];
        for r in 0..rows {
            for c in 0..cols {
                let b = l.block_of(r, c).unwrap();
                let e = l.block_extent(b).unwrap();
                prop_assert!(e.row0 <= r && r < e.row0 + e.rows, "row {} not in {:?}", r, e);
                prop_assert!(e.col0 <= c && c < e.col0 + e.cols, "col {} not in {:?}", c, e);
                count[b] += 1;
            }
        }
        let mut total = 0;
        for (b, &n) in count.iter().enumerate() {
            let e = l.block_extent(b).unwrap();
            prop_assert_eq!(n, e.len(), "block {}", b);
            prop_assert!(!e.is_empty());
            // Only the last block row / column may be partial, and they hold exactly the rest.
            let (i, j) = (b / gc, b % gc);
            let want_rows = if i + 1 < gr { br } else { rows - i * br };
            let want_cols = if j + 1 < gc { bc } else { cols - j * bc };
            prop_assert_eq!((e.rows, e.cols), (want_rows, want_cols), "block {}", b);
            total += n;
        }
        prop_assert_eq!(total, l.numel());
        prop_assert_eq!(l.numel(), rows * cols);
        // Beyond the matrix and the blocks: typed errors.
        let out_of_range = matches!(
            l.block_of(rows, 0),
            Err(Fp8Error::ElementOutOfRange { .. })
        );
        prop_assert!(out_of_range);
        let no_block = matches!(
            l.block_extent(l.num_blocks()),
            Err(Fp8Error::BlockOutOfRange { .. })
        );
        prop_assert!(no_block);
    }

    #[test]
    fn transposed_layout_mirrors_the_blocks(l in layout()) {
        let t = l.transposed();
        prop_assert_eq!(t.grid(), [l.grid()[1], l.grid()[0]]);
        for r in (0..l.rows()).step_by(7) {
            for c in (0..l.cols()).step_by(5) {
                let [i, j] = l.block_position(r, c).unwrap();
                prop_assert_eq!(t.block_position(c, r).unwrap(), [j, i]);
            }
        }
        prop_assert_eq!(t.transposed(), l);
    }

    #[test]
    fn granularities_have_their_block_shapes(r in 1usize..1000, c in 1usize..1000) {
        let t = BlockLayout::new(r, c, ScalingGranularity::PerTensor).unwrap();
        prop_assert_eq!(t.num_blocks(), 1);
        prop_assert_eq!(t.block_extent(0).unwrap().len(), r * c);
        let a = BlockLayout::new(r, c, ScalingGranularity::Block1x128).unwrap();
        prop_assert_eq!(a.grid(), [r, c.div_ceil(BLOCK_SIZE)]);
        let w = BlockLayout::new(r, c, ScalingGranularity::Block128x128).unwrap();
        prop_assert_eq!(w.grid(), [r.div_ceil(BLOCK_SIZE), c.div_ceil(BLOCK_SIZE)]);
        // The 128x1 tiles of a matrix are the 1x128 tiles of its transpose.
        let col = BlockLayout::with_block_shape(r, c, BLOCK_SIZE, 1).unwrap();
        prop_assert_eq!(col.transposed(), BlockLayout::new(c, r, ScalingGranularity::Block1x128).unwrap());
    }

    #[test]
    fn block_scale_keeps_the_block_in_range(
        amax in prop_oneof![1e-30f32..1e30, 1e-3f32..1e3, Just(448.0f32), Just(57344.0f32)],
        format in prop_oneof![Just(Fp8Format::E4M3), Just(Fp8Format::E5M2)],
    ) {
        let fmax = format.max();
        let p = block_scale(amax, fmax, ScaleRounding::PowerOfTwo);
        let e = block_scale(amax, fmax, ScaleRounding::Exact);
        for s in [p, e] {
            prop_assert!(s.is_normal() && (1.0 / s).is_normal());
        }
        // Within the clamp range 2^-125..2^125 the scales fit the block's amax within fmax, the power of two
        // is the largest such one, and the exact scale is at least as large.
        if (2f32.powi(-124)..2f32.powi(124)).contains(&(fmax / amax)) {
            prop_assert!(amax * p <= fmax && amax * e <= fmax, "{} {} {}", amax, p, e);
            prop_assert_eq!(p.to_bits() & 0x007F_FFFF, 0, "{} is not a power of two", p);
            prop_assert!((amax as f64) * 2.0 * (p as f64) > fmax as f64);
            prop_assert!(e >= p);
            prop_assert!((amax as f64) * (e as f64) > fmax as f64 * (1.0 - 1e-6));
        }
    }
}

#[test]
fn zero_and_non_finite_blocks_get_scale_one() {
    for a in [0.0, f32::INFINITY, f32::NAN] {
        for r in [ScaleRounding::PowerOfTwo, ScaleRounding::Exact] {
            assert_eq!(block_scale(a, 448.0, r), 1.0);
        }
    }
}
