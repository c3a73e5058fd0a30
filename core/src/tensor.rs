//! Host tensors: a shape, a dtype and row-major storage shared by cheap views.

use crate::error::{Error, Result};
use half::{bf16, f16};
use smallvec::SmallVec;
use std::fmt;
use std::sync::Arc;

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

/// Element types: f32 for compute, f16 and bf16 for storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE single precision.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }
}

/// Owned element storage of one dtype.
#[derive(Clone, Debug, PartialEq)]
pub enum Storage {
    /// f32 elements.
    F32(Vec<f32>),
    /// f16 elements.
    F16(Vec<f16>),
    /// bf16 elements.
    BF16(Vec<bf16>),
}

impl Storage {
    fn dtype(&self) -> DType {
        match self {
            Storage::F32(_) => DType::F32,
            Storage::F16(_) => DType::F16,
            Storage::BF16(_) => DType::BF16,
        }
    }

    fn from_f32(data: &[f32], dtype: DType) -> Storage {
        match dtype {
            DType::F32 => Storage::F32(data.to_vec()),
            DType::F16 => Storage::F16(data.iter().map(|&x| f16::from_f32(x)).collect()),
            DType::BF16 => Storage::BF16(data.iter().map(|&x| bf16::from_f32(x)).collect()),
        }
    }

    fn read_f32(&self, range: std::ops::Range<usize>, out: &mut Vec<f32>) {
        match self {
            Storage::F32(v) => out.extend_from_slice(&v[range]),
            Storage::F16(v) => out.extend(v[range].iter().map(|x| x.to_f32())),
            Storage::BF16(v) => out.extend(v[range].iter().map(|x| x.to_f32())),
        }
    }
}

/// A row-major host tensor. Clones and views share storage; views select a contiguous range.
#[derive(Clone, Debug)]
pub struct Tensor {
    storage: Arc<Storage>,
    shape: Shape,
    offset: usize,
}

impl Tensor {
    /// An f32 tensor from its elements; errors when `data` does not have `shape`'s element count.
    pub fn from_vec(data: Vec<f32>, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if data.len() != shape.numel() {
            return Err(Error::Input {
                what: "Tensor::from_vec".into(),
                expected: format!("{} elements for shape {shape}", shape.numel()),
                got: format!("{} elements", data.len()),
            });
        }
        Ok(Tensor { storage: Arc::new(Storage::F32(data)), shape, offset: 0 })
    }

    /// A tensor of zeros.
    pub fn zeros(shape: impl Into<Shape>, dtype: DType) -> Tensor {
        let shape = shape.into();
        let data = vec![0.0; shape.numel()];
        Tensor { storage: Arc::new(Storage::from_f32(&data, dtype)), shape, offset: 0 }
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.storage.dtype()
    }

    /// The elements as f32, converting from f16/bf16 storage.
    pub fn to_vec(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.shape.numel());
        self.storage.read_f32(self.offset..self.offset + self.shape.numel(), &mut out);
        out
    }

    /// A copy stored as `dtype` (rounding to nearest for f16/bf16).
    pub fn to_dtype(&self, dtype: DType) -> Tensor {
        let data = self.to_vec();
        Tensor { storage: Arc::new(Storage::from_f32(&data, dtype)), shape: self.shape.clone(), offset: 0 }
    }

    /// A view of rows `start..start + len` along the first dimension; shares storage.
    pub fn narrow(&self, start: usize, len: usize) -> Result<Tensor> {
        let outer = self.shape.dims().first().copied().unwrap_or(1);
        if start + len > outer {
            return Err(Error::Input {
                what: "Tensor::narrow".into(),
                expected: format!("rows within 0..{outer} of {}", self.shape),
                got: format!("{start}..{}", start + len),
            });
        }
        let inner = self.shape.numel().checked_div(outer).unwrap_or(0);
        let mut dims = self.shape.dims().to_vec();
        if let Some(d) = dims.first_mut() {
            *d = len;
        }
        Ok(Tensor { storage: self.storage.clone(), shape: Shape::new(&dims), offset: self.offset + start * inner })
    }

    /// The same elements under another shape with the same element count; shares storage.
    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if shape.numel() != self.shape.numel() {
            return Err(Error::Input {
                what: "Tensor::reshape".into(),
                expected: format!("{} elements", self.shape.numel()),
                got: format!("shape {shape} with {} elements", shape.numel()),
            });
        }
        Ok(Tensor { storage: self.storage.clone(), shape, offset: self.offset })
    }

    /// Whether two tensors are views of the same storage.
    pub fn shares_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.storage, &other.storage)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_share_storage_and_select_rows() {
        let t = Tensor::from_vec((0..12).map(|x| x as f32).collect(), [4, 3]).unwrap();
        let v = t.narrow(1, 2).unwrap();
        assert!(v.shares_storage(&t));
        assert_eq!(v.to_vec(), vec![3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
        assert_eq!(v.reshape(6usize).unwrap().shape(), &Shape::mat(1, 6));
        assert!(t.narrow(3, 2).is_err());
        assert!(t.reshape(5usize).is_err());
    }

    #[test]
    fn half_storage_round_trips() {
        let t = Tensor::from_vec(vec![1.0, -2.5, 0.333_333_34, 65504.0], 4usize).unwrap();
        let h = t.to_dtype(DType::F16);
        assert_eq!(h.dtype(), DType::F16);
        let back = h.to_vec();
        assert_eq!(back[0], 1.0);
        assert_eq!(back[1], -2.5);
        assert!((back[2] - 0.333_333_34).abs() < 1e-3);
        let b = t.to_dtype(DType::BF16).to_vec();
        assert!((b[2] - 0.333_333_34).abs() < 2e-3);
        assert_eq!(DType::BF16.size(), 2);
    }

    #[test]
    fn from_vec_checks_length() {
        let e = Tensor::from_vec(vec![1.0; 5], [2, 3]).unwrap_err();
        assert!(e.to_string().contains("6 elements"), "{e}");
    }
}
