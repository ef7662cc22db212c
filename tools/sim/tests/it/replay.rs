use handoff_sim::run_seed;

#[test]
fn two_replays_of_a_seed_print_the_same_trace_byte_for_byte() {
    for seed in [0, 1, 7, 205, 4242, 99_999] {
        let first = run_seed(seed, None);
        let second = run_seed(seed, None);
        assert!(first.trace.len() > 10, "seed {seed} did something");
        assert_eq!(
            first.trace.join("\n"),
            second.trace.join("\n"),
            "seed {seed} replayed differently"
        );
    }
}

#[test]
fn different_seeds_make_different_runs() {
    assert_ne!(run_seed(1, None).trace, run_seed(2, None).trace);
}
