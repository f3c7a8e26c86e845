//! te-tokenizer: text to token ids and back for te-rs: GGUF vocabularies
//! (gpt2-style BPE with merges, SentencePiece with scores and byte
//! fallback) and `tokenizer.json`, through the `tokenizers` crate; a byte
//! tokenizer for random-weight models; incremental detokenization
//! ([`DecodeStream`]: UTF-8-complete text deltas); chat templates
//! ([`chat`], Jinja through `minijinja`, rendered as Hugging Face does,
//! tools and tool calls included; [`content`]: message content encoded as
//! text, never as control tokens).
//!
//! Main types: [`Tokenizer`], [`DecodeStream`], [`chat::ChatMessage`],
//! [`chat::ChatTemplateArgs`].
//!
//! Invariants: no model math; errors ([`TokenizerError`]) name the file,
//! field or input at fault.

pub mod chat;
pub mod content;
pub mod error;
pub mod tokenizer;

pub use error::{Result, TokenizerError};
pub use tokenizer::{byte_token_ids, supported_gpt2_pres, DecodeStream, Tokenizer};
