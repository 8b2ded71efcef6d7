//! The plain CUDA C++ kernels run on the CPU (feature `emu`, for tests): `build.rs` compiles them for the
//! host with the emulator in `emu/` (its semantics: `emu/cuda_emu.h`). A test declares a kernel's
//! `extern "C"` function as the `.cu` file defines it (pointers to device memory become pointers into
//! [`DeviceBuffer`]s) and runs it with [`launch`], as the ops' launchers would on a GPU.

use std::ffi::{c_char, c_void, CStr};
use std::marker::PhantomData;

extern "C" {
    fn glm5_emu_launch(
        grid: *const u32,
        block: *const u32,
        shared_bytes: usize,
        thunk: extern "C" fn(*mut c_void),
        context: *mut c_void,
        error: *mut c_char,
        error_bytes: usize,
    ) -> i32;
    fn glm5_emu_alloc(bytes: usize, poison: u8) -> *mut c_void;
    fn glm5_emu_free(start: *mut c_void, bytes: usize);
}

/// A launch's shape: grid and block dimensions and dynamic shared memory bytes, as CUDA's.
#[derive(Debug, Clone, Copy)]
pub struct LaunchConfig {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_bytes: usize,
}

impl LaunchConfig {
    /// `grid` blocks of `threads` threads, no dynamic shared memory.
    pub fn new(grid: (u32, u32, u32), threads: u32) -> Self {
        LaunchConfig {
            grid,
            block: (threads, 1, 1),
            shared_bytes: 0,
        }
    }
}

extern "C" fn call<F: Fn()>(context: *mut c_void) {
    // SAFETY: `context` is the `&F` that `launch` passed and keeps alive for the whole launch.
    let kernel = unsafe { &*(context as *const F) };
    kernel();
}

/// Runs `kernel` (a closure calling one emulated kernel with its arguments) as every thread of the grid.
/// Errs when a block cannot go on: a `__syncthreads` or shuffle some of its threads never reach.
///
/// The closure must not panic (it runs on the emulator's stacks, which unwinding cannot cross).
pub fn launch<F: Fn()>(config: LaunchConfig, kernel: F) -> Result<(), String> {
    let grid = [config.grid.0, config.grid.1, config.grid.2];
    let block = [config.block.0, config.block.1, config.block.2];
    let mut error = [0 as c_char; 512];
    // SAFETY: the arrays outlive the call; `call::<F>` receives `&kernel`, which outlives it too.
    let status = unsafe {
        glm5_emu_launch(
            grid.as_ptr(),
            block.as_ptr(),
            config.shared_bytes,
            call::<F>,
            &kernel as *const F as *mut c_void,
            error.as_mut_ptr(),
            error.len(),
        )
    };
    if status == 0 {
        Ok(())
    } else {
        // SAFETY: the emulator wrote a NUL-terminated message into `error`.
        Err(unsafe { CStr::from_ptr(error.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }
}

/// "Device" memory for an emulated kernel: its last byte touches an inaccessible page, so a kernel that
/// reads or writes past the end faults (the test dies) instead of reading a neighbour. 16-byte aligned.
pub struct DeviceBuffer<T: Copy> {
    start: *mut T,
    len: usize,
    _owns: PhantomData<T>,
}

impl<T: Copy> DeviceBuffer<T> {
    fn allocate(len: usize, poison: u8) -> Self {
        let bytes = len * std::mem::size_of::<T>();
        // SAFETY: a plain allocation; null is checked.
        let start = unsafe { glm5_emu_alloc(bytes.max(1), poison) } as *mut T;
        assert!(!start.is_null(), "emulator: cannot map {bytes} bytes");
        DeviceBuffer {
            start,
            len,
            _owns: PhantomData,
        }
    }

    /// A copy of `values`.
    pub fn from_slice(values: &[T]) -> Self {
        let buffer = Self::allocate(values.len(), 0);
        // SAFETY: the buffer holds `values.len()` elements and does not overlap `values`.
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), buffer.start, values.len()) };
        buffer
    }

    /// `len` elements of every byte `poison`: what a kernel must overwrite.
    pub fn poisoned(len: usize, poison: u8) -> Self {
        Self::allocate(len, poison)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn ptr(&self) -> *const T {
        self.start
    }

    pub fn mut_ptr(&self) -> *mut T {
        self.start
    }

    pub fn to_vec(&self) -> Vec<T> {
        // SAFETY: `len` initialised elements (copied or poisoned bytes of a `Copy` type the caller chose).
        unsafe { std::slice::from_raw_parts(self.start, self.len) }.to_vec()
    }
}

impl<T: Copy> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        // SAFETY: allocated by `glm5_emu_alloc` with this size.
        unsafe {
            glm5_emu_free(
                self.start as *mut c_void,
                (self.len * std::mem::size_of::<T>()).max(1),
            )
        };
    }
}
