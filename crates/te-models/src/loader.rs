//! From a [`ModelSource`] to a runnable [`Model`] and its [`Tokenizer`].

use crate::config::ModelConfig;
use crate::gguf_model::config_from_gguf;
use te_formats::gguf::GgufFile;
use te_formats::safetensors::SafetensorsSource;

use crate::hf::load_config;
use crate::model::Model;
use crate::source::ModelSource;
use crate::validate;
use te_formats::TensorSource;
use te_tokenizer::Tokenizer;

use crate::family::NameScheme;
use crate::weights::ModelWeights;
use crate::{ModelError, Result};

/// A model with its tokenizer.
pub struct LoadedModel {
    pub model: Model,
    pub tokenizer: Tokenizer,
}

/// Reads only the config (no weights) of `source`.
pub fn load_config_only(source: &ModelSource) -> Result<ModelConfig> {
    match source {
        ModelSource::Gguf(path) => config_from_gguf(&GgufFile::open(path)?),
        ModelSource::HfDir(dir) => load_config(dir),
        ModelSource::Random(random) => random.load_config(),
    }
}

/// Loads only the tokenizer of `source`.
pub fn load_tokenizer(source: &ModelSource) -> Result<Tokenizer> {
    match source {
        ModelSource::Gguf(path) => Ok(Tokenizer::from_gguf(&GgufFile::open(path)?)?),
        ModelSource::HfDir(dir) => Ok(Tokenizer::from_file(&dir.join("tokenizer.json"))?),
        ModelSource::Random(random) => random.tokenizer(),
    }
}

/// The model's stop tokens: the config's EOS ids and the tokenizer's
/// end-of-generation ids (EOS, end-of-turn).
pub fn merge_eos(config: &mut ModelConfig, tokenizer: &Tokenizer) {
    for &id in tokenizer.eos_ids() {
        if !config.eos_token_ids.contains(&id) {
            config.eos_token_ids.push(id);
        }
    }
}

/// Config, tokenizer and weights of a model, validated, before the
/// [`Model`] (RoPE tables, layers) is built.
pub struct LoadedParts {
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    pub weights: ModelWeights,
}

/// Loads config, tokenizer and weights (dequantized to f32 where not kept
/// quantized), after [`crate::validate::problems`] found nothing wrong. A
/// GGUF file's tokenizer is built beside its weights, on a second thread,
/// and checked ([`crate::validate::tokenizer_problems`]) once both are
/// there.
///
/// Errors: everything the GGUF, safetensors, config and tokenizer readers
/// report, each naming the file, tensor or field; [`ModelError::Invalid`]
/// listing every validation problem.
pub fn load_parts(source: &ModelSource) -> Result<LoadedParts> {
    match source {
        ModelSource::Gguf(path) => {
            let file = GgufFile::open(path)?;
            let config = config_from_gguf(&file)?;
            // The tokenizer is built on a second thread while the weights
            // load: a 262k-piece SentencePiece vocabulary (Gemma 3) takes
            // longer than its weights (~0.45 s against ~0.05 s), and the
            // first token waits for both. Its own problems are reported
            // once it is built.
            std::thread::scope(|s| {
                let tokenizer = s.spawn(|| Tokenizer::from_gguf(&file));
                let problems =
                    validate::problems(&config, NameScheme::Gguf, &file, Some(&file), None);
                validate::to_result(path, problems)?;
                // GGUF Gemma norms already hold 1 + w.
                let weights = ModelWeights::load(&file, NameScheme::Gguf, &config, 0.0)?;
                let tokenizer = tokenizer
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
                validate::to_result(path, validate::tokenizer_problems(&tokenizer, &config))?;
                Ok(LoadedParts {
                    config,
                    tokenizer,
                    weights,
                })
            })
        }
        ModelSource::HfDir(dir) => {
            let config = load_config(dir)?;
            let tokenizer_path = dir.join("tokenizer.json");
            if !tokenizer_path.is_file() {
                return Err(ModelError::Resolve {
                    model: dir.display().to_string(),
                    reason: "no tokenizer.json".into(),
                });
            }
            let tokenizer = Tokenizer::from_file(&tokenizer_path)?;
            let st = SafetensorsSource::open(dir)?;
            let problems = validate::problems(
                &config,
                NameScheme::HuggingFace,
                &st,
                None,
                Some(&tokenizer),
            );
            validate::to_result(dir, problems)?;
            // Hugging Face Gemma checkpoints store w of the (1 + w) norms.
            let norm_offset = config.architecture.family().hf_norm_offset;
            let weights = ModelWeights::load(&st, NameScheme::HuggingFace, &config, norm_offset)?;
            Ok(LoadedParts {
                config,
                tokenizer,
                weights,
            })
        }
        ModelSource::Random(random) => {
            let config = random.load_config()?;
            let tokenizer = random.tokenizer()?;
            let tensors = random.tensors(&config);
            let problems = validate::problems(
                &config,
                NameScheme::HuggingFace,
                &tensors,
                None,
                Some(&tokenizer),
            );
            validate::to_result(tensors.origin(), problems)?;
            // Stored as Hugging Face stores them: Gemma norms hold w of (1 + w).
            let norm_offset = config.architecture.family().hf_norm_offset;
            let weights =
                ModelWeights::load(&tensors, NameScheme::HuggingFace, &config, norm_offset)?;
            Ok(LoadedParts {
                config,
                tokenizer,
                weights,
            })
        }
    }
}

/// Loads config, weights (dequantized to f32) and tokenizer
/// ([`load_parts`]) and builds the [`Model`].
///
/// Errors: those of [`load_parts`] and [`Model::new`].
pub fn load_model(source: &ModelSource) -> Result<LoadedModel> {
    let LoadedParts {
        config,
        tokenizer,
        weights,
    } = load_parts(source)?;
    let mut model = Model::new(config, weights)?;
    merge_eos(&mut model.config, &tokenizer);
    Ok(LoadedModel { model, tokenizer })
}
