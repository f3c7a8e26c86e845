//! Constrained decoding against hand-checked grammars on a byte tokenizer
//! (each byte one token): whatever the logits, a sampler held to a JSON
//! schema produces text that parses and validates by hand, then only the
//! end token; a sampler without a constraint is untouched by one beside
//! it; bad schemas are refused with a message naming the keyword.

use te_engine::constraint::Grammars;
use te_engine::sampling::{Sampler, SamplingParams};
use te_tokenizer::Tokenizer;

const VOCAB: usize = 300;
const EOS: u32 = 0;

fn grammars() -> (Tokenizer, Grammars) {
    let tok = Tokenizer::bytes(VOCAB, None, &[EOS]).expect("byte tokenizer");
    let g = Grammars::new(&tok, VOCAB, &[EOS]).expect("grammars");
    (tok, g)
}

/// Random logits from a small xorshift (the test's own stream).
fn logits(state: &mut u64) -> Vec<f32> {
    (0..VOCAB)
        .map(|_| {
            *state ^= *state << 13;
            *state ^= *state >> 7;
            *state ^= *state << 17;
            (*state % 2000) as f32 / 100.0 - 10.0
        })
        .collect()
}

/// Generates with `constraint` until EOS (or 200 tokens); the text.
fn run(tok: &Tokenizer, sampler: &mut Sampler, seed: u64) -> (String, bool) {
    let mut state = seed | 1;
    let mut ids = vec![];
    for _ in 0..200 {
        let t = sampler.sample(&logits(&mut state), &ids);
        if t == EOS {
            return (tok.decode(&ids, true).unwrap(), true);
        }
        ids.push(t);
    }
    (tok.decode(&ids, true).unwrap(), false)
}

#[test]
fn schema_outputs_validate_whatever_the_logits() {
    let (tok, g) = grammars();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green"]},
            "n": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["color", "n"],
        "additionalProperties": false,
    });
    for seed in 0..20u64 {
        for temperature in [0.0, 1.0] {
            let c = g.json_schema(schema.clone()).expect("schema compiles");
            let mut s = Sampler::new(SamplingParams {
                temperature,
                seed,
                ..SamplingParams::default()
            })
            .with_constraint(Some(c));
            let (text, ended) = run(&tok, &mut s, seed);
            assert!(ended, "no end token after {text:?}");
            let v: serde_json::Value =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            let color = v["color"].as_str().unwrap();
            let n = v["n"].as_i64().unwrap();
            assert!(
                ["red", "green"].contains(&color) && (1..=9).contains(&n),
                "{text}"
            );
            assert_eq!(v.as_object().unwrap().len(), 2, "{text}");
            // The documented style: one line, ", " and ": ".
            assert!(text.contains("\": ") && !text.contains('\n'), "{text}");
        }
    }
    // A tool call between markers.
    let c = g
        .json_between(
            "<tool_call>\n",
            serde_json::json!({"enum": [1, 2]}),
            "\n</tool_call>",
        )
        .unwrap();
    let mut s = Sampler::new(SamplingParams::default()).with_constraint(Some(c));
    let (text, ended) = run(&tok, &mut s, 5);
    assert!(
        ended && (text == "<tool_call>\n1\n</tool_call>" || text == "<tool_call>\n2\n</tool_call>"),
        "{text:?}"
    );
}

#[test]
fn a_constraint_changes_only_its_own_sequence() {
    let (tok, g) = grammars();
    for seed in 0..10u64 {
        let p = SamplingParams {
            temperature: 0.8,
            seed,
            ..SamplingParams::default()
        };
        let mut alone = Sampler::new(p.clone());
        let mut beside = Sampler::new(p);
        let mut constrained = Sampler::new(SamplingParams::default()).with_constraint(Some(
            g.json_schema(serde_json::json!({"type": "object"}))
                .unwrap(),
        ));
        let (mut state, mut a, mut b, mut c) = (seed | 1, vec![], vec![], vec![]);
        for _ in 0..30 {
            let row = logits(&mut state);
            a.push(alone.sample(&row, &a));
            // The same row, sampled after a constrained sequence used it.
            c.push(constrained.sample(&row, &c));
            b.push(beside.sample(&row, &b));
        }
        assert_eq!(a, b, "seed {seed}");
        assert!(tok.decode(&c, true).unwrap().starts_with('{'));
    }
}

#[test]
fn bad_schemas_are_refused_naming_the_problem() {
    let (_, g) = grammars();
    for (schema, word) in [
        (serde_json::json!({"type": "frob"}), "frob"),
        (serde_json::json!({"$ref": "#/nowhere"}), "nowhere"),
        (serde_json::json!(3), "object"),
    ] {
        let e = g.json_schema(schema.clone()).unwrap_err();
        assert!(e.0.contains(word), "{schema}: {e}");
    }
}
