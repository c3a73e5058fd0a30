//! Helpers shared by integration tests.
#![allow(dead_code)]

pub mod kernels;
pub mod optim;
pub mod watched;
