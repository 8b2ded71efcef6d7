//! `step_graph`'s refusals, on any machine: what cannot be captured or written says why in a typed error,
//! before touching a device. (Capture and replay themselves run in the model's GPU tests.)

use candle_core::{DType, Device, Tensor};
use glm5_ops::step_graph::{capture, capture_blocker, copy_between, write_from_host};
use glm5_ops::OpError;

#[test]
fn the_cpu_cannot_capture_and_says_so() {
    let why = capture_blocker(&Device::Cpu).expect("the CPU has no graphs");
    assert!(why.contains("CUDA device"), "{why}");
    let mut ran = false;
    let err = capture(&Device::Cpu, || {
        ran = true;
        Ok(())
    })
    .unwrap_err();
    assert!(!ran, "nothing runs when nothing can be captured");
    assert!(
        matches!(&err, OpError::Unsupported(m) if m.contains("CUDA device")),
        "{err}"
    );
}

#[test]
fn writes_and_copies_check_their_tensors_first() {
    let ids = Tensor::zeros(4, DType::U32, &Device::Cpu).unwrap();
    // The wrong element type, then the wrong count, then a device that cannot be written in place.
    assert!(matches!(
        write_from_host(&ids, &[1i32, 2, 3, 4]),
        Err(OpError::DTypeMismatch {
            expected: DType::I32,
            found: DType::U32,
            ..
        })
    ));
    assert!(matches!(
        write_from_host(&ids, &[1u32, 2, 3]),
        Err(OpError::Shape { .. })
    ));
    let strided = Tensor::zeros((4, 2), DType::U32, &Device::Cpu)
        .unwrap()
        .t()
        .unwrap();
    assert!(matches!(
        write_from_host(&strided, &[0u32; 8]),
        Err(OpError::Shape { .. })
    ));
    assert!(matches!(
        write_from_host(&ids, &[1u32, 2, 3, 4]),
        Err(OpError::Unsupported(m)) if m.contains("CUDA")
    ));

    let hidden = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
    let other = Tensor::zeros((2, 3), DType::BF16, &Device::Cpu).unwrap();
    assert!(matches!(
        copy_between(&hidden, &other),
        Err(OpError::DTypeMismatch { .. })
    ));
    let shorter = Tensor::zeros(5, DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(
        copy_between(&hidden, &shorter),
        Err(OpError::Shape { .. })
    ));
    assert!(matches!(
        copy_between(&hidden, &hidden.zeros_like().unwrap()),
        Err(OpError::Unsupported(m)) if m.contains("CUDA")
    ));
}
