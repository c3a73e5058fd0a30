//! The one error type of arbor: every fallible call in every crate returns [`Result`].

use crate::tensor::Shape;
use std::fmt;

/// A value as an error message shows it: its id, what computes it and its per-vertex shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValueDesc {
    /// The value's index in its function.
    pub id: usize,
    /// The op that computes it, e.g. `sigmoid` or `param W`.
    pub op: String,
    /// Its shape (per vertex for vertex values, the whole matrix for parameters).
    pub shape: Shape,
}

impl fmt::Display for ValueDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{} = {} {}", self.id, self.op, self.shape)
    }
}

/// Formats a list of values for an error message.
fn list(values: &[ValueDesc]) -> String {
    let parts: Vec<String> = values.iter().map(ToString::to_string).collect();
    parts.join(", ")
}

/// `at` as the start of a message: `file:line:column: `, or nothing.
fn place(at: &Option<String>) -> String {
    at.as_ref().map_or_else(String::new, |at| format!("{at}: "))
}

/// Everything that can go wrong in arbor, with the place it went wrong. Its `Debug` form is its
/// message, so `fn main() -> arbor::Result<()>` and `unwrap` print what went wrong, not a struct.
#[derive(Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// An op of a vertex function got inputs of shapes it cannot combine.
    #[error("{}vertex function `{function}`: op `{op}` cannot take inputs [{}]: {reason}", place(.at), list(.inputs))]
    Shape {
        /// Where the user's code added the op (`file:line:column`), when known.
        at: Option<String>,
        /// The function being built.
        function: String,
        /// The op that was being added.
        op: String,
        /// Its inputs.
        inputs: Vec<ValueDesc>,
        /// What is wrong with them.
        reason: String,
    },
    /// `gather(k)` with k at or beyond the function's declared arity.
    #[error(
        "{}vertex function `{function}`: gather slot {slot} of state `{state}` is beyond the declared arity {arity}",
        place(.at)
    )]
    GatherSlot {
        /// Where the user's code gathered (`file:line:column`), when known.
        at: Option<String>,
        /// The function being built.
        function: String,
        /// The slot asked for.
        slot: usize,
        /// The state asked for.
        state: String,
        /// The declared arity.
        arity: usize,
    },
    /// A gathered state whose shape differs from the value that is scattered under its name.
    #[error(
        "{}vertex function `{function}`: state `{state}` is gathered as {gathered} but scattered as {scattered}",
        place(.at)
    )]
    StateShape {
        /// Where the user's code made the second of the two (`file:line:column`), when known.
        at: Option<String>,
        /// The function being built.
        function: String,
        /// The state's name.
        state: String,
        /// The shape `gather` declared.
        gathered: Shape,
        /// The shape of the scattered value.
        scattered: Shape,
    },
    /// A state that is gathered but never scattered.
    #[error("vertex function `{function}`: state `{state}` is gathered but never scattered")]
    NotScattered {
        /// The function being built.
        function: String,
        /// The state's name.
        state: String,
    },
    /// A name used twice for the same kind of thing.
    #[error("vertex function `{function}`: {kind} `{name}` is declared twice")]
    Duplicate {
        /// The function being built.
        function: String,
        /// What kind of name (param, state, input, output).
        kind: &'static str,
        /// The name.
        name: String,
    },
    /// A value that no op, scatter or push uses.
    #[error("{}vertex function `{function}`: value {value} is never used", place(.at))]
    Unused {
        /// Where the user's code made the value (`file:line:column`), when known.
        at: Option<String>,
        /// The function being built.
        function: String,
        /// The unused value.
        value: ValueDesc,
    },
    /// A value whose uses never reach a scatter or a push.
    #[error("{}vertex function `{function}`: value {value} reaches neither a scatter nor a push", place(.at))]
    Dead {
        /// Where the user's code made the value (`file:line:column`), when known.
        at: Option<String>,
        /// The function being built.
        function: String,
        /// The dead value.
        value: ValueDesc,
    },
    /// A function with neither a scatter nor a push.
    #[error("vertex function `{function}`: it scatters and pushes nothing")]
    NoOutput {
        /// The function being built.
        function: String,
    },
    /// An input graph that is not a valid DAG for the function.
    #[error("input graph {graph}: {reason}")]
    Graph {
        /// Which graph (index in the minibatch, or a file and line).
        graph: String,
        /// What is wrong, naming the vertex.
        reason: String,
    },
    /// Data handed to a run does not fit what the function declared.
    #[error("{what}: expected {expected}, got {got}")]
    Input {
        /// What was handed in.
        what: String,
        /// What was expected.
        expected: String,
        /// What came.
        got: String,
    },
    /// A backend failed (device missing, out of memory, kernel failure).
    #[error("backend {backend}: {op}: {msg}")]
    Backend {
        /// The backend's name.
        backend: &'static str,
        /// The operation that failed.
        op: String,
        /// Why.
        msg: String,
    },
    /// A malformed input file.
    #[error("{file}:{line}: {msg}")]
    Parse {
        /// The file (or a description of the source).
        file: String,
        /// The 1-based line.
        line: usize,
        /// What is wrong.
        msg: String,
    },
    /// An I/O failure, with the path.
    #[error("{path}: {msg}")]
    Io {
        /// The path involved.
        path: String,
        /// The system's message.
        msg: String,
    },
    /// Training met a value that is not finite (it diverged): the step, and the loss or the
    /// tensor whose gradient or value it is. Nothing of that step is applied.
    #[error(
        "training diverged at step {step}: {what} `{tensor}` is {value} (not finite); lower the learning rate, \
         or bound the gradient norm (`Settings::clip`, --clip)"
    )]
    Diverged {
        /// The optimizer step (from 1) whose loss or gradients are not finite.
        step: u64,
        /// Whose values are not finite: "the gradient of" or "the value of".
        what: &'static str,
        /// The tensor (`cell.W`, `embedding`, …), or `loss`.
        tensor: String,
        /// The first value that is not finite.
        value: f32,
    },
    /// A distributed run failed at a worker (thread, MPI rank or pipeline stage), or a peer it
    /// waits on died or stopped answering.
    #[error("worker {rank}: {msg}")]
    Worker {
        /// The worker that reports the failure.
        rank: usize,
        /// What went wrong, naming the peer where one is involved.
        msg: String,
    },
}

impl Error {
    /// [`Error::Input`]: `what` was handed in, `expected` was expected, `got` came.
    pub fn input(what: impl Into<String>, expected: impl Into<String>, got: impl Into<String>) -> Error {
        Error::Input { what: what.into(), expected: expected.into(), got: got.into() }
    }
}

/// arbor's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_prints_the_message() {
        let e = Error::input("--lr", "a rate above 0", "-1");
        assert_eq!(format!("{e:?}"), "--lr: expected a rate above 0, got -1");
        assert_eq!(format!("{:?}", Err::<(), _>(e.clone())), format!("Err({e})"));
    }
}
