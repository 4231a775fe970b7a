//! The same calls for callers without a tokio runtime: each blocks on a runtime of the
//! handle's own (one thread).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;

use crate::{Error, InvokeOptions, Reply, SnapshotInfo, TemplateSpec, VmInfo};

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
        Self::on_own_runtime(|| crate::Template::start(spec))
    }

    /// [`crate::Template::restore`], blocking.
    pub fn restore(dir: impl Into<PathBuf>, spec: TemplateSpec) -> Result<Self, Error> {
        let dir = dir.into();
        Self::on_own_runtime(|| crate::Template::restore(dir, spec))
    }

    /// A template `start` makes, on a runtime of its own.
    fn on_own_runtime<F>(start: impl FnOnce() -> F) -> Result<Self, Error>
    where
        F: std::future::Future<Output = Result<crate::Template, Error>>,
    {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(Error::Files)?;
        let inner = runtime.block_on(start())?;
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

    /// [`crate::Template::snapshot`], blocking.
    pub fn snapshot(&self, dir: impl AsRef<Path>) -> Result<SnapshotInfo, Error> {
        self.runtime.block_on(self.inner().snapshot(dir))
    }

    /// The template's control socket.
    pub fn socket(&self) -> &Path {
        self.inner().socket()
    }

    /// [`crate::Template::shutdown`], blocking.
    pub fn shutdown(mut self) -> Result<(), Error> {
        let inner = self.inner.take().expect("present until shutdown");
        self.runtime.block_on(inner.shutdown())
    }
}
