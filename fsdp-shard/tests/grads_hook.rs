//! The hook on reduced gradients (`UnitGradsReady`) and transient gradient shards: every unit is handed
//! over once per backward, right after its reduction (its shard holds the reduced gradient, its gathered
//! parameters are released), the blocks in the order their gradients complete, then the root, then a
//! unit that got no gradient; transient shards exist from a unit's reduction until they are cleared; no
//! hook while gradient sync is off; a failed backward hands no unit over.

use fsdp_comm::{run_ranks, Communicator, ThreadComm};
use fsdp_shard::{
    Ctx, FsdpConfig, FsdpModel, Mode, Module, ParamDecl, ParamGroup, ParamId, ParamKind,
    ShardError, ShardedModel, UnitGradsReady, Visitor, WrapPolicy,
};
use std::sync::Arc;

const N: usize = 32;

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

/// A root parameter and three blocks (`h.0`, `h.1`, `h.2`); the backward gives block `i` the gradient
/// `i + 1` everywhere (block 2 none when `skip_last`), the root 10.
struct Chain {
    root: ParamId,
    h: Vec<Block>,
}

impl Module for Chain {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        v.param(
            "emb",
            &ParamDecl::new(&[N], ParamKind::Plain, &|| vec![1.0; N]),
            &mut self.root,
        )?;
        for (i, b) in self.h.iter_mut().enumerate() {
            v.child(&format!("h.{i}"), b)?;
        }
        Ok(())
    }
}

impl Chain {
    fn forward(&self, ctx: &mut Ctx<'_>) -> Result<(), ShardError> {
        ctx.plain(self.root)?;
        for b in &self.h {
            ctx.plain(b.w)?;
        }
        Ok(())
    }

    fn backward(&self, ctx: &mut Ctx<'_>, skip_last: bool) -> Result<(), ShardError> {
        for (i, b) in self.h.iter().enumerate().rev() {
            if skip_last && i == 2 {
                continue;
            }
            let g = ctx.device().upload(&[(i + 1) as f32; N])?;
            ctx.add_grad(b.w, &g)?;
        }
        let g = ctx.device().upload(&[10.0f32; N])?;
        ctx.add_grad(self.root, &g)
    }
}

/// Records each unit handed over: its index, the first element of this rank's reduced plain gradient,
/// whether it was still gathered, and the gradient-shard bytes the model held then; clears the unit's
/// gradients as an optimizer step would.
#[derive(Default)]
struct Recorder {
    seen: Vec<(usize, f32, bool, usize)>,
}

impl UnitGradsReady for Recorder {
    fn unit_ready(&mut self, model: &mut ShardedModel, u: usize) -> Result<(), ShardError> {
        let g = model.unit(u)?.grad(ParamGroup::Plain).to_f32_vec()?;
        let held = model.memory()?.grad_shards;
        self.seen.push((
            u,
            g.first().copied().unwrap_or(f32::NAN),
            model.is_gathered(u),
            held,
        ));
        model.clear_unit_grads(u)
    }
}

fn model(comm: Arc<dyn Communicator>) -> Result<FsdpModel<Chain>, ShardError> {
    let chain = Chain {
        root: ParamId::UNSET,
        h: (0..3).map(|_| Block { w: ParamId::UNSET }).collect(),
    };
    FsdpModel::new(
        chain,
        comm,
        WrapPolicy::ChildrenOf("h".into()),
        FsdpConfig::default(),
    )
}

#[test]
fn each_unit_is_handed_over_once_right_after_its_reduction() {
    let out = run_ranks(2, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let mut m = model(comm)?;
        let names: Vec<String> = m.layout().units.iter().map(|u| u.name.clone()).collect();
        m.sharded_mut().set_transient_grads(true)?;
        let bytes_before = m.sharded().memory()?.grad_shards;
        let mut runs = Vec::new();
        for skip_last in [false, true] {
            m.forward(Mode::Train, |c, ctx| c.forward(ctx))?;
            let mut rec = Recorder::default();
            m.backward_with_hook(&mut rec, |c, ctx| c.backward(ctx, skip_last))?;
            runs.push(rec.seen);
        }
        let after = m.sharded().memory()?;
        Ok::<_, ShardError>((
            names,
            bytes_before,
            runs,
            after.grad_shards,
            after.peak_grad_shards,
        ))
    })
    .unwrap();
    for (names, before, runs, after, peak) in out {
        assert_eq!(names, ["root", "h.0", "h.1", "h.2"]);
        // The gradients are summed over 2 ranks (divisor 1): block i holds 2 (i + 1), the root 20.
        let order = |run: &[(usize, f32, bool, usize)]| -> Vec<(usize, f32)> {
            run.iter().map(|s| (s.0, s.1)).collect()
        };
        assert_eq!(order(&runs[0]), [(3, 6.0), (2, 4.0), (1, 2.0), (0, 20.0)]);
        // Without a gradient for h.2 it comes last, with zeros.
        assert_eq!(order(&runs[1]), [(2, 4.0), (1, 2.0), (0, 20.0), (3, 0.0)]);
        for run in &runs {
            for &(u, _, gathered, held) in run {
                assert!(!gathered, "unit {u} still gathered when handed over");
                // One unit's shard at a time: this rank's N / 2 F32 values.
                assert_eq!(held, N / 2 * 4, "unit {u}");
            }
        }
        assert_eq!((before, after, peak), (0, 0, N / 2 * 4));
    }
}

#[test]
fn a_registered_hook_runs_in_every_backward_and_is_refused_without_sync() {
    let out = run_ranks(1, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let mut m = model(comm)?;
        struct Count(Arc<std::sync::Mutex<Vec<usize>>>);
        impl UnitGradsReady for Count {
            fn unit_ready(&mut self, _: &mut ShardedModel, u: usize) -> Result<(), ShardError> {
                self.0
                    .lock()
                    .map_err(|_| ShardError::State("lock".into()))?
                    .push(u);
                Ok(())
            }
        }
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        assert!(m
            .set_grads_hook(Some(Box::new(Count(seen.clone()))))
            .is_none());
        assert!(m.has_grads_hook());
        m.forward(Mode::Train, |c, ctx| c.forward(ctx))?;
        m.backward(|c, ctx| c.backward(ctx, false))?;
        let calls = seen.lock().map(|v| v.len()).unwrap_or(0);
        // Accumulation without sync cannot step in the backward.
        m.set_grad_sync(false);
        m.forward(Mode::Train, |c, ctx| c.forward(ctx))?;
        let refused = m
            .backward(|c, ctx| c.backward(ctx, false))
            .unwrap_err()
            .to_string();
        m.set_grad_sync(true);
        // A failed backward hands no unit over after the failure.
        m.forward(Mode::Train, |c, ctx| c.forward(ctx))?;
        let before = seen.lock().map(|v| v.len()).unwrap_or(0);
        let failed = m.backward(|_, _| Err::<(), _>(ShardError::State("boom".into())));
        let after = seen.lock().map(|v| v.len()).unwrap_or(0);
        let removed = m.set_grads_hook(None).is_some();
        Ok::<_, ShardError>((calls, refused, failed.is_err(), after - before, removed))
    })
    .unwrap();
    let (calls, refused, failed, extra, removed) = &out[0];
    assert_eq!(*calls, 4);
    assert!(refused.contains("sync"), "{refused}");
    assert!(*failed && *extra == 0 && *removed);
}
