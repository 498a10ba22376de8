//! The memory a store lives in: a private heap block, or a named file under /dev/shm
//! mapped by every process that shares the store.
use crate::error::{CoreError, Result};
use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};

/// Directory of POSIX shared memory on Linux.
pub const SHM_DIR: &str = "/dev/shm";
/// Prefix of every file a store creates, so they are easy to find and clean up.
pub const SHM_PREFIX: &str = "dniasync-";
/// Alignment of the block: a page, so the data region can be cache-line aligned.
const ALIGN: usize = 4096;

/// Path of the file backing the shared store called `name`.
pub fn shm_path(name: &str) -> Result<PathBuf> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
        && !name.starts_with('.');
    if !ok {
        return Err(CoreError::InvalidArgument(format!(
            "shared-memory name {name:?} must be 1..=200 characters of [A-Za-z0-9_.-], not starting with '.'"
        )));
    }
    Ok(PathBuf::from(format!("{SHM_DIR}/{SHM_PREFIX}{name}")))
}

fn io(op: String) -> impl FnOnce(std::io::Error) -> CoreError {
    move |source| CoreError::Io { op, source }
}

enum Kind {
    Heap,
    Shm {
        path: PathBuf,
        owner: bool,
        unlinked: AtomicBool,
    },
}

/// A zero-initialised, page-aligned block of memory, private or shared.
pub struct Region {
    ptr: NonNull<u8>,
    bytes: usize,
    kind: Kind,
}

// SAFETY: the region is plain memory; every shared access goes through atomics.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Region {
    /// A private block of `bytes` zero bytes.
    pub fn heap(bytes: usize) -> Result<Region> {
        let layout = std::alloc::Layout::from_size_align(bytes.max(1), ALIGN)
            .map_err(|e| CoreError::InvalidArgument(format!("store too large: {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            CoreError::InvalidArgument(format!("cannot allocate {bytes} bytes for the store"))
        })?;
        Ok(Region {
            ptr,
            bytes,
            kind: Kind::Heap,
        })
    }

    /// Creates the shared file `name` of `bytes` zero bytes; fails if it already exists.
    pub fn create_shm(name: &str, bytes: usize) -> Result<Region> {
        let path = shm_path(name)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| {
                if e.kind() == std::io::ErrorKind::AlreadyExists {
                    CoreError::AlreadyExists(format!(
                        "shared-memory store {name:?} already exists at {} (attach to it, or remove it if stale)",
                        path.display()
                    ))
                } else {
                    CoreError::Io {
                        op: format!("create {}", path.display()),
                        source: e,
                    }
                }
            })?;
        let sized = file
            .set_len(bytes as u64)
            .map_err(io(format!("resize {}", path.display())));
        let mapped = sized.and_then(|_| map(&file, bytes, &path));
        match mapped {
            Ok(ptr) => Ok(Region {
                ptr,
                bytes,
                kind: Kind::Shm {
                    path,
                    owner: true,
                    unlinked: AtomicBool::new(false),
                },
            }),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    /// Maps the existing shared file `name` whole.
    pub fn attach_shm(name: &str) -> Result<Region> {
        let path = shm_path(name)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| {
                if e.kind() == std::io::ErrorKind::NotFound {
                    CoreError::NotFound(format!(
                        "no shared-memory store {name:?} ({} does not exist)",
                        path.display()
                    ))
                } else {
                    CoreError::Io {
                        op: format!("open {}", path.display()),
                        source: e,
                    }
                }
            })?;
        let bytes = file
            .metadata()
            .map_err(io(format!("stat {}", path.display())))?
            .len() as usize;
        let ptr = map(&file, bytes, &path)?;
        Ok(Region {
            ptr,
            bytes,
            kind: Kind::Shm {
                path,
                owner: false,
                unlinked: AtomicBool::new(false),
            },
        })
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The shared file's path, or None for a private block.
    pub fn path(&self) -> Option<&std::path::Path> {
        match &self.kind {
            Kind::Heap => None,
            Kind::Shm { path, .. } => Some(path),
        }
    }

    /// True for the process that created the shared file.
    pub fn is_owner(&self) -> bool {
        matches!(self.kind, Kind::Shm { owner: true, .. })
    }

    /// Removes the shared file's name if this process created it; the mapping stays valid.
    pub fn unlink(&self) -> Result<()> {
        if let Kind::Shm {
            path,
            owner: true,
            unlinked,
        } = &self.kind
        {
            if !unlinked.swap(true, Ordering::AcqRel) {
                match std::fs::remove_file(path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(io(format!("unlink {}", path.display()))(e)),
                }
            }
        }
        Ok(())
    }
}

fn map(file: &std::fs::File, bytes: usize, path: &std::path::Path) -> Result<NonNull<u8>> {
    if bytes == 0 {
        return Err(CoreError::LayoutMismatch(format!(
            "{} is empty, not a dniasync store",
            path.display()
        )));
    }
    // SAFETY: mapping a file we hold open; the result is checked before use.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(io(format!("mmap {}", path.display()))(
            std::io::Error::last_os_error(),
        ));
    }
    NonNull::new(ptr.cast()).ok_or_else(|| CoreError::InvalidArgument("mmap returned null".into()))
}

impl Drop for Region {
    fn drop(&mut self) {
        match &self.kind {
            Kind::Heap => {
                let layout = std::alloc::Layout::from_size_align(self.bytes.max(1), ALIGN)
                    .expect("layout was valid at allocation");
                // SAFETY: allocated in `heap` with this very layout.
                unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
            }
            Kind::Shm { .. } => {
                let _ = self.unlink();
                // SAFETY: unmapping exactly what `map` mapped; no borrow outlives the region.
                unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.bytes) };
            }
        }
    }
}

/// True when process `pid` no longer exists.
pub fn pid_is_dead(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return true;
    };
    if pid <= 0 {
        return true;
    }
    // SAFETY: signal 0 only checks for existence.
    let rc = unsafe { libc::kill(pid, 0) };
    rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}
