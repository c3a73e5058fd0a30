//! The vertex-function IR: ops, the builder, the built function and its derived backward.

mod autodiff;
mod builder;
mod columns;
mod declaration;
pub mod elementwise;
mod func;
pub mod interp;
mod op;
mod vertex_fn;

pub use autodiff::{Backward, ChildGrad, ParamGrad};
pub use builder::{Builder, Var};
pub use columns::Cols;
pub(crate) use declaration::Declaration;
pub use declaration::Declared;
pub use func::{Func, Init, Names, Node, ParamDecl, Port, StateDecl};
pub use op::{BinaryOp, Op, Reduce, UnaryOp, ValueId};
pub use vertex_fn::VertexFn;
