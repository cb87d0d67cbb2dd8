//! `Ctx::take_param`: a module moves a gathered parameter out of its unit, so its memory goes when the
//! module drops it; a later use in the pass gathers the unit again (the same values, on every rank);
//! a pinned model (`gather_all`) hands out a copy and keeps its own. A unit whose one parameter fills its
//! gathered buffer takes that buffer without a cut.

use fsdp_comm::{run_ranks, Communicator, ThreadComm};
use fsdp_shard::{
    Ctx, FsdpConfig, FsdpModel, GatheredParam, Mode, Module, ParamDecl, ParamId, ParamKind,
    ShardError, Visitor, WrapPolicy,
};
use std::sync::Arc;

const N: usize = 64;

struct Block {
    w: ParamId,
}

impl Module for Block {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        v.param(
            "w",
            &ParamDecl::new(&[N], ParamKind::Plain, &|| vec![0.5; N]),
            &mut self.w,
        )
    }
}

/// A root table (values `0, 1, 2, ...`) and one block.
struct Net {
    table: ParamId,
    h: Block,
}

impl Module for Net {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        v.param(
            "table",
            &ParamDecl::new(&[N], ParamKind::Plain, &|| {
                (0..N).map(|i| i as f32).collect()
            }),
            &mut self.table,
        )?;
        v.child("h.0", &mut self.h)
    }
}

fn values(p: &GatheredParam) -> Result<Vec<f32>, ShardError> {
    p.to_f32_vec()
}

fn table() -> Vec<f32> {
    (0..N).map(|i| i as f32).collect()
}

#[test]
fn a_taken_parameter_leaves_its_unit_and_comes_back_on_the_next_use() {
    for ws in [1, 2] {
        let out = run_ranks(ws, |comm: ThreadComm| {
            let comm: Arc<dyn Communicator> = Arc::new(comm);
            let net = Net {
                table: ParamId::UNSET,
                h: Block { w: ParamId::UNSET },
            };
            let policy = WrapPolicy::ChildrenOf("h".into());
            let mut m = FsdpModel::new(net, comm, policy, FsdpConfig::default())?;
            let p = m.module().table.index().unwrap_or(usize::MAX);
            // A forward that uses the table and takes it: the root unit stays gathered after the
            // forward, without the table.
            let mut gathered = Vec::new();
            for take in [false, true] {
                let taken = m.forward(Mode::Train, |net, ctx: &mut Ctx<'_>| {
                    ctx.plain(net.h.w)?;
                    let v = if take {
                        values(&ctx.take_param(net.table)?)?
                    } else {
                        ctx.plain(net.table)?.to_vec()?
                    };
                    Ok::<_, ShardError>(v)
                })?;
                assert_eq!(taken, table());
                gathered.push((m.sharded().memory()?.gathered, m.sharded().is_taken(p)));
                // The backward reads the table again: gathered again, the same values.
                let again = m.backward(|net, ctx: &mut Ctx<'_>| {
                    let v = ctx.plain(net.table)?.to_vec()?;
                    let g = ctx.device().upload(&[1.0f32; N])?;
                    ctx.add_grad(net.table, &g)?;
                    Ok::<_, ShardError>(v)
                })?;
                assert_eq!(again, table());
            }
            // Pinned: a copy, and the unit keeps its table.
            m.gather_all()?;
            let before = m.sharded().memory()?.gathered;
            let copy = m.forward(Mode::Eval, |net, ctx: &mut Ctx<'_>| {
                values(&ctx.take_param(net.table)?)
            })?;
            let pinned = (
                copy,
                m.sharded().memory()?.gathered == before,
                m.sharded().is_taken(p),
            );
            m.release_all()?;
            // Each unit's only parameter fills its gathered buffer and takes it without a cut: the
            // gathered peak is the two parameters, never a buffer and its copy.
            let peak = m.sharded().memory()?.peak_gathered;
            assert_eq!(peak, 2 * N * 4, "ws {}", m.sharded().comm().world_size());
            Ok::<_, ShardError>((gathered, pinned))
        })
        .unwrap();
        for (gathered, (copy, kept, taken)) in out {
            // After the forward the root holds the table's N F32 values without the take, not with it
            // (the block, prefetched for the backward, is there either way).
            assert_eq!(gathered[0].0 - gathered[1].0, N * 4, "ws {ws}");
            assert_eq!((gathered[0].1, gathered[1].1), (false, true), "ws {ws}");
            assert_eq!(copy, table());
            assert!(kept && !taken, "ws {ws}: a pinned unit keeps its parameter");
        }
    }
}
