//! The natural logarithm.

use super::{Derive, Lanes, Unary};
use crate::error::Result;
use crate::ir::op::ValueId;
use crate::ir::BinaryOp;

/// `ln x`
#[derive(Clone, Copy, Debug)]
pub struct Log;

impl Unary for Log {
    const NAME: &'static str = "log";
    const KEEPS_ZERO: bool = false;
    #[inline(always)]
    fn apply<L: Lanes>(self, x: L) -> L {
        x.ln()
    }
    fn cuda(self, x: &str) -> String {
        format!("logf({x})")
    }
    fn derivative(self, d: &mut dyn Derive, x: ValueId, _: ValueId, g: ValueId) -> Result<ValueId> {
        let x = d.primal(x);
        d.binary(BinaryOp::Div, g, x)
    }
}
