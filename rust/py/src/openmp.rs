//! torch's OpenMP team lent to the CPU kernels as a `ForkJoin`: `GOMP_parallel` of the libgomp
//! torch loaded, looked up among the libraries already in the process (never loaded here). The
//! team's threads spin between torch ops, so they take a kernel's parts at once; a pool of our
//! own would compete with them for the same cores. Where no libgomp is loaded (torch built with
//! another OpenMP, or not imported), `on_team` runs kernels on the calling thread.

use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use pyserve_cpu_kernels::{ForkJoin, OnCallingThread};

/// `void GOMP_parallel(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags)`:
/// runs fn(data) on every thread of the calling thread's team and returns when all have.
type GompParallel = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, u32, u32);

struct OpenMpTeam {
    parallel: GompParallel,
    threads: usize,
}

/// Runs `kernel` on the calling thread's OpenMP team of `threads` threads (itself included), or
/// on the calling thread alone where there is no team to borrow or one thread is asked for.
pub fn on_team<R>(threads: usize, kernel: impl FnOnce(&dyn ForkJoin) -> R) -> R {
    match team(threads) {
        Some(team) => kernel(&team),
        None => kernel(&OnCallingThread),
    }
}

fn team(threads: usize) -> Option<OpenMpTeam> {
    static FOUND: OnceLock<GompParallel> = OnceLock::new();
    if threads < 2 {
        return None;
    }
    // Only a success is kept: a lookup before torch loaded its libgomp is tried again later.
    let parallel = match FOUND.get() {
        Some(f) => *f,
        None => {
            let found = find_gomp_parallel()?;
            *FOUND.get_or_init(|| found)
        }
    };
    Some(OpenMpTeam { parallel, threads })
}

#[cfg(target_os = "linux")]
fn find_gomp_parallel() -> Option<GompParallel> {
    // SAFETY: with RTLD_NOLOAD dlopen only returns a library already loaded (torch's libgomp),
    // so nothing is loaded or initialized here; dlclose drops the reference dlopen added.
    unsafe {
        let lib = libc::dlopen(c"libgomp.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        if lib.is_null() {
            return None;
        }
        let symbol = libc::dlsym(lib, c"GOMP_parallel".as_ptr());
        libc::dlclose(lib);
        (!symbol.is_null()).then(|| std::mem::transmute::<*mut c_void, GompParallel>(symbol))
    }
}

#[cfg(not(target_os = "linux"))]
fn find_gomp_parallel() -> Option<GompParallel> {
    None
}

/// What every thread of the team sees: the parts not yet taken.
struct Work<'a> {
    next: AtomicUsize,
    parts: usize,
    task: &'a (dyn Fn(usize) + Sync),
}

/// Each thread takes parts until none is left. A panic here would abort the process (it cannot
/// unwind through libgomp); the kernels check their inputs before they fork.
extern "C" fn take_parts(data: *mut c_void) {
    // SAFETY: `data` is the Work that `run` keeps alive until GOMP_parallel returns.
    let work = unsafe { &*(data as *const Work<'_>) };
    loop {
        let part = work.next.fetch_add(1, Ordering::Relaxed);
        if part >= work.parts {
            return;
        }
        (work.task)(part);
    }
}

impl ForkJoin for OpenMpTeam {
    fn run(&self, parts: usize, task: &(dyn Fn(usize) + Sync)) {
        let work = Work { next: AtomicUsize::new(0), parts, task };
        // SAFETY: GOMP_parallel calls take_parts(&work) on each thread of the team and returns
        // after all of them have returned, while `work` is alive.
        unsafe {
            (self.parallel)(take_parts, &work as *const Work<'_> as *mut c_void, self.threads as u32, 0)
        };
    }

    fn threads(&self) -> usize {
        self.threads
    }
}
