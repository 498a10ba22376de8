//! dniasync-core: the pure-Rust hot paths of dniasync.
//!
//! Nothing in this crate knows about Python; `dniasync-py` converts.

/// Crate version, reported by the Python extension as `dniasync._core.__version__`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
