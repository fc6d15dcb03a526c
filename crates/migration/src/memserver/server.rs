//! The memory server and its stores: stores shared by VM id and bound to
//! their owner's secret, one capacity for all of them. Its accept loop is
//! in `accept.rs`, what one connection does in `conn.rs`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::error::StoreError;
use super::limits::{Budget, Limits, Slots, MAX_VM_ID};
use super::store::{Capacity, VmStore};
use super::StoreOpen;

/// Figures a running server shows (its status line, the registry).
#[derive(Debug, Default)]
pub struct ServerStats {
    /// Pages received (migration and page-out).
    pub pages_in: AtomicU64,
    /// Pages sent (page-in and gather).
    pub pages_out: AtomicU64,
    /// Connections served.
    pub connections: AtomicU64,
    /// Connections refused (no slot free) or ended by a refusal.
    pub refused: AtomicU64,
    /// Accepts that failed (out of descriptors, say).
    pub accept_errors: AtomicU64,
}

/// A memory server.
pub struct MemServer {
    capacity: Arc<Capacity>,
    stores: Mutex<HashMap<String, Arc<VmStore>>>,
    /// Its figures.
    pub stats: ServerStats,
    stop: AtomicBool,
    pub(super) limits: Limits,
    pub(super) slots: Arc<Slots>,
    pub(super) refusers: Arc<Slots>,
    pub(super) budget: Arc<Budget>,
}

/// Refusals being sent at once.
pub(super) const REFUSERS: usize = 16;

impl MemServer {
    /// A server for at most `capacity_pages` pages, with the default limits.
    pub fn new(capacity_pages: u64) -> Arc<Self> {
        Self::with_limits(capacity_pages, Limits::default())
    }

    /// A server for at most `capacity_pages` pages, with `limits`.
    pub fn with_limits(capacity_pages: u64, limits: Limits) -> Arc<Self> {
        Arc::new(MemServer {
            capacity: Capacity::new(capacity_pages),
            stores: Mutex::new(HashMap::new()),
            stats: ServerStats::default(),
            stop: AtomicBool::new(false),
            slots: Slots::new(limits.max_connections),
            refusers: Slots::new(REFUSERS),
            budget: Budget::new(limits.buffer_bytes),
            limits,
        })
    }

    /// Pages it may hold in all.
    pub fn capacity_pages(&self) -> u64 {
        self.capacity.total
    }

    /// Pages free (neither held nor reserved).
    pub fn free_pages(&self) -> u64 {
        self.capacity.free()
    }

    /// Connections being served now.
    pub fn connections_now(&self) -> usize {
        self.slots.used()
    }

    /// Buffer bytes not taken by any connection now.
    pub fn buffer_room(&self) -> u64 {
        self.budget.left()
    }

    /// (VM id, pages held) per store.
    pub fn vms(&self) -> Vec<(String, u64)> {
        let s = self.stores.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<(String, u64)> = s.iter().map(|(k, st)| (k.clone(), st.held())).collect();
        v.sort();
        v
    }

    /// Makes [`MemServer::serve`] return (and idle connections end).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    pub(super) fn stopping(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// The store for a StoreOpen, made on the first open and bound to its
    /// secret. A later open must carry the same secret (checked first, so
    /// a stranger learns nothing else) and layout; a reservation takes
    /// that much of the free room.
    pub(super) fn open(&self, o: &StoreOpen) -> Result<Arc<VmStore>, StoreError> {
        let id_ok = !o.vm.is_empty()
            && o.vm.len() <= MAX_VM_ID
            && o.vm.bytes().all(|b| b.is_ascii_graphic());
        if !id_ok {
            let shown: String = o.vm.chars().take(MAX_VM_ID).collect();
            return Err(StoreError::VmId(shown));
        }
        let mut stores = self.stores.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = stores.get(&o.vm) {
            if !s.owned_by(&o.secret) {
                return Err(StoreError::NotOwner { vm: o.vm.clone() });
            }
            if s.layout() != o.regions {
                return Err(StoreError::LayoutChanged {
                    vm: o.vm.clone(),
                    held: s.layout(),
                    asked: o.regions.clone(),
                });
            }
            s.reserve(o.reserve_pages)?;
            return Ok(s.clone());
        }
        if o.reserve_pages > self.capacity.free() {
            return Err(StoreError::NoRoom {
                vm: o.vm.clone(),
                asked: o.reserve_pages,
                free: self.capacity.free(),
            });
        }
        let s = VmStore::new(&o.vm, &o.regions, self.capacity.clone(), o.secret.clone())?;
        s.reserve(o.reserve_pages)?;
        let s = Arc::new(s);
        stores.insert(o.vm.clone(), s.clone());
        Ok(s)
    }

    /// Frees a VM's store (StoreClose): its memory goes back once the last
    /// connection using it ends.
    pub(super) fn close(&self, store: &Arc<VmStore>, vm: &str) {
        let mut stores = self.stores.lock().unwrap_or_else(|e| e.into_inner());
        if stores.get(vm).is_some_and(|s| Arc::ptr_eq(s, store)) {
            stores.remove(vm);
        }
    }

    /// A connection of `store` ends. When it was the store's last, what it
    /// reserved and did not fill goes back to the free room: a reservation
    /// lives as long as a connection that may fill it (a peer that reserved
    /// all the room and left would otherwise keep it from every other VM);
    /// the pages it holds stay. A store left holding nothing is forgotten
    /// (whoever opens it again makes it anew), so empty stores cannot pile
    /// up.
    pub(super) fn release(&self, store: Arc<VmStore>, vm: &str) {
        let mut stores = self.stores.lock().unwrap_or_else(|e| e.into_inner());
        let last = stores
            .get(vm)
            .is_some_and(|s| Arc::ptr_eq(s, &store) && Arc::strong_count(s) == 2);
        if !last {
            return;
        }
        let gave = store.unreserve();
        if gave > 0 {
            tracing::info!(
                vm,
                pages = gave,
                "memory server: an unfilled reservation given back"
            );
        }
        if store.held() == 0 {
            stores.remove(vm);
        }
    }

    pub(super) fn free(&self) -> u64 {
        self.capacity.free()
    }
}
