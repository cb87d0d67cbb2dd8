//! `TrainConfig::optimizer_in_backward` (`--optimizer-in-backward`) on the Trainer with a small model of
//! its own: the same weights as the step after the backward on one and two ranks; non-finite losses
//! skip every step and stop the run at `--max-skipped-steps`, as without the flag; an optimizer with
//! gradient clipping and gradient accumulation are refused naming the flags.

mod common;

use common::{build_net, points, Net};
use fsdp_optim::{AdamOptions, FsdpAdamW, Optimizer};
use fsdp_shard::{FsdpModel, WrapPolicy};
use fsdp_train::*;

/// 16 features labelled by which of the first four is largest, 8 points per rank and step; `poison`
/// makes every input NaN; `clip` gives the optimizer gradient clipping.
struct Task {
    poison: bool,
    clip: Option<f64>,
}

impl TrainTask for Task {
    type Model = Net;
    type Data = ();
    type Batch = common::Batch;
    type Error = TrainError;

    fn name(&self) -> &str {
        "optimizer-in-backward-test"
    }

    fn build_model(&self, _: &RankEnv) -> Result<Net, TrainError> {
        build_net()
    }

    fn optimizer(
        &self,
        model: &mut FsdpModel<Net>,
        choice: &OptimizerChoice,
    ) -> Result<Box<dyn Optimizer>, TrainError> {
        let options = AdamOptions {
            lr: choice.lr,
            state_precision: choice.states,
            max_grad_norm: self.clip,
            ..AdamOptions::adamw()
        };
        Ok(Box::new(FsdpAdamW::for_model(model, options)?))
    }

    fn wrap_policy(&self) -> WrapPolicy {
        WrapPolicy::PerModule
    }

    fn data(&self, _: &RankEnv) -> Result<(), TrainError> {
        Ok(())
    }

    fn batch(&self, _: &mut (), env: &RankEnv, at: BatchIndex) -> Result<Self::Batch, TrainError> {
        let first = (at.index as usize * env.world_size + env.rank) * 8;
        let (mut x, y) = points(first, 8);
        if self.poison {
            x.iter_mut().for_each(|v| *v = f32::NAN);
        }
        Ok((env.device.upload(&x)?, env.device.upload(&y)?))
    }

    fn batch_weight(&self, (_, y): &Self::Batch) -> u64 {
        y.len() as u64
    }

    fn forward(&self, m: &mut FsdpModel<Net>, batch: &Self::Batch) -> Result<(), TrainError> {
        common::forward(m, batch)
    }

    fn loss<'m>(&self, m: &'m FsdpModel<Net>) -> Result<LossValue<'m>, TrainError> {
        common::loss(m)
    }

    fn backward(&self, m: &mut FsdpModel<Net>, batch: &Self::Batch) -> Result<(), TrainError> {
        common::backward(m, batch)
    }
}

fn config(ranks: usize, in_backward: bool) -> TrainConfig {
    TrainConfig {
        world_size: ranks,
        device: DeviceChoice::Cpu,
        threads_per_rank: Some(1),
        lr: 1e-2,
        collect_params: true,
        optimizer_in_backward: in_backward,
        ..TrainConfig::new(RunLength::Steps(5))
    }
}

fn task() -> Task {
    Task {
        poison: false,
        clip: None,
    }
}

#[test]
fn the_weights_are_those_of_the_step_after_the_backward() {
    for ranks in [1, 2] {
        let after = Trainer::new(config(ranks, false)).run(&task()).unwrap();
        let inside = Trainer::new(config(ranks, true)).run(&task()).unwrap();
        assert_eq!(inside.steps, 5);
        assert!(!after.params.is_empty());
        for ((n, a), (_, b)) in after.params.iter().zip(&inside.params) {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(a), bits(b), "{ranks} rank(s): {n}");
        }
        assert_eq!(after.step_losses, inside.step_losses);
        assert!(inside
            .optimizer
            .contains("stepped per unit in the backward"));
        assert!(inside.memory.iter().all(|m| m.grad_shards == 0));
        assert!(after.memory.iter().all(|m| m.grad_shards > 0));
    }
}

#[test]
fn non_finite_steps_count_as_skipped_and_stop_the_run() {
    let mut c = config(2, true);
    c.max_skipped_steps = 2;
    let poisoned = Task {
        poison: true,
        clip: None,
    };
    let e = Trainer::new(c).run(&poisoned).unwrap_err();
    assert!(
        matches!(
            e,
            TrainError::Diverged {
                steps: 2,
                limit: 2,
                at: 2
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("--max-skipped-steps"), "{e}");
}

#[test]
fn clipping_and_accumulation_are_refused_naming_the_flags() {
    let clipped = Task {
        poison: false,
        clip: Some(1.0),
    };
    let e = Trainer::new(config(1, true))
        .run(&clipped)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--optimizer-in-backward") && e.contains("max_grad_norm"),
        "{e}"
    );
    // Without the flag the same task trains.
    Trainer::new(config(1, false)).run(&clipped).unwrap();
    let mut c = config(1, true);
    c.grad_accum = 4;
    let e = Trainer::new(c).run(&task()).unwrap_err().to_string();
    assert!(
        e.contains("--optimizer-in-backward") && e.contains("--grad-accum 4"),
        "{e}"
    );
}
