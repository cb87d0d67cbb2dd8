//! Named tensors held as little-endian bytes, in a fixed order: what a checkpoint is read into and written
//! from, and what the name map splits and concatenates (row ranges are byte ranges, whatever the type).

use std::collections::HashMap;

use super::error::HfError;

/// The element types of checkpoints this model reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HfDtype {
    /// IEEE single precision.
    F32,
    /// bfloat16 (the upper half of an F32).
    Bf16,
}

impl HfDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            HfDtype::F32 => 4,
            HfDtype::Bf16 => 2,
        }
    }

    /// The name PyTorch gives it in `config.json`'s `torch_dtype`.
    pub fn torch_name(self) -> &'static str {
        match self {
            HfDtype::F32 => "float32",
            HfDtype::Bf16 => "bfloat16",
        }
    }

    pub(crate) fn to_safetensors(self) -> safetensors::Dtype {
        match self {
            HfDtype::F32 => safetensors::Dtype::F32,
            HfDtype::Bf16 => safetensors::Dtype::BF16,
        }
    }

    pub(crate) fn from_safetensors(dtype: safetensors::Dtype) -> Option<Self> {
        match dtype {
            safetensors::Dtype::F32 => Some(HfDtype::F32),
            safetensors::Dtype::BF16 => Some(HfDtype::Bf16),
            _ => None,
        }
    }
}

/// One tensor: its type, its shape and its elements as little-endian bytes in row-major order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HfTensor {
    dtype: HfDtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl HfTensor {
    /// A tensor of `data` bytes, checked to hold exactly `shape`'s elements of `dtype`.
    pub fn new(dtype: HfDtype, shape: Vec<usize>, data: Vec<u8>) -> Result<Self, HfError> {
        let expected = shape
            .iter()
            .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d));
        if expected != Some(data.len()) {
            return Err(HfError::invalid(
                "HfTensor::new",
                format!(
                    "{} bytes do not hold a {dtype:?} tensor of shape {shape:?}",
                    data.len()
                ),
            ));
        }
        Ok(HfTensor { dtype, shape, data })
    }

    /// An F32 tensor of `values`.
    pub fn from_f32(shape: Vec<usize>, values: &[f32]) -> Result<Self, HfError> {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self::new(HfDtype::F32, shape, data)
    }

    /// The element type.
    pub fn dtype(&self) -> HfDtype {
        self.dtype
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The elements' bytes.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The values as f32 (BF16 widened exactly).
    pub fn to_f32(&self) -> Vec<f32> {
        match self.dtype {
            HfDtype::F32 => self
                .data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            HfDtype::Bf16 => self
                .data
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        }
    }

    /// The tensor in `dtype`: F32 to BF16 rounds to nearest even (as `fsdp_optim::export_full` does),
    /// BF16 to F32 is exact.
    pub fn cast(&self, dtype: HfDtype) -> HfTensor {
        if dtype == self.dtype {
            return self.clone();
        }
        let values = self.to_f32();
        let data = match dtype {
            HfDtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            HfDtype::Bf16 => values
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
        };
        HfTensor {
            dtype,
            shape: self.shape.clone(),
            data,
        }
    }

    /// Rows `start..end` of a tensor of two or more dimensions (rows along the first).
    pub(crate) fn rows(&self, start: usize, end: usize) -> Result<HfTensor, HfError> {
        let (&first, rest) = self
            .shape
            .split_first()
            .ok_or_else(|| HfError::invalid("HfTensor::rows", "a scalar has no rows"))?;
        if start > end || end > first {
            return Err(HfError::invalid(
                "HfTensor::rows",
                format!("rows {start}..{end} of a tensor of {first}"),
            ));
        }
        let row_bytes = rest.iter().product::<usize>() * self.dtype.size();
        let mut shape = self.shape.clone();
        shape[0] = end - start;
        Ok(HfTensor {
            dtype: self.dtype,
            shape,
            data: self.data[start * row_bytes..end * row_bytes].to_vec(),
        })
    }

    /// The tensors stacked along their first dimension; all must share the type and the other
    /// dimensions (the caller checks the shapes first and names the offender).
    pub(crate) fn concat_rows(parts: &[&HfTensor]) -> Result<HfTensor, HfError> {
        let first = parts
            .first()
            .ok_or_else(|| HfError::invalid("HfTensor::concat_rows", "no tensors"))?;
        let mut shape = first.shape.clone();
        let mut rows = 0;
        let mut data = Vec::with_capacity(parts.iter().map(|p| p.data.len()).sum());
        for p in parts {
            if p.dtype != first.dtype || p.shape.get(1..) != first.shape.get(1..) {
                return Err(HfError::invalid(
                    "HfTensor::concat_rows",
                    format!(
                        "a {:?} tensor of {:?} after a {:?} tensor of {:?}",
                        p.dtype, p.shape, first.dtype, first.shape
                    ),
                ));
            }
            rows += p.shape.first().copied().unwrap_or(0);
            data.extend_from_slice(&p.data);
        }
        if let Some(r) = shape.first_mut() {
            *r = rows;
        }
        Ok(HfTensor {
            dtype: first.dtype,
            shape,
            data,
        })
    }
}

/// Tensors by name, in insertion order (the model's order when built from a name map: the order a
/// sharded directory is split in).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TensorSet {
    entries: Vec<(String, HfTensor)>,
    index: HashMap<String, usize>,
}

impl TensorSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `tensor` as `name`; a name already present is an error naming it.
    pub fn insert(&mut self, name: impl Into<String>, tensor: HfTensor) -> Result<(), HfError> {
        let name = name.into();
        if self.index.contains_key(&name) {
            return Err(HfError::invalid(
                "TensorSet::insert",
                format!("{name} is already in the set"),
            ));
        }
        self.index.insert(name.clone(), self.entries.len());
        self.entries.push((name, tensor));
        Ok(())
    }

    /// The tensor named `name`.
    pub fn get(&self, name: &str) -> Option<&HfTensor> {
        self.index.get(name).map(|&i| &self.entries[i].1)
    }

    /// Whether `name` is in the set.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Names and tensors, in insertion order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &HfTensor)> {
        self.entries.iter().map(|(n, t)| (n.as_str(), t))
    }

    /// The names, in insertion order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|(n, _)| n.as_str())
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the set holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes of all tensors' elements (the index's `metadata.total_size`).
    pub fn total_bytes(&self) -> usize {
        self.entries.iter().map(|(_, t)| t.data.len()).sum()
    }

    /// Every tensor cast to `dtype` (see [`HfTensor::cast`]).
    pub fn cast(&self, dtype: HfDtype) -> TensorSet {
        TensorSet {
            entries: self
                .entries
                .iter()
                .map(|(n, t)| (n.clone(), t.cast(dtype)))
                .collect(),
            index: self.index.clone(),
        }
    }
}
