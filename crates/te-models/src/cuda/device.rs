//! Where a model runs (`te generate --device`), and opening that GPU.

use super::ops::Cuda;
use crate::{ModelError, Result};

/// Where a model runs (`te generate --device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// The host (rayon), the default.
    Cpu,
    /// GPU `N` (`cuda` = `cuda:0`).
    Cuda(usize),
    /// GPU 0 when the driver and NVRTC load and a device exists, else the
    /// CPU.
    Auto,
}

impl Device {
    /// Parses `cpu`, `cuda`, `cuda:N` or `auto`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            "auto" => Ok(Device::Auto),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| ModelError::UnknownDevice(s.to_string())),
        }
    }

    /// Opens the GPU this names, before any weights are read (so a
    /// missing GPU fails in a moment, not after loading): `Cpu` gives
    /// `None`; `Cuda(n)` opens GPU `n` (driver, NVRTC, the device, and
    /// cuBLAS unless `TE_NO_CUBLAS` is set, else a note that our GEMM
    /// kernel runs); `Auto` opens GPU 0 when it can, else gives `None`
    /// with a note on stderr saying why.
    ///
    /// Errors (`Cuda(n)` only): the missing library, or the device that
    /// failed to open, named.
    pub fn open(self) -> Result<Option<Cuda>> {
        let use_cublas = std::env::var_os("TE_NO_CUBLAS").is_none();
        match self {
            Device::Cpu => Ok(None),
            Device::Cuda(n) => Cuda::new(n, use_cublas).map(Some),
            Device::Auto => match Cuda::new(0, use_cublas) {
                Ok(cuda) => Ok(Some(cuda)),
                Err(e) => {
                    eprintln!("note: --device auto: no usable GPU ({e}): running on the CPU");
                    Ok(None)
                }
            },
        }
    }
}
