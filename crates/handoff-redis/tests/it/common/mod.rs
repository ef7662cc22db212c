//! Shared by the Redis tests: handoff-test's Redis support, and an intake configuration onto a
//! scratch stream.

#![allow(dead_code)]

use handoff_redis::IntakeConfig;
// Each test file uses a part of these.
#[allow(unused_imports)]
pub use handoff_test::redis::{connection, read_all, ScratchStream as Scratch};

/// An intake of consumer `consumer` in `group` on `scratch`'s stream.
pub fn intake_config(scratch: &Scratch, group: &str, consumer: &str) -> IntakeConfig {
    IntakeConfig {
        url: handoff_test::redis::url(),
        stream: scratch.key().to_owned(),
        group: group.to_owned(),
        consumer: consumer.to_owned(),
        ..IntakeConfig::default()
    }
}
