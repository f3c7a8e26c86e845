//! The model families te-rs runs, one file per architecture, each holding
//! every fact of its family as one [`Family`] (tensor names, GGUF and
//! Hugging Face config keys, attention scale, window pattern, norms,
//! activation, RoPE convention); `crate::gguf_model` and `crate::hf` are
//! thin readers that call them. Adding a family is a file here plus its
//! line in [`FAMILIES`].

mod descriptor;

pub use descriptor::{Architecture, Family, GgufKeys, NameScheme, Shared, Specifics, TensorNames};

/// Declares each family's module and lists its [`Family`] in
/// [`FAMILIES`], in the order error messages list them.
macro_rules! families {
    ($($module:ident::$family:ident),* $(,)?) => {
        $(mod $module;)*
        /// Every family te-rs runs.
        pub static FAMILIES: &[&Family] = &[$(&$module::$family),*];
    };
}

// The registration: one entry per family file.
families!(
    llama::LLAMA,
    mistral::MISTRAL,
    qwen2::QWEN2,
    qwen3::QWEN3,
    gemma::GEMMA,
    gemma2::GEMMA2,
    gemma3::GEMMA3,
);

/// The family whose GGUF `general.architecture` is `name`.
pub fn by_gguf_name(name: &str) -> Option<Architecture> {
    FAMILIES
        .iter()
        .find(|f| f.name == name)
        .map(|f| Architecture(f))
}

/// The family that reads Hugging Face `model_type` `name`.
pub fn by_hf_model_type(name: &str) -> Option<Architecture> {
    FAMILIES
        .iter()
        .find(|f| f.hf_model_types.contains(&name))
        .map(|f| Architecture(f))
}

/// The GGUF architecture names, comma-separated (for error messages).
pub fn gguf_names() -> String {
    FAMILIES
        .iter()
        .map(|f| f.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The Hugging Face `model_type`s, comma-separated (for error messages).
pub fn hf_model_types() -> String {
    FAMILIES
        .iter()
        .flat_map(|f| f.hf_model_types.iter().copied())
        .collect::<Vec<_>>()
        .join(", ")
}
