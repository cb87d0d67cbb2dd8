//! The per-device cache of kernel functions: each function of a module is looked up
//! (`cuModuleGetFunction`) once per device and reused by every later launch.
//!
//! A kernel's entry-point name is kept as static pieces ([`KernelName`]: `"bias_add_"` and `"bf16"`), so
//! a launch finds its function by comparing and hashing those pieces; the name itself is joined once,
//! when the cache is filled. The cache is generic over what it stores so its logic is tested without a
//! GPU; a [`CudaDevice`](super::CudaDevice) stores [`LoadedFunction`]s.

use crate::KernelError;
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaContext, CudaFunction};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

/// Most pieces a [`KernelName`] holds (`ln_bwd_`, `bf16`, `_`, `bf16`, `_nv`, `4`, `_`, `ln`, `_pf`, `1`).
pub(crate) const MAX_NAME_PARTS: usize = 10;

/// One piece of a kernel's entry-point name: text, or a number written in decimal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum NamePart {
    /// Text, as written.
    Text(&'static str),
    /// A number, written in decimal (`_nv4`, `_hd64`).
    Number(u64),
}

impl From<&'static str> for NamePart {
    fn from(text: &'static str) -> Self {
        NamePart::Text(text)
    }
}

impl From<u32> for NamePart {
    fn from(n: u32) -> Self {
        NamePart::Number(n as u64)
    }
}

impl From<usize> for NamePart {
    fn from(n: usize) -> Self {
        NamePart::Number(n as u64)
    }
}

/// A kernel's entry-point name as the pieces it is joined from, in order: `Copy`, compared and hashed
/// without building the string (see [`kernel_name!`](crate::launch::kernel_name)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct KernelName {
    parts: [NamePart; MAX_NAME_PARTS],
    len: usize,
}

impl KernelName {
    /// The name joined from `parts` (at most [`MAX_NAME_PARTS`], checked at compile time).
    pub(crate) fn from_parts<const N: usize>(parts: [NamePart; N]) -> Self {
        const { assert!(N <= MAX_NAME_PARTS, "a kernel name of too many parts") };
        let mut all = [NamePart::Text(""); MAX_NAME_PARTS];
        all[..N].copy_from_slice(&parts);
        KernelName { parts: all, len: N }
    }

    /// The pieces, in order.
    pub(crate) fn parts(&self) -> &[NamePart] {
        &self.parts[..self.len]
    }
}

impl From<&'static str> for KernelName {
    fn from(name: &'static str) -> Self {
        KernelName::from_parts([NamePart::Text(name)])
    }
}

/// The entry-point name, joined.
impl fmt::Display for KernelName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for part in self.parts() {
            match part {
                NamePart::Text(t) => f.write_str(t)?,
                NamePart::Number(n) => write!(f, "{n}")?,
            }
        }
        Ok(())
    }
}

/// Values loaded once per (module name, kernel name) and shared afterwards. Thread-safe: lookups of
/// loaded values take a read lock only.
pub(crate) struct FunctionCache<F> {
    entries: RwLock<HashMap<(&'static str, KernelName), Arc<F>>>,
}

impl<F> Default for FunctionCache<F> {
    fn default() -> Self {
        FunctionCache {
            entries: RwLock::new(HashMap::new()),
        }
    }
}

impl<F> FunctionCache<F> {
    /// The value of function `name` of module `module`, made by `load` (given the joined name) on first
    /// use. A failed load is not kept, so a later call tries again.
    ///
    /// `load` runs without the lock held: it may compile the module (seconds), and launches of functions
    /// already loaded must not wait for that. Two threads may therefore both load on first use; the first
    /// value stored is kept and returned to both.
    pub(crate) fn get_or_load(
        &self,
        module: &'static str,
        name: KernelName,
        load: impl FnOnce(&str) -> Result<F, KernelError>,
    ) -> Result<Arc<F>, KernelError> {
        // The map is valid after any panic elsewhere (an insert either happened or not), so a poisoned
        // lock is used as it is.
        let key = (module, name);
        if let Some(f) = self
            .entries
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
        {
            return Ok(f.clone());
        }
        let loaded = Arc::new(load(&name.to_string())?);
        let mut entries = self.entries.write().unwrap_or_else(PoisonError::into_inner);
        Ok(entries.entry(key).or_insert(loaded).clone())
    }

    /// Number of values held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

/// The dynamic shared memory a function has been allowed so far (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_
/// SIZE_BYTES`). The limit only grows, so a launch that needs less than an earlier one needs no driver call,
/// and a launch never runs under a limit lowered by another thread.
#[derive(Debug, Default)]
pub(crate) struct DynamicSmemLimit(Mutex<u32>);

impl DynamicSmemLimit {
    /// Ensures the limit is at least `bytes`, calling `set` with the new limit when it must grow. The
    /// lock is held across `set` so two threads cannot leave the smaller of two limits in place.
    pub(crate) fn raise(
        &self,
        bytes: u32,
        set: impl FnOnce(u32) -> Result<(), KernelError>,
    ) -> Result<(), KernelError> {
        let mut allowed = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if bytes > *allowed {
            set(bytes)?;
            *allowed = bytes;
        }
        Ok(())
    }
}

/// A function of a loaded module, as the device's cache holds it.
#[derive(Debug)]
pub(crate) struct LoadedFunction {
    function: CudaFunction,
    dynamic_smem: DynamicSmemLimit,
}

impl LoadedFunction {
    pub(crate) fn new(function: CudaFunction) -> Self {
        LoadedFunction {
            function,
            dynamic_smem: DynamicSmemLimit::default(),
        }
    }

    /// The cudarc function.
    pub(crate) fn function(&self) -> &CudaFunction {
        &self.function
    }

    /// Raises the function's dynamic shared-memory limit to at least `bytes` (needed above 48 KiB; the
    /// caller checked that the GPU allows that much per block).
    pub(crate) fn allow_dynamic_smem(
        &self,
        ctx: &CudaContext,
        bytes: usize,
    ) -> Result<(), KernelError> {
        let bytes = u32::try_from(bytes).map_err(|_| {
            KernelError::Internal(format!("{bytes} bytes of dynamic shared memory"))
        })?;
        self.dynamic_smem.raise(bytes, |limit| {
            ctx.bind_to_thread()?;
            self.function.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                limit as i32,
            )?;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn name(parts: &[NamePart]) -> KernelName {
        let mut all = [NamePart::Text(""); MAX_NAME_PARTS];
        all[..parts.len()].copy_from_slice(parts);
        KernelName {
            parts: all,
            len: parts.len(),
        }
    }

    #[test]
    fn names_join_their_parts() {
        let n = KernelName::from_parts([
            "ln_fwd_fp8_".into(),
            "bf16".into(),
            "_".into(),
            "e4m3".into(),
            "_nv".into(),
            NamePart::from(4u32),
        ]);
        assert_eq!(n.to_string(), "ln_fwd_fp8_bf16_e4m3_nv4");
        assert_eq!(
            KernelName::from("adam_commit_amaxes").to_string(),
            "adam_commit_amaxes"
        );
        assert_eq!(
            KernelName::from_parts(["attn_fwd_simple_hd".into(), NamePart::from(128usize)])
                .to_string(),
            "attn_fwd_simple_hd128"
        );
        // Equal pieces are equal names; the unused slots do not matter.
        assert_eq!(
            KernelName::from_parts(["a".into(), "b".into()]),
            name(&["a".into(), "b".into()])
        );
        assert_ne!(
            KernelName::from_parts(["a".into(), "b".into()]),
            KernelName::from_parts(["a".into(), "c".into()])
        );
    }

    #[test]
    fn each_function_is_loaded_once_and_shared() {
        let cache = FunctionCache::<String>::default();
        let loads = AtomicUsize::new(0);
        let load = |n: &str| {
            loads.fetch_add(1, Ordering::SeqCst);
            Ok(format!("loaded {n}"))
        };
        let k = KernelName::from_parts(["scale_".into(), "f32".into()]);
        let first = cache
            .get_or_load("fp8_kernels_elementwise", k, load)
            .unwrap();
        assert_eq!(*first, "loaded scale_f32");
        for _ in 0..3 {
            let again = cache
                .get_or_load("fp8_kernels_elementwise", k, load)
                .unwrap();
            assert!(Arc::ptr_eq(&first, &again));
        }
        assert_eq!(loads.load(Ordering::SeqCst), 1);
        // The same name in another module, and another name in the same module, are other functions.
        let other_module = cache.get_or_load("fp8_kernels_cast", k, load).unwrap();
        assert!(!Arc::ptr_eq(&first, &other_module));
        let bf16 = KernelName::from_parts(["scale_".into(), "bf16".into()]);
        assert_eq!(
            *cache
                .get_or_load("fp8_kernels_elementwise", bf16, load)
                .unwrap(),
            "loaded scale_bf16"
        );
        assert_eq!(loads.load(Ordering::SeqCst), 3);
        assert_eq!(cache.len(), 3);
    }

    #[test]
    fn a_failed_load_is_not_kept() {
        let cache = FunctionCache::<u32>::default();
        let k = KernelName::from("missing");
        let err = cache
            .get_or_load("m", k, |_| {
                Err(KernelError::Internal("no such function".into()))
            })
            .unwrap_err();
        assert!(matches!(err, KernelError::Internal(_)));
        assert_eq!(cache.len(), 0);
        assert_eq!(*cache.get_or_load("m", k, |_| Ok(7)).unwrap(), 7);
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn threads_share_one_value_per_function() {
        let cache = FunctionCache::<usize>::default();
        let loads = AtomicUsize::new(0);
        let names: Vec<KernelName> = (0..4usize)
            .map(|i| KernelName::from_parts(["k_".into(), NamePart::from(i)]))
            .collect();
        let got: Vec<Vec<Arc<usize>>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        (0..1000)
                            .map(|i| {
                                let n = names[i % names.len()];
                                cache
                                    .get_or_load("m", n, |joined| {
                                        loads.fetch_add(1, Ordering::SeqCst);
                                        Ok(joined.len() * 1000 + i % names.len())
                                    })
                                    .unwrap()
                            })
                            .collect()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(cache.len(), names.len());
        // Every thread got the one stored value of each name.
        for (i, n) in names.iter().enumerate() {
            let stored = cache.get_or_load("m", *n, |_| unreachable!()).unwrap();
            assert_eq!(*stored, 3000 + i);
            for per_thread in &got {
                for v in per_thread.iter().skip(i).step_by(names.len()) {
                    assert!(Arc::ptr_eq(v, &stored));
                }
            }
        }
        // Racing first uses may load twice, never once per launch.
        let loads = loads.load(Ordering::SeqCst);
        assert!((names.len()..=8 * names.len()).contains(&loads), "{loads}");
    }

    #[test]
    fn the_dynamic_smem_limit_only_grows() {
        let limit = DynamicSmemLimit::default();
        let mut set = Vec::new();
        let raise = |bytes: u32, set: &mut Vec<u32>| {
            limit
                .raise(bytes, |l| {
                    set.push(l);
                    Ok(())
                })
                .unwrap()
        };
        raise(100_000, &mut set);
        raise(60_000, &mut set);
        raise(100_000, &mut set);
        raise(120_000, &mut set);
        assert_eq!(set, [100_000, 120_000]);
        // A failed driver call leaves the recorded limit where it was, so the next call tries again.
        let err = limit.raise(200_000, |_| Err(KernelError::Internal("refused".into())));
        assert!(err.is_err());
        let mut again = Vec::new();
        limit
            .raise(150_000, |l| {
                again.push(l);
                Ok(())
            })
            .unwrap();
        assert_eq!(again, [150_000]);
    }
}
