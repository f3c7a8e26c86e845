//! Constrained decoding: a per-sequence token mask from a grammar (a JSON
//! schema, or a Lark grammar), computed by the `llguidance` crate.
//!
//! [`Grammars`] holds the vocabulary as llguidance wants it (every token's
//! bytes in a token trie; special tokens marked with a leading `0xFF`, so
//! that no grammar text matches them) and compiles grammars into
//! [`TokenConstraint`]s, one per sequence. A sequence's
//! [`crate::sampling::Sampler`] applies its constraint inside the batched
//! step: before sampling, every token the grammar does not allow gets the
//! logit `-inf` in the sampler's own copy of the row (the model's logits
//! and every other sequence of the batch are untouched), and the chosen
//! token advances the grammar. When the grammar is complete only the
//! model's end tokens stay allowed, so the sequence ends with `eos`.
//!
//! Limits: grammars are compiled under explicit llguidance limits
//! ([`Grammars::new`]: grammar size, lexer fuel, Earley items per mask),
//! so a pathological schema is refused or cut short, never a hang. A
//! constraint that fails during generation (its per-token fuel spent)
//! allows only the end tokens: the sequence ends there.

use std::sync::Arc;

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};
use te_tokenizer::Tokenizer;

/// Why a grammar could not be compiled; the message comes from llguidance
/// and names the schema keyword or grammar rule at fault.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct GrammarError(pub String);

/// The vocabulary and limits grammars are compiled against (one per model).
pub struct Grammars {
    factory: Arc<ParserFactory>,
    /// The model's end tokens, sorted.
    eos_ids: Arc<[u32]>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("eos_ids", &self.eos_ids)
            .finish_non_exhaustive()
    }
}

/// Most symbols in a compiled grammar.
pub const MAX_GRAMMAR_SIZE: usize = 200_000;

impl Grammars {
    /// The vocabulary of `tokenizer` padded to the model's `vocab_size`
    /// (ids past the tokenizer's are never allowed), with `eos_ids` the
    /// model's end tokens. Limits: [`MAX_GRAMMAR_SIZE`] symbols, llguidance's
    /// default lexer fuel (1,000,000 to build a grammar's lexer, 200,000 and
    /// 50,000 Earley items per token mask).
    ///
    /// Errors: a tokenizer whose tokens' bytes cannot be recovered from its
    /// `tokenizer.json` form, or no end token.
    pub fn new(
        tokenizer: &Tokenizer,
        vocab_size: usize,
        eos_ids: &[u32],
    ) -> Result<Self, GrammarError> {
        let err = |e: &dyn std::fmt::Display| GrammarError(format!("token vocabulary: {e}"));
        let json = tokenizer.to_json().map_err(|e| err(&e))?;
        let json: serde_json::Value = serde_json::from_str(&json).map_err(|e| err(&e))?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| err(&e))?;
        let n = vocab_size.max(words.len());
        // Ids without a token (padding): special, so no text matches them.
        for (i, w) in words.iter_mut().enumerate() {
            if w.is_empty() {
                *w = format!("\u{ff}<[pad{i}]>").into_bytes();
                w[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            }
        }
        while words.len() < n {
            let mut w = format!(" <[pad{}]>", words.len()).into_bytes();
            w[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            words.push(w);
        }
        let mut eos: Vec<u32> = eos_ids.to_vec();
        eos.sort_unstable();
        eos.dedup();
        let &first = eos
            .first()
            .ok_or_else(|| GrammarError("the model has no end token".into()))?;
        let info = TokRxInfo::new(n as u32, first);
        let trie = TokTrie::from(&info, &words);
        let env: llguidance::toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| err(&e))?;
        factory.quiet();
        *factory.limits_mut() = ParserLimits {
            max_grammar_size: MAX_GRAMMAR_SIZE,
            ..ParserLimits::default()
        };
        Ok(Grammars {
            factory: Arc::new(factory),
            eos_ids: eos.into(),
        })
    }

    /// A constraint to text that is JSON valid against `schema` (JSON
    /// Schema; `{"type": "object"}` for any object).
    ///
    /// Errors: an invalid or unsupported schema (the message names the
    /// keyword), or one past the limits.
    pub fn json_schema(&self, schema: serde_json::Value) -> Result<TokenConstraint, GrammarError> {
        let mut schema = match schema {
            serde_json::Value::Bool(true) => serde_json::json!({}),
            serde_json::Value::Object(_) => schema,
            _ => return Err(GrammarError("the schema must be an object or true".into())),
        };
        json_style().apply_to(&mut schema);
        self.compile(TopLevelGrammar::from_json_schema(schema))
    }

    /// A constraint to `prefix`, then JSON valid against `schema` (in the
    /// style of [`Grammars::json_schema`]), then `suffix`: a tool call
    /// wrapped in its format's markers.
    ///
    /// Errors: as [`Grammars::json_schema`].
    pub fn json_between(
        &self,
        prefix: &str,
        schema: serde_json::Value,
        suffix: &str,
    ) -> Result<TokenConstraint, GrammarError> {
        let mut schema = match schema {
            serde_json::Value::Object(_) => schema,
            _ => return Err(GrammarError("the schema must be an object".into())),
        };
        json_style().apply_to(&mut schema);
        let lit = |s: &str| serde_json::Value::String(s.to_string()).to_string();
        let mut grammar = String::from("start: ");
        if !prefix.is_empty() {
            grammar += &lit(prefix);
            grammar += " ";
        }
        grammar += "body";
        if !suffix.is_empty() {
            grammar += " ";
            grammar += &lit(suffix);
        }
        grammar += &format!("\nbody: %json {schema}\n");
        self.lark(grammar)
    }

    /// A constraint to the language of a Lark grammar (llguidance's
    /// dialect: `%json {schema}` rules embed JSON schemas).
    ///
    /// Errors: a grammar that does not parse or compile.
    pub fn lark(&self, grammar: String) -> Result<TokenConstraint, GrammarError> {
        self.compile(TopLevelGrammar::from_lark(grammar))
    }

    fn compile(&self, grammar: TopLevelGrammar) -> Result<TokenConstraint, GrammarError> {
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| GrammarError(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError(e));
        }
        Ok(TokenConstraint {
            matcher: Box::new(matcher),
            eos_ids: self.eos_ids.clone(),
            trie_eos: self.factory.tok_env().tok_trie().eos_token(),
        })
    }
}

/// The JSON text style every schema is held to: one line, `", "`
/// between items and `": "` after keys (no free whitespace, so a model
/// cannot wander off into blank lines). Replaces any `x-guidance`
/// options of the schema.
fn json_style() -> JsonCompileOptions {
    JsonCompileOptions {
        item_separator: ", ".into(),
        key_separator: ": ".into(),
        whitespace_flexible: false,
        ..JsonCompileOptions::default()
    }
}

/// One sequence's grammar state (see the module doc).
#[derive(Clone)]
pub struct TokenConstraint {
    /// (Boxed: a matcher is large, and requests travel by value.)
    matcher: Box<Matcher>,
    eos_ids: Arc<[u32]>,
    /// The end token llguidance knows.
    trie_eos: u32,
}

impl std::fmt::Debug for TokenConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenConstraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish_non_exhaustive()
    }
}

impl TokenConstraint {
    /// Sets the logit of every token the grammar does not allow next to
    /// `-inf`; the model's end tokens are allowed exactly when the grammar
    /// may end here (only they once it is complete or failed).
    pub(crate) fn mask(&mut self, logits: &mut [f32]) {
        let mask = if self.matcher.is_stopped() {
            None
        } else {
            self.matcher.compute_mask().ok()
        };
        let end = match &mask {
            Some(m) => m.is_allowed(self.trie_eos),
            None => true,
        };
        // The end tokens' logits, decided below by `end` alone.
        let n = logits.len();
        let ends: Vec<(usize, f32)> = self
            .eos_ids
            .iter()
            .map(|&e| e as usize)
            .filter(|&e| e < n)
            .map(|e| (e, logits[e]))
            .collect();
        match &mask {
            Some(m) => {
                for (i, l) in logits.iter_mut().enumerate() {
                    if !m.is_allowed(i as u32) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            None => logits.fill(f32::NEG_INFINITY),
        }
        for (e, l) in ends {
            logits[e] = if end { l } else { f32::NEG_INFINITY };
        }
    }

    /// Advances the grammar by the chosen `token` (end tokens as the
    /// grammar's end). A token the grammar refuses puts it in its error
    /// state (only end tokens from then on).
    pub(crate) fn commit(&mut self, token: u32) {
        if self.matcher.is_stopped() {
            return;
        }
        let t = if self.eos_ids.contains(&token) {
            self.trie_eos
        } else {
            token
        };
        let _ = self.matcher.consume_token(t);
    }
}
