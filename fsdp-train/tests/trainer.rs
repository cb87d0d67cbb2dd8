//! A model written only against the Trainer — its layers, data, loss and evaluation, no loop of its own —
//! trains on two CPU thread ranks, and a run stopped after a checkpoint and resumed is bit for bit the run
//! that did not stop (every micro-batch's loss, the metrics lines, the exported weights). Also: the
//! Trainer's refusals (an existing checkpoint, changed settings, a finished run), the averaging of
//! gradients by the reduction (two ranks equal one rank on the concatenated batch), and the stop on
//! non-finite losses.

mod common;

use common::{build_net, points, Net, FEATURES};
use fsdp_nn::{Layer, Shape, Tensor};
use fsdp_shard::{FsdpModel, Mode};
use fsdp_train::metrics::read_metrics;
use fsdp_train::*;
use std::path::PathBuf;

/// 16 features labelled by which of the first four is largest; `rows` points per rank and micro-batch;
/// with `poison`, every input is NaN (a diverging run).
struct Task {
    rows: usize,
    poison: bool,
}

impl TrainTask for Task {
    type Model = Net;
    type Data = ();
    type Batch = common::Batch;
    type Error = TrainError;

    fn name(&self) -> &str {
        "trainer-test"
    }

    fn identity(&self) -> Vec<RunSetting> {
        vec![RunSetting::new("rows", "--rows", self.rows)]
    }

    fn build_model(&self, _: &RankEnv) -> Result<Net, TrainError> {
        build_net()
    }

    fn data(&self, _: &RankEnv) -> Result<(), TrainError> {
        Ok(())
    }

    /// Epochs of 6 micro-batches per rank.
    fn epoch_batches(&self, _: &mut (), _: &RankEnv, _: u32) -> Result<Option<u64>, TrainError> {
        Ok(Some(6))
    }

    fn batch(&self, _: &mut (), env: &RankEnv, at: BatchIndex) -> Result<Self::Batch, TrainError> {
        let global = (u64::from(at.epoch) * 6 + at.index) as usize * env.world_size + env.rank;
        let (mut x, y) = points(global * self.rows, self.rows);
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

    /// Loss and accuracy on 64 fixed points, split over the ranks.
    fn evaluate(
        &self,
        model: &mut FsdpModel<Net>,
        _: &mut (),
        env: &RankEnv,
    ) -> Result<Evaluation, TrainError> {
        let device = env.device.clone();
        let sums = evaluate_sums(
            model,
            (env.rank..4).step_by(env.world_size),
            |m, i| -> Result<[f32; 3], TrainError> {
                let (x, y) = points(1_000_000 + i * 16, 16);
                let y = device.upload(&y)?;
                let x = Tensor::new(device.upload(&x)?, Shape::matrix(16, FEATURES)?)?;
                m.forward(Mode::Eval, |net, ctx| {
                    let logits = net.body.forward(ctx, x)?;
                    net.loss.forward(ctx, logits, &y).map(drop)
                })?;
                let s = m.module().loss.stats()?.to_vec()?;
                Ok([s[0] * 16.0, s[1], 16.0])
            },
        )?;
        Ok(Evaluation {
            loss: f64::from(sums[0] / sums[2]),
            correct: Some((sums[1] as u64, sums[2] as u64)),
            extra: Vec::new(),
        })
    }
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("trainer-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn config(epochs: u32, ranks: usize) -> TrainConfig {
    TrainConfig {
        world_size: ranks,
        device: DeviceChoice::Cpu,
        threads_per_rank: Some(1),
        lr: 1e-2,
        grad_accum: 2,
        ..TrainConfig::new(RunLength::Epochs(epochs))
    }
}

#[test]
fn a_model_on_the_trainer_learns_and_resumes_bit_for_bit() {
    let dir = scratch("resume");
    let task = Task {
        rows: 16,
        poison: false,
    };
    let out = |name: &str| {
        let mut c = config(3, 2);
        c.metrics = Some(dir.join(format!("{name}.jsonl")));
        c.export = Some(dir.join(format!("{name}.safetensors")));
        c
    };
    let whole = Trainer::new(out("whole")).run(&task).unwrap();
    // 3 epochs of 6 micro-batches, 2 per step; evaluated at each epoch's end.
    assert_eq!(whole.steps, 9);
    assert_eq!(whole.records.len(), 3);
    assert_eq!(whole.step_losses[0].len(), 18);
    let first = whole.records[0].test_loss;
    let last = whole.records[2].test_loss;
    assert!(last < first, "evaluation loss {first} -> {last}");
    assert_eq!(whole.fp8_linears(), ["fc1", "fc2"]);

    // Stopped after step 4 (mid-epoch 2, after a checkpoint), then resumed.
    let ckpt = dir.join("ckpt");
    let mut stop = out("parts");
    stop.save = Some(ckpt.clone());
    stop.stop_after_steps = Some(4);
    let first_part = Trainer::new(stop).run(&task).unwrap();
    assert_eq!(first_part.stop, StopReason::StopAfter);
    assert_eq!(first_part.steps, 4);
    let mut resume = out("parts");
    resume.resume = Some(ckpt.clone());
    resume.save = Some(ckpt.clone());
    let rest = Trainer::new(resume.clone()).run(&task).unwrap();
    assert_eq!(rest.steps, 9);
    for rank in 0..2 {
        let mut joined = first_part.step_losses[rank].clone();
        joined.extend(&rest.step_losses[rank]);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&joined), bits(&whole.step_losses[rank]), "rank {rank}");
    }
    let lines = |name: &str| {
        read_metrics(dir.join(name))
            .unwrap()
            .into_iter()
            .map(|r| {
                (
                    r.step,
                    r.train_loss.to_bits(),
                    r.test_loss.to_bits(),
                    r.test_correct,
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(lines("parts.jsonl"), lines("whole.jsonl"));
    let read = |n: &str| std::fs::read(dir.join(n)).unwrap();
    assert!(read("parts.safetensors") == read("whole.safetensors"));

    // The finished checkpoint: nothing to train, and it says so.
    let done = Trainer::new(resume.clone()).run(&task).unwrap();
    assert_eq!(done.stop, StopReason::AlreadyDone);
    // Another task identity or seed is refused naming the flag.
    let e = Trainer::new(resume.clone())
        .run(&Task {
            rows: 8,
            poison: false,
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("--rows 16") && e.contains("--rows 8"), "{e}");
    // A fresh run over the checkpoint is refused unless asked to overwrite.
    let mut fresh = config(1, 2);
    fresh.save = Some(ckpt.clone());
    let e = Trainer::new(fresh.clone())
        .run(&task)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--save") && e.contains("step 9") && e.contains("--overwrite"),
        "{e}"
    );
    fresh.overwrite = true;
    Trainer::new(fresh).run(&task).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_reduction_averages_two_ranks_like_one_rank_on_the_whole_batch() {
    // One rank with micro-batches of 32 points against two ranks of 16 (the same global batches).
    let run = |ranks: usize, rows: usize| {
        let mut c = config(1, ranks);
        c.precision = Precision::Fp32;
        c.grad_accum = 1;
        c.collect_params = true;
        Trainer::new(c)
            .run(&Task {
                rows,
                poison: false,
            })
            .unwrap()
    };
    let one = run(1, 32);
    let two = run(2, 16);
    for ((name, a), (_, b)) in one.params.iter().zip(&two.params) {
        let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        // F32 sums in another order: a few ulps of the largest weight after 6 Adam steps.
        assert!(worst <= scale * 1e-5, "{name}: {worst} of {scale}");
    }
}

#[test]
fn non_finite_losses_stop_the_run_after_the_limit() {
    let mut c = config(1, 1);
    c.max_skipped_steps = 2;
    let e = Trainer::new(c)
        .run(&Task {
            rows: 16,
            poison: true,
        })
        .unwrap_err();
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
fn the_fp8_head_flag_is_refused_where_it_cannot_apply() {
    // A model without an LM head: the conversion finds nothing to convert, and the run says so.
    let mut c = config(1, 1);
    c.fp8_head = true;
    let task = Task {
        rows: 16,
        poison: false,
    };
    let e = Trainer::new(c).run(&task).unwrap_err();
    assert!(e.to_string().contains("no LM head"), "{e}");
    // Without FP8 there is nothing for it to do.
    let mut c = config(1, 1);
    c.fp8_head = true;
    c.precision = Precision::Bf16;
    let e = Trainer::new(c).run(&task).unwrap_err();
    assert!(e.to_string().contains("--fp8-head"), "{e}");
}
