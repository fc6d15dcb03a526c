//! The VM's owner fence in the VMM (docs/safety.md): with a registry, this
//! process runs the VM's vCPUs only while it holds the VM's epoch there.
//! A fresh VM takes it at boot ([`Owner::boot`]); an incoming one takes it
//! from its source's claim at the switch (the engine calls
//! [`OwnerFence::take_over`]); the VM's start and resume refuse to run a
//! VM whose claim is not held here, and the fence's keeper pauses the vCPUs
//! the moment it finds the claim gone. The fence acts on the VM through
//! [`Guarded`], which the VM implements: the VM knows its fence, the fence
//! does not know the VM.

use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use ferry_migration::{OwnerFence, TakeBackAnswer};
use ferry_registry::ownership::{
    Claim, Fence, FenceStatus, Holder, Owners, OwnershipError, TakeBack,
};
use ferry_registry::Registry;

/// How long a destination waits for the registry at the switch: the VM is
/// paused on both sides meanwhile, and a destination that gave up while
/// its take-over may have landed would leave the VM held by nobody alive.
pub const TAKE_OVER_PATIENCE: Duration = Duration::from_secs(600);
/// How long a source whose switch failed asks the registry before it
/// leaves the answer to the fence's keeper (the VM stays paused).
pub const TAKE_BACK_PATIENCE: Duration = Duration::from_secs(30);
/// The largest claim a source may send (`ferry_migration`'s own limit is
/// 4 KiB; a claim is a VM name, an epoch and a holder).
const MAX_CLAIM: usize = 4096;

/// What the fence does to the VM it guards (`Vm` implements it).
pub trait Guarded: Send + Sync {
    /// The claim is gone: the vCPUs stop here at once.
    fn halt(&self, why: &str);
    /// The claim was taken back: the vCPUs run again.
    fn run_again(&self) -> Result<(), String>;
}

/// This VMM's side of the ownership rule for its one VM.
pub struct Owner {
    owners: Owners,
    me: Holder,
    vm: Weak<dyn Guarded>,
    /// Made at boot, or at the take-over (whose claim names the VM).
    fence: OnceLock<Arc<Fence>>,
    /// Serializes the fence's making.
    making: Mutex<()>,
}

impl Owner {
    /// The owner fence of `vm`, through `registry`, for this process on
    /// `host`.
    pub fn new<V: Guarded + 'static>(
        registry: Arc<dyn Registry>,
        host: &str,
        vm: &Arc<V>,
    ) -> Arc<Owner> {
        // Weak: the VM holds its Owner, which must not keep the VM alive.
        let vm: Weak<dyn Guarded> = Arc::downgrade(vm) as Weak<V>;
        Arc::new(Owner {
            owners: Owners::new(registry),
            me: Holder::this_process(host),
            vm,
            fence: OnceLock::new(),
            making: Mutex::new(()),
        })
    }

    /// The fence of VM `name`, made on first use with hooks that pause and
    /// resume this VMM's vCPUs.
    fn fence_for(&self, name: &str) -> Result<Arc<Fence>, OwnershipError> {
        let _m = self.making.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = self.fence.get() {
            if f.vm() != name {
                return Err(OwnershipError::BadName(format!(
                    "{name} (this VMM runs VM {})",
                    f.vm()
                )));
            }
            return Ok(f.clone());
        }
        let (stop_vm, resume_vm) = (self.vm.clone(), self.vm.clone());
        let hooks = ferry_registry::ownership::Hooks {
            stop: Box::new(move |why| {
                if let Some(vm) = stop_vm.upgrade() {
                    vm.halt(why);
                }
            }),
            resume: Box::new(move || {
                if let Some(vm) = resume_vm.upgrade() {
                    if let Err(e) = vm.run_again() {
                        tracing::error!("cannot resume the VM taken back: {e}");
                    }
                }
            }),
        };
        let f = Fence::new(self.owners.clone(), name, self.me.clone(), hooks)?;
        let _ = self.fence.set(f.clone());
        Ok(f)
    }

    /// A fresh VM named `name` starts here: takes it, or says who holds it.
    pub fn boot(&self, name: &str) -> Result<Claim, OwnershipError> {
        self.fence_for(name)?.boot()
    }

    /// Why this process may not run the VM now (None: it may).
    pub fn why_not_run(&self) -> Option<String> {
        match self.fence.get() {
            Some(f) => f.why_not_run(),
            None => Some("this VMM holds no claim on a VM yet".into()),
        }
    }

    /// What `ferry status` shows (None before the VM is named).
    pub fn status(&self) -> Option<FenceStatus> {
        self.fence.get().map(|f| f.status())
    }

    /// The VM stopped here for good: gives it up in the registry.
    pub fn release(&self) {
        if let Some(f) = self.fence.get() {
            if let Err(e) = f.release() {
                tracing::warn!(vm = f.vm(), "cannot release the VM in the registry: {e}");
            }
        }
    }

    /// The fence, once made.
    pub fn fence(&self) -> Option<&Arc<Fence>> {
        self.fence.get()
    }

    /// The registry, as `ferry_registry::open` takes it (a handover's new
    /// process opens the same one).
    pub fn registry(&self) -> String {
        self.owners.describe()
    }
}

impl OwnerFence for Owner {
    fn claim(&self) -> Option<Vec<u8>> {
        let c = self.fence.get()?.claim()?;
        serde_json::to_vec(&c).ok()
    }

    fn expect(&self, claim: &[u8]) -> Result<(), String> {
        let from = decode_claim(claim)?;
        let fence = self.fence_for(&from.vm).map_err(|e| e.to_string())?;
        fence.expect(&from).map_err(|e| {
            format!(
                "this destination may not take VM {} from epoch {} held by {}: {e}",
                from.vm, from.epoch, from.holder
            )
        })
    }

    fn take_over(&self, claim: &[u8]) -> Result<String, String> {
        let from = decode_claim(claim)?;
        let fence = self.fence_for(&from.vm).map_err(|e| e.to_string())?;
        stall_at("before");
        match fence.take_over(&from, TAKE_OVER_PATIENCE) {
            Ok(c) => {
                stall_at("taken");
                Ok(format!("VM {} at epoch {}", c.vm, c.epoch))
            }
            Err(e) => Err(format!(
                "this destination may not run VM {} (from epoch {} held by {}): {e}",
                from.vm, from.epoch, from.holder
            )),
        }
    }

    fn completing(&self) {
        if let Some(f) = self.fence.get() {
            f.completing();
        }
    }

    fn handed(&self) {
        if let Some(f) = self.fence.get() {
            f.handed();
        }
    }

    fn take_back(&self) -> TakeBackAnswer {
        let Some(f) = self.fence.get() else {
            return TakeBackAnswer::Gone("this VMM held no claim".into());
        };
        match f.take_back(TAKE_BACK_PATIENCE) {
            TakeBack::Back(c) => TakeBackAnswer::Back(format!("VM {} at epoch {}", c.vm, c.epoch)),
            TakeBack::Gone(Some(r)) => TakeBackAnswer::Gone(r.describe()),
            TakeBack::Gone(None) => {
                TakeBackAnswer::Gone("the registry has no record of the VM".into())
            }
            TakeBack::Unknown(why) => TakeBackAnswer::Unknown(why),
        }
    }

    fn holder_gone(&self) -> Option<String> {
        let r = self.fence.get()?.lapsed_holder()?;
        Some(format!(
            "{} and it has stopped renewing its claim: if it is dead, the VM's newest state \
             died with it and ferry cannot bring it back (docs/safety.md, cannot-survive 1)",
            r.describe()
        ))
    }
}

/// A source's claim, as it came (hostile until checked by the registry).
fn decode_claim(claim: &[u8]) -> Result<Claim, String> {
    if claim.len() > MAX_CLAIM {
        return Err(format!(
            "a claim of {} bytes is over the limit",
            claim.len()
        ));
    }
    serde_json::from_slice(claim).map_err(|e| format!("the source's claim does not decode: {e}"))
}

/// This host's name for the registry: $FERRY_HOST, else the system's.
pub fn host_name() -> String {
    if let Ok(h) = std::env::var("FERRY_HOST") {
        return h;
    }
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    if r == 0 && end > 0 {
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        "unknown".into()
    }
}

/// Test hook: `FERRY_OWNER_STALL=before|taken` stalls a destination (or a
/// handover's new VMM) just before, or just after, it takes the VM in the
/// registry, so a test can kill it there.
fn stall_at(step: &str) {
    if std::env::var("FERRY_OWNER_STALL").is_ok_and(|s| s == step) {
        eprintln!("ferry: FERRY_OWNER_STALL={step}: stalling the take-over here");
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}
