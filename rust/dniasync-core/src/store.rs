//! `ParamStore`: a flat f32 buffer of atomic cells shared by threads (and, through
//! /dev/shm, by processes), cut into named segments each with its own version.
//!
//! Updates follow Hogwild: concurrent updates of the same element may overwrite each
//! other (every access is a relaxed atomic, so there is no undefined behaviour), except
//! on the exact-add path, which uses compare-and-swap and loses nothing.
use crate::error::{check_len, invalid, CoreError, Result};
use crate::grad::{Dense, GradSource};
use crate::layout::{Layout, Optimizer, OptimizerConfig, SegmentSpec, MAX_SEGMENT_NAME};
use crate::optim;
use crate::shm::{self, Region};
use crate::simd::{self, CHUNK};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

/// First bytes of every shared store file.
pub const MAGIC: [u8; 8] = *b"DNIASYNC";
/// Bumped whenever the shared-memory layout changes.
pub const LAYOUT_VERSION: u32 = 1;

const HEADER_BYTES: usize = 128;
const ENTRY_BYTES: usize = 64;
const COUNTER_BYTES: usize = 16;

#[repr(C)]
struct Header {
    magic: [u8; 8],
    layout_version: u32,
    owner_pid: u32,
    ready: AtomicU32,
    n_segments: u32,
    optimizer: u32,
    hyper: [f32; 3],
    weight_decay: f32,
    clip_norm: f32,
    n_params: u64,
    data_offset: u64,
    total_bytes: u64,
    rejected_nonfinite: AtomicU64,
}

#[repr(C)]
struct Entry {
    name: [u8; MAX_SEGMENT_NAME + 1],
    offset: u64,
    len: u64,
}

#[repr(C)]
struct Counters {
    version: AtomicU64,
    steps: AtomicU64,
}

const _: () = assert!(std::mem::size_of::<Header>() <= HEADER_BYTES);
const _: () = assert!(std::mem::size_of::<Entry>() == ENTRY_BYTES);
const _: () = assert!(std::mem::size_of::<Counters>() == COUNTER_BYTES);

fn data_offset(n_segments: usize) -> usize {
    (HEADER_BYTES + n_segments * (ENTRY_BYTES + COUNTER_BYTES)).next_multiple_of(64)
}

fn total_bytes(layout: &Layout) -> usize {
    let floats = layout.n_params() * (1 + layout.config.optimizer.state_slots());
    data_offset(layout.segments.len()) + 4 * floats
}

/// What to do with a gradient that contains NaN or Inf.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NonFinitePolicy {
    /// Refuse the whole update, count it, and return `CoreError::NonFinite` (the default).
    Reject,
    /// Apply it as is (no scan: the caller vouches for its gradients).
    Allow,
}

/// A segment's name and place in the flat parameter buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    pub name: String,
    pub offset: usize,
    pub len: usize,
}

/// The parameter store. Cheap to share between threads by reference (`&self` everywhere).
pub struct ParamStore {
    region: Region,
    layout: Layout,
    segments: Vec<Segment>,
    index: HashMap<String, usize>,
    n_params: usize,
    data_offset: usize,
    allow_nonfinite: AtomicBool,
    /// Numbers passes so that concurrent ones start at different chunks.
    tickets: AtomicU64,
}

impl ParamStore {
    /// A private, zero-initialised store.
    pub fn new(layout: Layout) -> Result<ParamStore> {
        layout.validate()?;
        let region = Region::heap(total_bytes(&layout))?;
        Self::init(region, layout)
    }

    /// A zero-initialised store in the shared file `/dev/shm/dniasync-<name>`, which this
    /// process owns: dropping or closing the store removes the name.
    pub fn create_shared(name: &str, layout: Layout) -> Result<ParamStore> {
        layout.validate()?;
        let region = Region::create_shm(name, total_bytes(&layout))?;
        Self::init(region, layout)
    }

    /// Maps the shared store `name` created by another process. With `expected`, fails with
    /// `LayoutMismatch` unless the store has exactly that layout.
    pub fn attach(name: &str, expected: Option<&Layout>) -> Result<ParamStore> {
        Self::attach_expecting(
            name,
            expected.map(|l| l.segments.as_slice()),
            expected.map(|l| &l.config),
        )
    }

    /// As `attach`, checking the segments and the optimizer configuration separately,
    /// each only when given.
    pub fn attach_expecting(
        name: &str,
        segments: Option<&[SegmentSpec]>,
        config: Option<&OptimizerConfig>,
    ) -> Result<ParamStore> {
        let region = Region::attach_shm(name)?;
        let layout = read_layout(&region, name)?;
        let seg_ok = segments.is_none_or(|s| s == layout.segments.as_slice());
        let cfg_ok = config.is_none_or(|c| *c == layout.config);
        if !(seg_ok && cfg_ok) {
            let want = Layout {
                segments: segments.map_or_else(|| layout.segments.clone(), <[_]>::to_vec),
                config: config.copied().unwrap_or(layout.config),
            };
            return Err(CoreError::LayoutMismatch(format!(
                "store {name:?} has {} but {} was expected",
                describe(&layout),
                describe(&want)
            )));
        }
        Ok(Self::index(region, layout))
    }

    /// True when the shared store `name` exists and the process that created it is gone.
    pub fn is_stale(name: &str) -> Result<bool> {
        let region = Region::attach_shm(name)?;
        if region.len() < HEADER_BYTES {
            return Ok(true);
        }
        // SAFETY: the region is at least a header long and page aligned.
        let header = unsafe { &*(region.as_ptr() as *const Header) };
        Ok(header.magic != MAGIC || shm::pid_is_dead(header.owner_pid))
    }

    /// Removes the shared store `name` if it is stale; returns whether it did.
    pub fn remove_stale(name: &str) -> Result<bool> {
        if !Self::is_stale(name)? {
            return Ok(false);
        }
        let path = shm::shm_path(name)?;
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(source) => Err(CoreError::Io {
                op: format!("remove {}", path.display()),
                source,
            }),
        }
    }

    fn init(region: Region, layout: Layout) -> Result<ParamStore> {
        let n_seg = layout.segments.len();
        let (code, hyper) = layout.config.optimizer.encode();
        let base = region.as_ptr();
        // SAFETY: the region is zeroed, page aligned and large enough for header and table;
        // nobody else reads it before `ready` is released below.
        unsafe {
            let h = base as *mut Header;
            (*h).magic = MAGIC;
            (*h).layout_version = LAYOUT_VERSION;
            (*h).owner_pid = std::process::id();
            (*h).n_segments = n_seg as u32;
            (*h).optimizer = code;
            (*h).hyper = hyper;
            (*h).weight_decay = layout.config.weight_decay;
            (*h).clip_norm = layout.config.clip_norm.unwrap_or(0.0);
            (*h).n_params = layout.n_params() as u64;
            (*h).data_offset = data_offset(n_seg) as u64;
            (*h).total_bytes = region.len() as u64;
            let mut offset = 0u64;
            for (i, s) in layout.segments.iter().enumerate() {
                let e = base.add(HEADER_BYTES + i * ENTRY_BYTES) as *mut Entry;
                let name = &mut (*e).name;
                name[..s.name.len()].copy_from_slice(s.name.as_bytes());
                (*e).offset = offset;
                (*e).len = s.len as u64;
                offset += s.len as u64;
            }
        }
        let store = Self::index(region, layout);
        store.header().ready.store(1, Ordering::Release);
        Ok(store)
    }

    fn index(region: Region, layout: Layout) -> ParamStore {
        let mut segments = Vec::with_capacity(layout.segments.len());
        let mut index = HashMap::new();
        let mut offset = 0;
        for (i, s) in layout.segments.iter().enumerate() {
            segments.push(Segment {
                name: s.name.clone(),
                offset,
                len: s.len,
            });
            index.insert(s.name.clone(), i);
            offset += s.len;
        }
        ParamStore {
            data_offset: data_offset(segments.len()),
            region,
            n_params: offset,
            segments,
            index,
            layout,
            allow_nonfinite: AtomicBool::new(false),
            tickets: AtomicU64::new(u64::from(std::process::id())),
        }
    }

    fn header(&self) -> &Header {
        // SAFETY: the region starts with an initialised header for the store's lifetime.
        unsafe { &*(self.region.as_ptr() as *const Header) }
    }

    fn counters(&self, seg: usize) -> &Counters {
        let off = HEADER_BYTES + self.segments.len() * ENTRY_BYTES + seg * COUNTER_BYTES;
        // SAFETY: `seg` indexes a segment; the counters table lies inside the region, 8-aligned.
        unsafe { &*(self.region.as_ptr().add(off) as *const Counters) }
    }

    /// All cells: parameters, then each optimizer state slot, each `n_params` long.
    fn data(&self) -> &[AtomicU32] {
        let floats = self.n_params * (1 + self.layout.config.optimizer.state_slots());
        // SAFETY: the data region was sized for exactly these cells and is 64-byte aligned.
        unsafe {
            std::slice::from_raw_parts(
                self.region.as_ptr().add(self.data_offset) as *const AtomicU32,
                floats,
            )
        }
    }

    /// The layout (segments and optimizer) this store was built with.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn config(&self) -> &OptimizerConfig {
        &self.layout.config
    }

    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Total number of parameters.
    pub fn n_params(&self) -> usize {
        self.n_params
    }

    /// Index of the segment called `name`.
    pub fn segment_index(&self, name: &str) -> Result<usize> {
        self.index
            .get(name)
            .copied()
            .ok_or_else(|| CoreError::UnknownSegment(name.to_owned()))
    }

    fn segment(&self, seg: usize) -> Result<&Segment> {
        self.segments
            .get(seg)
            .ok_or_else(|| CoreError::UnknownSegment(format!("#{seg}")))
    }

    /// Cells of segment `seg`, slot 0 for the parameters, 1.. for optimizer state.
    pub fn cells(&self, seg: usize, slot: usize) -> Result<&[AtomicU32]> {
        let s = self.segment(seg)?;
        let slots = self.layout.config.optimizer.state_slots();
        if slot > slots {
            return Err(invalid(format!(
                "state slot {slot} out of range: optimizer {} keeps {slots} state slot(s)",
                self.layout.config.optimizer.name()
            )));
        }
        let start = slot * self.n_params + s.offset;
        Ok(&self.data()[start..start + s.len])
    }

    /// Every parameter cell, in segment order.
    pub fn param_cells(&self) -> &[AtomicU32] {
        &self.data()[..self.n_params]
    }

    /// Raw pointer to slot `slot` of the whole store (`n_params` floats), for zero-copy views.
    pub fn slot_ptr(&self, slot: usize) -> Result<*mut f32> {
        self.cells(0, slot)?;
        Ok(self.data()[slot * self.n_params..]
            .as_ptr()
            .cast_mut()
            .cast::<f32>())
    }

    /// Current version of segment `seg` (number of updates applied so far).
    pub fn version(&self, seg: usize) -> Result<u64> {
        self.segment(seg)?;
        Ok(self.counters(seg).version.load(Ordering::Acquire))
    }

    /// Number of optimizer steps applied to segment `seg` (Adam's bias-correction count).
    pub fn steps(&self, seg: usize) -> Result<u64> {
        self.segment(seg)?;
        Ok(self.counters(seg).steps.load(Ordering::Acquire))
    }

    /// Sets segment `seg`'s optimizer step count to `steps`: a store that takes over the
    /// parameters and optimizer state of another (a restart from a snapshot, a joining chain
    /// copy) continues its count, so Adam's bias correction is the one the state was built with.
    pub fn set_steps(&self, seg: usize, steps: u64) -> Result<()> {
        self.segment(seg)?;
        self.counters(seg).steps.store(steps, Ordering::Release);
        Ok(())
    }

    fn ticket(&self) -> u64 {
        self.tickets.fetch_add(1, Ordering::Relaxed)
    }

    fn bump(&self, seg: usize) -> u64 {
        // Release: whoever acquires this version also sees the cells written before it.
        self.counters(seg).version.fetch_add(1, Ordering::Release) + 1
    }

    /// Copies slot `slot` of segment `seg` into `out`; returns the version read, meaning
    /// every update up to that version is in the copy (later, concurrent ones may be in part).
    pub fn read_into(&self, seg: usize, slot: usize, out: &mut [f32]) -> Result<u64> {
        let cells = self.cells(seg, slot)?;
        check_len("output buffer", cells.len(), out.len())?;
        let version = self.counters(seg).version.load(Ordering::Acquire);
        simd::load_cells(cells, out);
        Ok(version)
    }

    /// Overwrites slot `slot` of segment `seg` with `values`; returns the new version.
    pub fn write(&self, seg: usize, slot: usize, values: &[f32]) -> Result<u64> {
        let cells = self.cells(seg, slot)?;
        check_len("values", cells.len(), values.len())?;
        simd::store_cells(cells, values);
        Ok(self.bump(seg))
    }

    /// Whether gradients with NaN/Inf are rejected (default) or applied.
    pub fn nonfinite_policy(&self) -> NonFinitePolicy {
        if self.allow_nonfinite.load(Ordering::Relaxed) {
            NonFinitePolicy::Allow
        } else {
            NonFinitePolicy::Reject
        }
    }

    /// Sets this handle's policy for gradients with NaN/Inf.
    pub fn set_nonfinite_policy(&self, policy: NonFinitePolicy) {
        self.allow_nonfinite
            .store(policy == NonFinitePolicy::Allow, Ordering::Relaxed);
    }

    /// Number of updates rejected for NaN/Inf, over every process sharing the store.
    pub fn rejected_nonfinite(&self) -> u64 {
        self.header().rejected_nonfinite.load(Ordering::Relaxed)
    }

    /// Path of the backing shared file, if any.
    pub fn shm_path(&self) -> Option<&std::path::Path> {
        self.region.path()
    }

    /// True for the process that created the shared store.
    pub fn is_owner(&self) -> bool {
        self.region.is_owner()
    }

    /// Removes the shared name now if this process owns it; the memory stays mapped
    /// until the store is dropped, so outstanding views remain valid.
    pub fn close(&self) -> Result<()> {
        self.region.unlink()
    }

    /// Finds non-finite input (per policy) and the clipping scale, before touching the store.
    fn prescan(&self, src: &dyn GradSource, clip: Option<f32>) -> Result<f32> {
        let reject = self.nonfinite_policy() == NonFinitePolicy::Reject;
        let (finite, scale) = match clip {
            Some(max_norm) => {
                let norm = src.norm_sq().sqrt();
                let scale = if norm.is_finite() && norm > f64::from(max_norm) {
                    (f64::from(max_norm) / (norm + 1e-6)) as f32
                } else {
                    1.0
                };
                (norm.is_finite(), scale)
            }
            None => (!reject || src.all_finite(), 1.0),
        };
        if reject && !finite {
            self.header()
                .rejected_nonfinite
                .fetch_add(1, Ordering::Relaxed);
            return Err(CoreError::NonFinite { what: "gradient" });
        }
        Ok(scale)
    }

    /// One optimizer step on segment `seg` with gradient `src` and learning rate `lr`, in a
    /// single pass over the parameters and their state. Returns the new version.
    pub fn step(&self, seg: usize, src: &mut dyn GradSource, lr: f32) -> Result<u64> {
        self.step_to(seg, src, lr, None)
    }

    /// `step`, but the parameters stay as they are: `out` (the segment's length) receives the
    /// change the step would make to each (its new value, rounded as `step` rounds it, minus
    /// the old), and the optimizer state advances as `step` advances it. For a caller that
    /// applies the change elsewhere, or in part (p2p's peers code it and apply what they sent).
    /// Returns the version, unchanged: no parameter was written.
    pub fn step_into(
        &self,
        seg: usize,
        src: &mut dyn GradSource,
        lr: f32,
        out: &mut [f32],
    ) -> Result<u64> {
        check_len("change buffer", self.segment(seg)?.len, out.len())?;
        self.step_to(seg, src, lr, Some(out))
    }

    fn step_to(
        &self,
        seg: usize,
        src: &mut dyn GradSource,
        lr: f32,
        out: Option<&mut [f32]>,
    ) -> Result<u64> {
        let s = self.segment(seg)?;
        check_len("gradient", s.len, src.len())?;
        if !(lr >= 0.0 && lr.is_finite()) {
            return Err(invalid(format!("lr must be >= 0 and finite, got {lr}")));
        }
        let cfg = self.layout.config;
        let gscale = self.prescan(src, cfg.clip_norm)?;
        let t = self.counters(seg).steps.fetch_add(1, Ordering::AcqRel) + 1;
        let mut hp = optim::Hyper::new(&cfg, lr, gscale, t);
        hp.first_chunk = optim::first_chunk(self.ticket(), s.len);
        let w = self.cells(seg, 0)?;
        let into = out.is_some();
        if let Some((codes, tau)) = src.sparse().filter(|_| !into) {
            if optim::sparse_ok(&cfg) {
                let s1 = if cfg.optimizer.state_slots() > 0 {
                    Some(self.cells(seg, 1)?)
                } else {
                    None
                };
                optim::sparse_step(&hp, w, s1, codes, tau);
                return Ok(self.bump(seg));
            }
        }
        match cfg.optimizer {
            Optimizer::Sgd => optim::sgd(w, src, &hp, out),
            Optimizer::Momentum { .. } => optim::momentum(w, self.cells(seg, 1)?, src, &hp, out),
            Optimizer::Nesterov { .. } => optim::nesterov(w, self.cells(seg, 1)?, src, &hp, out),
            Optimizer::Adagrad { .. } => optim::adagrad(w, self.cells(seg, 1)?, src, &hp, out),
            Optimizer::Adam { .. } => {
                optim::adam(w, self.cells(seg, 1)?, self.cells(seg, 2)?, src, &hp, out)
            }
        }
        if into {
            return Ok(self.counters(seg).version.load(Ordering::Acquire));
        }
        Ok(self.bump(seg))
    }

    /// Convenience: `step` with a dense gradient.
    pub fn step_dense(&self, seg: usize, grad: &[f32], lr: f32) -> Result<u64> {
        self.step(seg, &mut Dense(grad), lr)
    }

    /// One optimizer step whose gradient is `values` over `spans` and zero elsewhere: `spans`
    /// holds `(start, length)` pairs, flattened, ascending, disjoint and inside the segment;
    /// `values` the elements they cover, one span after the other (an embedding table's
    /// touched rows). Where a zero gradient leaves an element and its state as they are (SGD,
    /// Adagrad, no weight decay: `optim::sparse_ok`) only the spans are read and written, so
    /// concurrent Hogwild steps to other rows are not overwritten; otherwise the step is the
    /// dense one over the scattered gradient. Either way the result is the dense step's.
    pub fn step_spans(&self, seg: usize, spans: &[u32], values: &[f32], lr: f32) -> Result<u64> {
        let s = self.segment(seg)?;
        let covered = check_spans(spans, s.len)?;
        check_len("span values", covered, values.len())?;
        let cfg = self.layout.config;
        if !optim::sparse_ok(&cfg) {
            let mut grad = vec![0.0f32; s.len];
            let mut off = 0;
            for pair in spans.chunks_exact(2) {
                let (start, n) = (pair[0] as usize, pair[1] as usize);
                grad[start..start + n].copy_from_slice(&values[off..off + n]);
                off += n;
            }
            return self.step_dense(seg, &grad, lr);
        }
        if !(lr >= 0.0 && lr.is_finite()) {
            return Err(invalid(format!("lr must be >= 0 and finite, got {lr}")));
        }
        let gscale = self.prescan(&Dense(values), cfg.clip_norm)?;
        let t = self.counters(seg).steps.fetch_add(1, Ordering::AcqRel) + 1;
        let hp = optim::Hyper::new(&cfg, lr, gscale, t);
        let w = self.cells(seg, 0)?;
        let acc = if cfg.optimizer.state_slots() > 0 {
            Some(self.cells(seg, 1)?)
        } else {
            None
        };
        let mut off = 0;
        for pair in spans.chunks_exact(2) {
            let (start, n) = (pair[0] as usize, pair[1] as usize);
            let g = &mut Dense(&values[off..off + n]);
            match acc {
                Some(acc) => {
                    optim::adagrad(&w[start..start + n], &acc[start..start + n], g, &hp, None)
                }
                None => optim::sgd(&w[start..start + n], g, &hp, None),
            }
            off += n;
        }
        Ok(self.bump(seg))
    }

    /// Hogwild add `w += alpha * delta` (no optimizer); concurrent adds to the same
    /// element may lose one another. Returns the new version.
    pub fn add(&self, seg: usize, src: &mut dyn GradSource, alpha: f32) -> Result<u64> {
        let w = self.cells(seg, 0)?;
        check_len("delta", w.len(), src.len())?;
        if !alpha.is_finite() {
            return Err(invalid(format!("alpha must be finite, got {alpha}")));
        }
        self.prescan(src, None)?;
        match src.sparse() {
            Some((codes, tau)) => optim::sparse_add(w, codes, alpha * tau),
            None => optim::axpy(w, src, alpha, optim::first_chunk(self.ticket(), w.len())),
        }
        Ok(self.bump(seg))
    }

    /// Exact add `w += alpha * delta` by compare-and-swap: concurrent exact adds all land.
    pub fn add_exact(&self, seg: usize, src: &mut dyn GradSource, alpha: f32) -> Result<u64> {
        let w = self.cells(seg, 0)?;
        check_len("delta", w.len(), src.len())?;
        if !alpha.is_finite() {
            return Err(invalid(format!("alpha must be finite, got {alpha}")));
        }
        self.prescan(src, None)?;
        let mut buf = [0f32; CHUNK];
        for start in (0..w.len()).step_by(CHUNK) {
            let end = (start + CHUNK).min(w.len());
            let d = src.chunk(start, &mut buf[..end - start]);
            for (cell, &x) in w[start..end].iter().zip(d) {
                if x == 0.0 {
                    continue;
                }
                let _ = cell.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                    Some((f32::from_bits(bits) + alpha * x).to_bits())
                });
            }
        }
        Ok(self.bump(seg))
    }
}

fn read_layout(region: &Region, name: &str) -> Result<Layout> {
    let mismatch = |msg: String| CoreError::LayoutMismatch(format!("store {name:?}: {msg}"));
    if region.len() < HEADER_BYTES {
        return Err(mismatch(format!(
            "file is {} bytes, shorter than a header",
            region.len()
        )));
    }
    // SAFETY: at least a header long, page aligned.
    let h = unsafe { &*(region.as_ptr() as *const Header) };
    // The creator may still be writing the header (the file starts zeroed): give it a moment.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while h.ready.load(Ordering::Acquire) == 0 {
        // SAFETY: a plain read of bytes another process may be writing; volatile keeps it fresh.
        let magic = unsafe { std::ptr::read_volatile(&h.magic) };
        if magic != MAGIC && magic != [0; 8] {
            break;
        }
        if std::time::Instant::now() > deadline {
            return Err(mismatch(
                "header never became ready (creator died during setup? see is_stale)".into(),
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    if h.magic != MAGIC {
        return Err(mismatch("bad magic, not a dniasync store".into()));
    }
    if h.layout_version != LAYOUT_VERSION {
        return Err(mismatch(format!(
            "layout version {} (this build reads {LAYOUT_VERSION})",
            h.layout_version
        )));
    }
    let n_seg = h.n_segments as usize;
    if data_offset(n_seg) > region.len() {
        return Err(mismatch(format!("{n_seg} segments do not fit the file")));
    }
    let optimizer = Optimizer::decode(h.optimizer, h.hyper)
        .ok_or_else(|| mismatch(format!("unknown optimizer code {}", h.optimizer)))?;
    let mut segments = Vec::with_capacity(n_seg);
    for i in 0..n_seg {
        // SAFETY: the table lies inside the region (checked above).
        let e = unsafe { &*(region.as_ptr().add(HEADER_BYTES + i * ENTRY_BYTES) as *const Entry) };
        let end = e.name.iter().position(|&b| b == 0).unwrap_or(e.name.len());
        let seg_name = std::str::from_utf8(&e.name[..end])
            .map_err(|_| mismatch(format!("segment {i} name is not UTF-8")))?;
        segments.push(SegmentSpec::new(seg_name, e.len as usize));
    }
    let layout = Layout {
        segments,
        config: OptimizerConfig {
            optimizer,
            weight_decay: h.weight_decay,
            clip_norm: (h.clip_norm > 0.0).then_some(h.clip_norm),
        },
    };
    if layout.n_params() as u64 != h.n_params
        || total_bytes(&layout) != region.len()
        || h.total_bytes as usize != region.len()
    {
        return Err(mismatch(format!(
            "sizes disagree: header says {} params in {} bytes, file is {} bytes",
            h.n_params,
            h.total_bytes,
            region.len()
        )));
    }
    Ok(layout)
}

fn describe(layout: &Layout) -> String {
    let segs: Vec<String> = layout
        .segments
        .iter()
        .map(|s| format!("{}[{}]", s.name, s.len))
        .collect();
    format!("segments {} with {:?}", segs.join(", "), layout.config)
}

/// The number of elements `spans` covers: `(start, length)` pairs, flattened, each non-empty,
/// ascending, disjoint and inside `len` elements; InvalidArgument otherwise.
fn check_spans(spans: &[u32], len: usize) -> Result<usize> {
    if !spans.len().is_multiple_of(2) {
        return Err(invalid(format!(
            "spans must be (start, length) pairs, got {} numbers",
            spans.len()
        )));
    }
    let (mut end, mut covered) = (0usize, 0usize);
    for pair in spans.chunks_exact(2) {
        let (start, n) = (pair[0] as usize, pair[1] as usize);
        if n == 0 || start < end || start + n > len {
            return Err(invalid(format!(
                "spans must be non-empty, ascending, disjoint and within the segment's {len} \
                 elements, got ({start}, {n}) after one ending at {end}"
            )));
        }
        end = start + n;
        covered += n;
    }
    Ok(covered)
}
