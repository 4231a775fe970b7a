//! forkvm as a library for FaaS schedulers.
//!
//! A [`Template`] is a `vmm run --template` process this library starts and owns: a
//! guest whose runtime waits for requests on the invoke port, paused there, with warm
//! clones ready. [`Template::invoke`] runs a request's payload through the handler in a
//! fresh clone and returns its [`Reply`]; [`Template::derive`] makes a template of a
//! clone that loaded more (packages, a handler), and a [`ZygoteCache`] keeps a tree of
//! them under a memory budget (docs/library.md). Everything is async on tokio;
//! [`blocking`] wraps it for callers without a runtime. The library has no KVM
//! dependency: it speaks the VMM's control API (`api-types`) on its Unix socket,
//! sending the calls `forkvm_client::call` defines (the same the `vmm` CLI sends).
//!
//! Dropping the last handle of a template (or a clone) stops its VMM without blocking
//! the caller: SIGTERM at once, the rest on a thread of the library's;
//! [`wait_stopped`] waits for those stops, for a process about to exit.
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
//! # let tiny = root.join("target/guest/tiny.elf");
//! # let vmm = root.join("target/debug/vmm");
//! # if !std::path::Path::new("/dev/kvm").exists() || !tiny.exists() || !vmm.exists() {
//! #     assert!(std::env::var_os("CI").is_none(), "CI needs /dev/kvm, tiny.elf and vmm");
//! #     eprintln!("SKIPPED: no /dev/kvm, target/guest/tiny.elf or target/debug/vmm");
//! #     return Ok(());
//! # }
//! use forkvm::{InvokeOptions, TemplateSpec};
//!
//! // forkvm's tiny test guest: its runtime echoes the payload (and a trailer); its
//! // loader keeps 8 bytes of a load, which "show" answers.
//! let mut spec = TemplateSpec::new(&tiny);
//! spec.vmm = vmm;
//! spec.cmdline = Some("invoke=1 load=1".into());
//! spec.mem_mib = 64;
//! spec.args = vec!["--ap-boot".into(), "direct".into()];
//! let template = forkvm::blocking::Template::start(spec)?;
//! let reply = template.invoke(&b"hello"[..], &InvokeOptions::default())?;
//! assert!(reply.body.starts_with(b"hello"));
//! println!("clone {} answered in {} us", reply.clone_id, reply.total_us);
//!
//! // A template derived from it: a clone that ran a load, a template of its own.
//! let (derived, _) = template.derive(&b"loaded!\0"[..], &InvokeOptions::default())?;
//! let shown = derived.invoke(&b"show"[..], &InvokeOptions::default())?;
//! assert_eq!(&shown.body[..], b"loaded!\0");
//! drop(derived);
//! template.shutdown()?;
//! # Ok(())
//! # }
//! ```
#![deny(missing_docs)]

mod agent;
pub mod blocking;
mod endpoint;
mod envelope;
mod error;
mod http;
mod images;
mod jail;
mod leftovers;
mod load;
mod options;
mod owner;
mod packages;
mod program;
mod spawner;
mod template;
mod vm_clone;
mod zygote;

pub use agent::{AgentControl, AgentOutput, AgentProcess, ProcessEvent, StreamMode};
pub use api_types::{CloneInfo, CloneList, CreateClones, InsertMedium};
pub use api_types::{InvokeOptions, Outcome, ResourceClass, SnapshotInfo, VmInfo};
pub use endpoint::Reply;
pub use envelope::{Envelope, EnvelopeError, EnvelopeStatus, ENVELOPE_MAGIC};
pub use error::{Error, ErrorKind, HttpError};
pub use images::{ImageCache, ImageError, ImageHold};
pub use jail::JailSpec;
pub use load::{Event, Load};
pub use options::VmmOptions;
pub use owner::wait_stopped;
pub use packages::{
    PackageCache, PackageError, PackageHold, PackageSet, PackageSource, DEFAULT_PYTHON,
    GUEST_PYTHON,
};
pub use program::{guest_file, vmm_state_id, StateIdError};
pub use template::{Ready, Template, TemplateSpec, REHEARSALS};
pub use vm_clone::{ExecOutput, VmClone};
pub use zygote::{CachePolicy, CacheStats, Packages, Tier, ZygoteCache, PACKAGE_SLOT};
