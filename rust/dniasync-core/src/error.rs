//! One error type for the core; the bindings map each variant to a Python exception.
use std::fmt;

/// Everything that can go wrong in the core, each variant saying what was wrong.
#[derive(Debug)]
pub enum CoreError {
    /// A buffer had the wrong number of elements.
    LengthMismatch {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    /// No segment with that name in the store.
    UnknownSegment(String),
    /// A gradient contained NaN or ±Inf and the policy is to reject it.
    NonFinite { what: &'static str },
    /// An argument outside its domain (negative lr, bad block size, malformed payload...).
    InvalidArgument(String),
    /// A shared-memory store exists but its layout is not the one the caller expects.
    LayoutMismatch(String),
    /// A shared-memory name is already taken.
    AlreadyExists(String),
    /// No shared-memory store with that name.
    NotFound(String),
    /// Any other operating-system error, with the operation that failed.
    Io { op: String, source: std::io::Error },
}

/// Result alias used throughout the crate.
pub type Result<T> = std::result::Result<T, CoreError>;

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CoreError::LengthMismatch {
                what,
                expected,
                got,
            } => write!(f, "{what}: expected {expected} elements, got {got}"),
            CoreError::UnknownSegment(name) => write!(f, "unknown segment {name:?}"),
            CoreError::NonFinite { what } => {
                write!(f, "{what} contains NaN or Inf; update rejected")
            }
            CoreError::InvalidArgument(msg) => f.write_str(msg),
            CoreError::LayoutMismatch(msg) => write!(f, "shared-memory layout mismatch: {msg}"),
            CoreError::AlreadyExists(msg) => f.write_str(msg),
            CoreError::NotFound(msg) => f.write_str(msg),
            CoreError::Io { op, source } => write!(f, "{op}: {source}"),
        }
    }
}

impl std::error::Error for CoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CoreError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

pub fn invalid(msg: impl Into<String>) -> CoreError {
    CoreError::InvalidArgument(msg.into())
}

pub fn check_len(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(CoreError::LengthMismatch {
            what,
            expected,
            got,
        })
    }
}
