//! Batches on the device: the training and test sets uploaded once (CUDA) or gathered per batch from
//! host memory (CPU), and the per-batch buffers reused across steps.

use super::MnistError;
use crate::data::{MnistDataset, MNIST_COLS, MNIST_ROWS};
use fp8_kernels::gather_rows::{gather_rows, RowIndex};
use fp8_kernels::{Buffer, Device, Element};

/// Makes `slot` a device buffer holding `data` (reallocated only when the length changes).
fn upload_into<T: Element>(
    slot: &mut Option<Buffer<T>>,
    device: &Device,
    data: &[T],
) -> Result<(), MnistError> {
    match slot {
        Some(b) if b.len() == data.len() => b.copy_from_host(data)?,
        _ => *slot = Some(device.upload(data)?),
    }
    Ok(())
}

/// Host staging and device buffers of one batch.
pub(super) struct BatchBuffers {
    images_host: Vec<f32>,
    labels_host: Vec<i32>,
    images: Option<Buffer<f32>>,
    labels: Option<Buffer<i32>>,
}

impl BatchBuffers {
    fn load(
        &mut self,
        data: &MnistDataset,
        indices: &[usize],
        device: &Device,
    ) -> Result<(&Buffer<f32>, &Buffer<i32>), MnistError> {
        let pixels = MNIST_ROWS * MNIST_COLS;
        self.images_host.resize(indices.len() * pixels, 0.0);
        self.labels_host.resize(indices.len(), 0);
        data.fill_batch(indices, &mut self.images_host, &mut self.labels_host)?;
        upload_into(&mut self.images, device, &self.images_host)?;
        upload_into(&mut self.labels, device, &self.labels_host)?;
        match (&self.images, &self.labels) {
            (Some(i), Some(l)) => Ok((i, l)),
            _ => Err(MnistError::Config("batch buffers missing".into())),
        }
    }
}

/// A split resident on the GPU: every normalised image and label uploaded once, the sample order of the
/// epoch uploaded once as a [`RowIndex`], and each batch gathered on the device into reused buffers (no
/// host-to-device copy and no host wait per step).
pub(super) struct DeviceSplit {
    images: Buffer<f32>,
    labels: Buffer<i32>,
    order: RowIndex,
    batch_images: Option<Buffer<f32>>,
    batch_labels: Option<Buffer<i32>>,
}

/// Where batches come from: host staging and an upload per batch (CPU), or a device-resident split.
pub(super) enum Batches {
    Host(BatchBuffers),
    Device(Box<DeviceSplit>),
}

impl Batches {
    pub(super) fn new(data: &MnistDataset, device: &Device) -> Result<Self, MnistError> {
        if !device.is_cuda() {
            return Ok(Batches::Host(BatchBuffers {
                images_host: Vec::new(),
                labels_host: Vec::new(),
                images: None,
                labels: None,
            }));
        }
        Ok(Batches::Device(Box::new(DeviceSplit {
            images: device.from_vec(data.normalized_images())?,
            labels: device.from_vec(data.labels_i32())?,
            order: RowIndex::new(device, &[], data.len())?,
            batch_images: None,
            batch_labels: None,
        })))
    }

    /// Sets the sample order that [`Batches::load`] ranges refer to (one upload on a GPU).
    pub(super) fn set_order(&mut self, order: &[usize], device: &Device) -> Result<(), MnistError> {
        if let Batches::Device(d) = self {
            d.order.set(device, order)?;
        }
        Ok(())
    }

    /// The batch `order[range]` (the order last given to [`Batches::set_order`]).
    pub(super) fn load(
        &mut self,
        data: &MnistDataset,
        order: &[usize],
        range: std::ops::Range<usize>,
        device: &Device,
    ) -> Result<(&Buffer<f32>, &Buffer<i32>), MnistError> {
        let d = match self {
            Batches::Host(h) => {
                let indices = order.get(range.clone()).ok_or_else(|| {
                    MnistError::Config(format!("batch {range:?} outside the sample order"))
                })?;
                return h.load(data, indices, device);
            }
            Batches::Device(d) => d,
        };
        if d.order.as_slice().len() != order.len() {
            return Err(MnistError::Config(
                "the device sample order is not the one given".into(),
            ));
        }
        let rows = range.len();
        let pixels = MNIST_ROWS * MNIST_COLS;
        let images = reuse(&mut d.batch_images, device, rows * pixels)?;
        gather_rows(&d.images, pixels, &d.order, range.clone(), images)?;
        let labels = reuse(&mut d.batch_labels, device, rows)?;
        gather_rows(&d.labels, 1, &d.order, range, labels)?;
        match (&d.batch_images, &d.batch_labels) {
            (Some(i), Some(l)) => Ok((i, l)),
            _ => Err(MnistError::Config("batch buffers missing".into())),
        }
    }
}

/// `slot`'s buffer, reallocated only when its length is not `len` (its contents are then overwritten).
fn reuse<'a, T: Element>(
    slot: &'a mut Option<Buffer<T>>,
    device: &Device,
    len: usize,
) -> Result<&'a mut Buffer<T>, MnistError> {
    if slot.as_ref().is_none_or(|b| b.len() != len) {
        *slot = Some(device.zeros(len)?);
    }
    slot.as_mut()
        .ok_or_else(|| MnistError::Config("batch buffer missing".into()))
}
