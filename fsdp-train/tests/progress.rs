//! The progress bar: when it draws, and the running statistics it shows.

use fsdp_train::progress::{EpochProgress, ProgressMode};

#[test]
fn auto_draws_only_when_both_streams_are_terminals() {
    assert!(ProgressMode::Auto.draws(true, true));
    assert!(!ProgressMode::Auto.draws(false, true));
    assert!(!ProgressMode::Auto.draws(true, false));
    assert!(!ProgressMode::Hidden.draws(true, true));
    assert!(ProgressMode::Always.draws(false, false));
}

#[test]
fn hidden_bar_keeps_sample_weighted_running_loss() {
    let mut p = EpochProgress::new(1, 300, ProgressMode::Hidden);
    assert!(!p.is_visible());
    assert!(p.mean_loss().is_nan());
    p.advance(64, 2.0);
    p.advance(64, 1.0);
    p.advance(32, 0.5);
    assert_eq!(p.samples(), 160);
    let expected = (64.0 * 2.0 + 64.0 * 1.0 + 32.0 * 0.5) / 160.0;
    assert!((p.mean_loss() - expected).abs() < 1e-12);
    // A non-finite batch is counted as samples but does not poison the mean.
    p.advance(10, f64::NAN);
    assert_eq!(p.samples(), 170);
    assert!((p.mean_loss() - expected).abs() < 1e-12);
    assert!(p.samples_per_sec() >= 0.0);
    p.finish();
}

#[test]
fn auto_mode_is_hidden_under_the_test_harness_when_not_a_terminal() {
    use std::io::IsTerminal;
    let p = EpochProgress::new(1, 10, ProgressMode::Auto);
    let terminal = std::io::stdout().is_terminal() && std::io::stderr().is_terminal();
    assert_eq!(p.is_visible(), terminal);
}
