//! Which backend runs the migration codecs: the CPU, or CUDA where a GPU is
//! found (the CPU otherwise, saying why).

use ferry_migration::Backend;

/// The CUDA backend, or the CPU one with a note saying why not.
pub fn cuda() -> Backend {
    Backend {
        note: Some("this ferry was built without the CUDA backend; the CPU codecs ran".into()),
        ..Backend::cpu()
    }
}
