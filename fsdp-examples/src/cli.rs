//! The flag values the example binaries share (`gpt_fsdp`, `mnist_fsdp`, `mlp_bench` and the
//! `linear_crossover` example): one clap [`ValueEnum`] per choice, each with its conversion to the
//! library type it selects.
//!
//! The value names (`fp8`, `bf16`, `low`, …) and the variants' doc comments are what `--help` shows;
//! the defaults stay with each binary's flag, as they differ between binaries. Enums whose variants
//! have no doc comment keep clap's one-line `[possible values: …]` list in the help: a variant doc
//! comment would turn it into a described list, which is why those variants go undocumented.
//!
//! ```
//! use clap::ValueEnum;
//! use fsdp_examples::cli::{ExportArg, StatesArg};
//!
//! let states = StatesArg::from_str("f32", false)?;
//! assert_eq!(fsdp_optim::StatePrecision::from(states), fsdp_optim::StatePrecision::F32);
//! assert_eq!(ExportArg::Bf16.to_possible_value().map(|v| v.get_name().to_owned()), Some("bf16".into()));
//! # Ok::<(), String>(())
//! ```

use clap::ValueEnum;
use fp8_kernels::{Device, KernelError};
use fsdp_nn::LinearPrecision;
use fsdp_optim::{ExportDtype, StatePrecision};
use fsdp_shard::GradDtype;

use crate::gpt::GptPrecision;
use crate::run_setup::DeviceChoice;

/// `--device`: where to run.
#[allow(missing_docs)] // the values name themselves; docs here would change `--help` (see the module)
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    Auto,
    Cpu,
    Cuda,
}

impl DeviceArg {
    /// The device with `auto` decided now: CUDA when a GPU and its libraries are usable, else the CPU
    /// together with why CUDA is not usable (for the binary to report in its own words).
    pub fn resolve(self) -> (DeviceChoice, Option<KernelError>) {
        match self {
            DeviceArg::Cpu => (DeviceChoice::Cpu, None),
            DeviceArg::Cuda => (DeviceChoice::Cuda, None),
            DeviceArg::Auto => {
                let (d, why) = Device::auto();
                let choice = if d.is_cuda() {
                    DeviceChoice::Cuda
                } else {
                    DeviceChoice::Cpu
                };
                (choice, why)
            }
        }
    }
}

impl From<DeviceArg> for DeviceChoice {
    /// `auto` stays [`DeviceChoice::Auto`], decided at launch; see [`DeviceArg::resolve`] to decide now.
    fn from(arg: DeviceArg) -> Self {
        match arg {
            DeviceArg::Auto => DeviceChoice::Auto,
            DeviceArg::Cpu => DeviceChoice::Cpu,
            DeviceArg::Cuda => DeviceChoice::Cuda,
        }
    }
}

/// `--precision`: the arithmetic of the linear layers (FP8, BF16 or F32).
#[allow(missing_docs)] // the values name themselves; docs here would change `--help` (see the module)
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PrecisionArg {
    Fp8,
    Bf16,
    Fp32,
}

impl From<PrecisionArg> for LinearPrecision {
    fn from(arg: PrecisionArg) -> Self {
        match arg {
            PrecisionArg::Fp8 => LinearPrecision::Fp8,
            PrecisionArg::Bf16 => LinearPrecision::Bf16,
            PrecisionArg::Fp32 => LinearPrecision::F32,
        }
    }
}

impl From<PrecisionArg> for GptPrecision {
    fn from(arg: PrecisionArg) -> Self {
        match arg {
            PrecisionArg::Fp8 => GptPrecision::Fp8,
            PrecisionArg::Bf16 => GptPrecision::Bf16,
            PrecisionArg::Fp32 => GptPrecision::Fp32,
        }
    }
}

/// `--optimizer-states`: the optimizer states of the FP8 weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StatesArg {
    /// F16 master, FP8 E4M3 first moment, F16 second moment (MS-AMP's recipe).
    Low,
    /// F32 master and moments.
    F32,
}

impl From<StatesArg> for StatePrecision {
    fn from(arg: StatesArg) -> Self {
        match arg {
            StatesArg::Low => StatePrecision::LowPrecision,
            StatesArg::F32 => StatePrecision::F32,
        }
    }
}

/// `--export-dtype`: the element type of an exported safetensors file.
#[allow(missing_docs)] // the values name themselves; docs here would change `--help` (see the module)
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ExportArg {
    F32,
    Bf16,
}

impl From<ExportArg> for ExportDtype {
    fn from(arg: ExportArg) -> Self {
        match arg {
            ExportArg::F32 => ExportDtype::F32,
            ExportArg::Bf16 => ExportDtype::Bf16,
        }
    }
}

/// `--grad-shards`: the storage of the reduced gradient shards.
#[allow(missing_docs)] // the values name themselves; docs here would change `--help` (see the module)
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GradShardsArg {
    F32,
    Bf16,
}

impl From<GradShardsArg> for GradDtype {
    fn from(arg: GradShardsArg) -> Self {
        match arg {
            GradShardsArg::F32 => GradDtype::F32,
            GradShardsArg::Bf16 => GradDtype::Bf16,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The accepted values, in the order `--help` lists them: the binaries' flags must not change.
    fn names<T: ValueEnum>() -> Vec<String> {
        T::value_variants()
            .iter()
            .filter_map(|v| v.to_possible_value())
            .map(|p| p.get_name().to_owned())
            .collect()
    }

    #[test]
    fn value_names_are_the_flags_values() {
        assert_eq!(names::<DeviceArg>(), ["auto", "cpu", "cuda"]);
        assert_eq!(names::<PrecisionArg>(), ["fp8", "bf16", "fp32"]);
        assert_eq!(names::<StatesArg>(), ["low", "f32"]);
        assert_eq!(names::<ExportArg>(), ["f32", "bf16"]);
        assert_eq!(names::<GradShardsArg>(), ["f32", "bf16"]);
    }

    #[test]
    fn conversions_select_the_named_library_value() {
        assert_eq!(DeviceChoice::from(DeviceArg::Auto), DeviceChoice::Auto);
        assert_eq!(DeviceChoice::from(DeviceArg::Cpu), DeviceChoice::Cpu);
        assert_eq!(DeviceChoice::from(DeviceArg::Cuda), DeviceChoice::Cuda);
        assert_eq!(DeviceArg::Cpu.resolve().0, DeviceChoice::Cpu);
        assert_eq!(DeviceArg::Cuda.resolve().0, DeviceChoice::Cuda);
        assert_ne!(DeviceArg::Auto.resolve().0, DeviceChoice::Auto);
        assert_eq!(
            LinearPrecision::from(PrecisionArg::Fp8),
            LinearPrecision::Fp8
        );
        assert_eq!(
            LinearPrecision::from(PrecisionArg::Bf16),
            LinearPrecision::Bf16
        );
        assert_eq!(
            LinearPrecision::from(PrecisionArg::Fp32),
            LinearPrecision::F32
        );
        assert_eq!(GptPrecision::from(PrecisionArg::Fp8), GptPrecision::Fp8);
        assert_eq!(GptPrecision::from(PrecisionArg::Bf16), GptPrecision::Bf16);
        assert_eq!(GptPrecision::from(PrecisionArg::Fp32), GptPrecision::Fp32);
        assert_eq!(
            StatePrecision::from(StatesArg::Low),
            StatePrecision::LowPrecision
        );
        assert_eq!(StatePrecision::from(StatesArg::F32), StatePrecision::F32);
        assert_eq!(ExportDtype::from(ExportArg::F32), ExportDtype::F32);
        assert_eq!(ExportDtype::from(ExportArg::Bf16), ExportDtype::Bf16);
        assert_eq!(GradDtype::from(GradShardsArg::F32), GradDtype::F32);
        assert_eq!(GradDtype::from(GradShardsArg::Bf16), GradDtype::Bf16);
    }
}
