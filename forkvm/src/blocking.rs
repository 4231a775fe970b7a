//! The same calls for callers without a tokio runtime: each blocks on a runtime of the
//! handle's own (one thread).

use std::sync::Arc;

use bytes::Bytes;

use crate::{Error, InvokeOptions, Reply, TemplateSpec, VmInfo};

/// A [`crate::Template`] with blocking calls.
#[derive(Debug)]
pub struct Template {
    // Declared first: dropped (the VMM stopped) while the runtime still exists.
    inner: Option<crate::Template>,
    runtime: Arc<tokio::runtime::Runtime>,
}

impl Template {
    /// [`crate::Template::start`], blocking.
    pub fn start(spec: TemplateSpec) -> Result<Self, Error> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(Error::Files)?;
        let inner = runtime.block_on(crate::Template::start(spec))?;
        Ok(Self {
            inner: Some(inner),
            runtime: Arc::new(runtime),
        })
    }

    fn inner(&self) -> &crate::Template {
        self.inner.as_ref().expect("present until shutdown")
    }

    /// [`crate::Template::invoke`], blocking.
    pub fn invoke(
        &self,
        payload: impl Into<Bytes>,
        options: &InvokeOptions,
    ) -> Result<Reply, Error> {
        self.runtime.block_on(self.inner().invoke(payload, options))
    }

    /// [`crate::Template::derive`], blocking.
    pub fn derive(
        &self,
        load: impl Into<Bytes>,
        options: &InvokeOptions,
    ) -> Result<(Template, Reply), Error> {
        let (inner, reply) = self.runtime.block_on(self.inner().derive(load, options))?;
        let t = Template {
            inner: Some(inner),
            runtime: self.runtime.clone(),
        };
        Ok((t, reply))
    }

    /// [`crate::Template::status`], blocking.
    pub fn status(&self) -> Result<VmInfo, Error> {
        self.runtime.block_on(self.inner().status())
    }

    /// The template's control socket.
    pub fn socket(&self) -> &std::path::Path {
        self.inner().socket()
    }

    /// [`crate::Template::shutdown`], blocking.
    pub fn shutdown(mut self) -> Result<(), Error> {
        let inner = self.inner.take().expect("present until shutdown");
        self.runtime.block_on(inner.shutdown())
    }
}
