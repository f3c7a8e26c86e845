//! A request's text as it is generated: tokens decoded incrementally
//! (UTF-8-complete deltas), stop strings searched as the text grows, and a
//! tail that may still become a stop string held back until it can no
//! longer match.

use te_tokenizer::DecodeStream;

/// One request's text so far.
pub(crate) struct TextState<'a> {
    /// The detokenizer (`None`: an engine without a tokenizer, no text).
    decoder: Option<DecodeStream<'a>>,
    /// Non-empty strings that end the request when they appear.
    stop: Vec<String>,
    /// Text decoded so far, and how much of it was sent.
    text: String,
    sent: usize,
}

impl<'a> TextState<'a> {
    pub(crate) fn new(decoder: Option<DecodeStream<'a>>, stop: Vec<String>) -> Self {
        TextState {
            decoder,
            stop,
            text: String::new(),
            sent: 0,
        }
    }

    /// Decodes `tok` into the text; returns the text that may be sent now
    /// and whether a stop string appeared (the text then ends before it).
    /// A token the tokenizer cannot decode (a model vocabulary padded past
    /// the tokenizer's) adds no text.
    pub(crate) fn push(&mut self, tok: u32) -> (String, bool) {
        let Some(decoder) = self.decoder.as_mut() else {
            return (String::new(), false);
        };
        if let Ok(Some(piece)) = decoder.step(tok) {
            self.text.push_str(&piece);
        }
        // Text already sent holds no stop string nor the start of one (that
        // would have been held back), so search the rest.
        let from = self.sent;
        if let Some(pos) = self
            .stop
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|p| from + p))
            .min()
        {
            self.text.truncate(pos);
            let out = self.text[self.sent.min(pos)..].to_string();
            self.sent = self.text.len();
            return (out, true);
        }
        // Hold back the longest tail that is a prefix of a stop string.
        let mut hold = 0;
        for s in &self.stop {
            for k in (1..s.len()).rev() {
                if k <= hold {
                    break;
                }
                if s.is_char_boundary(k) && self.text.ends_with(&s[..k]) {
                    hold = k;
                    break;
                }
            }
        }
        let end = (self.text.len() - hold).max(self.sent);
        let out = self.text[self.sent..end].to_string();
        self.sent = end;
        (out, false)
    }

    /// The text still held back, now released (the request ended other
    /// than by a stop string).
    pub(crate) fn rest(&mut self) -> String {
        let out = self.text[self.sent..].to_string();
        self.sent = self.text.len();
        out
    }
}
