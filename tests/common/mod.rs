//! Helpers shared by integration tests.
#![allow(dead_code)]

pub mod host_c;
pub mod kernels;
pub mod optim;
pub mod watched;
