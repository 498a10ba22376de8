//! dniasync-core: the pure-Rust hot paths of dniasync.
//!
//! - [`ParamStore`]: a flat f32 buffer of atomic cells with named, versioned segments,
//!   optimizers applied in place, optional backing by shared memory.
//! - [`quant`]: threshold (Strom), 1-bit with error feedback (Seide) and 8-bit blockwise
//!   gradient codecs, each appliable to a store without a dense intermediate.
//! - [`rows`]: rows of a memory-mapped uint8 data file gathered into a float32 batch.
//! - [`vecops`]: float64 vector kernels (dot, axpy, linear combinations) that Sandblaster
//!   L-BFGS runs on each PS shard's slice.
//!
//! Nothing in this crate knows about Python; `dniasync-py` converts.

pub mod error;
pub mod grad;
pub mod layout;
pub mod optim;
pub mod quant;
pub mod rows;
pub mod shm;
mod simd;
pub mod store;
pub mod vecops;

pub use error::{CoreError, Result};
pub use grad::{Dense, GradSource};
pub use layout::{Layout, Optimizer, OptimizerConfig, SegmentSpec};
pub use simd::{
    all_finite, available_isas, detected_isa, isa, set_process_isa, with_isa, Isa, CHUNK,
};
pub use store::{NonFinitePolicy, ParamStore, Segment};

/// Crate version, reported by the Python extension as `dniasync._core.__version__`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
