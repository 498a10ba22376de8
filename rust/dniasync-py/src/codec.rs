//! What the three codec bindings share: a codec, the state its sender carries, and the
//! conversions around encode, decode and applying a payload to a store. Each codec's own
//! file declares its class with `codec_class!` and adds only what differs.
use crate::arrays::{readonly, slice};
use crate::errors::run;
use crate::store::{ParamStore, Update};
use dniasync_core::quant::Codec;
use numpy::{Element, PyArray1};
use pyo3::prelude::*;
use std::sync::{Mutex, MutexGuard};

/// The array `encode` returns for codec `C`.
pub(crate) type Payload<'py, C> = Bound<'py, PyArray1<<C as Codec>::Code>>;

/// A codec with its sender state, behind the methods every codec class exports.
pub(crate) struct CodecBinding<C: Codec> {
    codec: C,
    encoder: Mutex<C::Encoder>,
    /// Name of the payload argument, for error messages ("codes", "payload").
    payload: &'static str,
}

impl<C: Codec> CodecBinding<C>
where
    C::Code: Element,
{
    pub(crate) fn new(codec: C, payload: &'static str) -> Self {
        CodecBinding {
            encoder: Mutex::new(codec.encoder()),
            codec,
            payload,
        }
    }

    pub(crate) fn codec(&self) -> &C {
        &self.codec
    }

    pub(crate) fn encoder(&self) -> MutexGuard<'_, C::Encoder> {
        // A panic mid-encode cannot leave the carried state half-typed: f32 writes are whole.
        self.encoder.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Copy of what the sender carries into the next encode.
    pub(crate) fn carried<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f32>> {
        PyArray1::from_slice(py, self.codec.carried(&self.encoder()))
    }

    pub(crate) fn reset(&self) {
        self.codec.reset(&mut self.encoder());
    }

    pub(crate) fn encode<'py>(
        &self,
        py: Python<'py>,
        grad: &Bound<'py, PyAny>,
    ) -> PyResult<Payload<'py, C>> {
        let grad = readonly::<f32>(grad, "grad")?;
        let grad = slice(&grad);
        let payload = run(py, grad.len(), || {
            let mut out = Vec::new();
            self.codec.encode(&mut self.encoder(), grad, &mut out)?;
            Ok(out)
        })?;
        Ok(PyArray1::from_vec(py, payload))
    }

    pub(crate) fn decode<'py>(
        &self,
        py: Python<'py>,
        payload: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let payload = readonly::<C::Code>(payload, self.payload)?;
        let payload = slice(&payload);
        let n = self.codec.n();
        let out = run(py, n, || {
            let mut out = vec![0f32; n];
            self.codec.decode(payload, &mut out)?;
            Ok(out)
        })?;
        Ok(PyArray1::from_vec(py, out))
    }

    /// Applies the payload to `segment` of `store`, decoded chunk by chunk; returns the
    /// segment's new version.
    pub(crate) fn update(
        &self,
        py: Python<'_>,
        store: &Bound<'_, ParamStore>,
        segment: &str,
        payload: &Bound<'_, PyAny>,
        update: Update,
    ) -> PyResult<u64> {
        let payload = readonly::<C::Code>(payload, self.payload)?;
        let payload = slice(&payload);
        // A step may visit every element (optimizer state moves where the gradient is zero);
        // an add visits only what the payload codes.
        let work = match update {
            Update::Step(_) => self.codec.n(),
            Update::Add(_) | Update::AddExact(_) => self.codec.touched(payload),
        };
        store
            .get()
            .update(py, segment, work, update, || self.codec.grad(payload))
    }
}

/// Declares the frozen class `$name` over `CodecBinding<$core>` with what every codec
/// exports: a constructor calling `$core::new` with the arguments of `new(...)`, getters
/// forwarding to the core codec, `n`, `encode`, `decode`, `apply` and `add_to` (its payload
/// argument named `$payload`), for a codec with carried state a copy of it under the name
/// `$carried` and `reset`; then the codec's own methods.
macro_rules! codec_class {
    (
        $(#[$class_doc:meta])*
        $name:ident($core:ty) {
            new($($arg:ident: $arg_ty:ty $(= $default:tt)?),*),
            get { $($getter:ident: $getter_ty:ty),* },
            payload: $payload:ident,
            $(carried: $carried:ident,)?
            encode: $encode_doc:literal $(,)?
        }
        $($own:tt)*
    ) => {
        $(#[$class_doc])*
        #[pyclass(frozen, module = "dniasync._core")]
        pub struct $name($crate::codec::CodecBinding<$core>);

        #[pymethods]
        impl $name {
            #[new]
            #[pyo3(signature = ($($arg $(= $default)?),*))]
            fn new($($arg: $arg_ty),*) -> PyResult<Self> {
                let codec = <$core>::new($($arg),*).map_err($crate::errors::to_py)?;
                let binding = $crate::codec::CodecBinding::new(codec, stringify!($payload));
                Ok($name(binding))
            }

            #[getter]
            fn n(&self) -> usize {
                dniasync_core::quant::Codec::n(self.0.codec())
            }

            $(
                #[getter]
                fn $getter(&self) -> $getter_ty {
                    self.0.codec().$getter()
                }
            )*

            #[doc = $encode_doc]
            fn encode<'py>(
                &self,
                py: Python<'py>,
                grad: &Bound<'py, PyAny>,
            ) -> PyResult<$crate::codec::Payload<'py, $core>> {
                self.0.encode(py, grad)
            }

            #[doc = concat!("Dense float32 gradient decoded from `", stringify!($payload), "`.")]
            fn decode<'py>(
                &self,
                py: Python<'py>,
                $payload: &Bound<'py, PyAny>,
            ) -> PyResult<Bound<'py, numpy::PyArray1<f32>>> {
                self.0.decode(py, $payload)
            }

            /// One optimizer step of `store` with the decoded gradient, decoded chunk by chunk.
            fn apply(
                &self,
                py: Python<'_>,
                store: &Bound<'_, $crate::store::ParamStore>,
                segment: &str,
                $payload: &Bound<'_, PyAny>,
                lr: f32,
            ) -> PyResult<u64> {
                let update = $crate::store::Update::Step(lr);
                self.0.update(py, store, segment, $payload, update)
            }

            /// `w += alpha * decoded` on `store` (no optimizer), decoded chunk by chunk.
            #[pyo3(signature = (store, segment, $payload, alpha = 1.0))]
            fn add_to(
                &self,
                py: Python<'_>,
                store: &Bound<'_, $crate::store::ParamStore>,
                segment: &str,
                $payload: &Bound<'_, PyAny>,
                alpha: f32,
            ) -> PyResult<u64> {
                let update = $crate::store::Update::Add(alpha);
                self.0.update(py, store, segment, $payload, update)
            }

            $(
                #[doc = concat!("Copy of the ", stringify!($carried), " carried to the next encode.")]
                fn $carried<'py>(&self, py: Python<'py>) -> Bound<'py, numpy::PyArray1<f32>> {
                    self.0.carried(py)
                }

                fn reset(&self) {
                    self.0.reset();
                }
            )?

            $($own)*
        }
    };
}
pub(crate) use codec_class;
