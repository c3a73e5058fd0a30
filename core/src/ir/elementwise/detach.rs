//! The stop-gradient: the value as it is, seen by autodiff as a constant.

use super::{Derive, Lanes, Unary};
use crate::error::{Error, Result};
use crate::ir::op::ValueId;

/// `x`, through which no gradient flows (autodiff skips it: nothing reaches `x` from here).
#[derive(Clone, Copy, Debug)]
pub struct Detach;

impl Unary for Detach {
    const NAME: &'static str = "detach";
    const KEEPS_ZERO: bool = true;
    #[inline(always)]
    fn apply<L: Lanes>(self, x: L) -> L {
        x
    }
    fn cuda(self, x: &str) -> String {
        format!("({x})")
    }
    fn derivative(self, _: &mut dyn Derive, _: ValueId, _: ValueId, _: ValueId) -> Result<ValueId> {
        Err(Error::Backend {
            backend: "autodiff",
            op: "detach".into(),
            msg: "a stop-gradient has no derivative".into(),
        })
    }
}
