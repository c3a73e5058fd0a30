//! The shape of a value: its extents, outermost first (row-major).

use smallvec::SmallVec;
use std::fmt;

/// The extents of a tensor, outermost first (row-major).
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(SmallVec<[usize; 4]>);

impl Shape {
    /// A shape from its extents.
    pub fn new(dims: &[usize]) -> Self {
        Shape(dims.iter().copied().collect())
    }

    /// A matrix shape.
    pub fn mat(rows: usize, cols: usize) -> Self {
        Shape::new(&[rows, cols])
    }

    /// The extents.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    /// The number of elements.
    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }

    /// Rows of a matrix shape (the product of all but the last extent; 1 for a scalar).
    pub fn rows(&self) -> usize {
        match self.0.split_last() {
            Some((_, rest)) => rest.iter().product(),
            None => 1,
        }
    }

    /// Columns of a matrix shape (the last extent; 1 for a scalar).
    pub fn cols(&self) -> usize {
        self.0.last().copied().unwrap_or(1)
    }
}

impl From<usize> for Shape {
    /// A row vector `[1 × n]`.
    fn from(n: usize) -> Self {
        Shape::mat(1, n)
    }
}

impl From<[usize; 2]> for Shape {
    fn from(d: [usize; 2]) -> Self {
        Shape::mat(d[0], d[1])
    }
}

impl From<&[usize]> for Shape {
    fn from(d: &[usize]) -> Self {
        Shape::new(d)
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        write!(f, "[{}]", parts.join("×"))
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}
