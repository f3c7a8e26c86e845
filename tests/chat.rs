//! `te chat` driven as a person would, in a terminal: tmux runs it in a
//! pane, `send-keys` types and `capture-pane` reads the screen. SmolLM2-135M
//! Instruct answers greedily: two turns that need the first for the second,
//! `/stats` showing that the second turn prefilled only its new tokens,
//! `/reset`, Ctrl-C in the middle of an answer and a third turn after it,
//! `/save`, Ctrl-D, and `/load` in a new process. A base model (Gemma 3
//! 270M, no chat template) says so and continues text.
//!
//! Needs `tmux` (CI installs it).
//!
//! Base models elsewhere: the known-model list says which models are base
//! and which instruct, as their files do; `te inspect` and `te serve` say
//! so at start, and the server refuses chat requests to a base model with a
//! 400 naming it while completing text.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// How long one answer or start-up may take before the test gives up.
const TIMEOUT: Duration = Duration::from_secs(180);

/// A tmux server of its own (`-L`), one pane running `te`.
struct Pane {
    socket: String,
}

impl Pane {
    fn start(name: &str, args: &[&str]) -> Pane {
        let socket = format!("te-chat-test-{}-{name}", std::process::id());
        let pane = Pane { socket };
        let mut cmd = vec![
            "-f",
            "/dev/null",
            "new-session",
            "-d",
            "-s",
            "t",
            "-x",
            "160",
            "-y",
            "50",
            env!("CARGO_BIN_EXE_te"),
        ];
        cmd.extend_from_slice(args);
        pane.tmux(&cmd);
        // The pane stays after te exits, so its exit can be seen.
        pane.tmux(&["set-option", "-t", "t", "remain-on-exit", "on"]);
        pane
    }

    fn tmux(&self, args: &[&str]) -> String {
        let out = Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect("running tmux (install it: apt-get install tmux)");
        assert!(
            out.status.success(),
            "tmux {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The whole pane, scrollback included, wrapped lines joined.
    fn screen(&self) -> String {
        self.tmux(&["capture-pane", "-p", "-J", "-S", "-", "-t", "t"])
    }

    /// Waits until `done(screen)`; panics with the screen after [`TIMEOUT`].
    fn wait(&self, what: &str, done: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let screen = self.screen();
            if done(&screen) {
                return screen;
            }
            assert!(
                start.elapsed() < TIMEOUT,
                "timed out waiting for {what}; the screen:\n{screen}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits for the input prompt (`>>>` as the last line).
    fn wait_ready(&self) -> String {
        self.wait("the >>> prompt", |s| last_line(s) == ">>>")
    }

    /// Types `line` and Enter, waits for the next prompt, and returns what
    /// appeared between the typed line and that prompt.
    fn say(&self, line: &str) -> String {
        let before = prompts(&self.screen());
        self.tmux(&["send-keys", "-t", "t", "-l", line]);
        self.tmux(&["send-keys", "-t", "t", "Enter"]);
        let screen = self.wait(&format!("the answer to {line:?}"), |s| {
            prompts(s) > before && last_line(s) == ">>>"
        });
        after_input(&screen, line)
    }

    fn dead(&self) -> bool {
        self.tmux(&["display-message", "-p", "-t", "t", "#{pane_dead}"])
            .trim()
            == "1"
    }
}

impl Drop for Pane {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["-L", &self.socket, "kill-server"])
            .output();
    }
}

/// How many input prompts the screen shows.
fn prompts(screen: &str) -> usize {
    screen.lines().filter(|l| l.starts_with(">>>")).count()
}

fn last_line(screen: &str) -> &str {
    screen
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim_end()
}

/// The lines after the last `>>> {line}` up to the final prompt.
fn after_input(screen: &str, line: &str) -> String {
    let lines: Vec<&str> = screen.lines().collect();
    let typed = format!(">>> {line}");
    let at = lines
        .iter()
        .rposition(|l| l.trim_end() == typed)
        .unwrap_or_else(|| panic!("{typed:?} is not on the screen:\n{screen}"));
    let end = lines
        .iter()
        .rposition(|l| l.trim_end() == ">>>")
        .expect("a prompt");
    lines[at + 1..end].join("\n").trim().to_string()
}

/// The integers of `/stats`'s "last turn" line, in order: prompt, from
/// earlier turns, new, prefilled, from the prefix cache, generated, ...
fn last_turn_numbers(stats: &str) -> Vec<usize> {
    let line = stats
        .lines()
        .find(|l| l.starts_with("last turn:"))
        .unwrap_or_else(|| panic!("no 'last turn' in /stats:\n{stats}"));
    line.split(|c: char| !c.is_ascii_digit() && c != '.')
        .filter(|w| !w.is_empty() && !w.contains('.'))
        .map(|w| w.parse().expect("an integer"))
        .collect()
}

fn chat_args<'a>(model: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "chat",
        "--model",
        model,
        "--temperature",
        "0",
        "--max-new-tokens",
        "400",
        "-t",
        "2",
    ];
    args.extend_from_slice(extra);
    args
}

fn read_messages(path: &Path) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(path).expect("the saved conversation");
    let v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    v.as_array()
        .expect("a list of messages")
        .iter()
        .map(|m| {
            (
                m["role"].as_str().expect("role").to_string(),
                m["content"].as_str().expect("content").to_string(),
            )
        })
        .collect()
}

#[test]
fn a_conversation_in_the_terminal() {
    let dir = std::env::temp_dir().join(format!("te-chat-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let saved = dir.join("conversation.json");
    let saved_arg = saved.to_str().unwrap().to_string();

    let pane = Pane::start("instruct", &chat_args("smollm2-135m", &[]));
    pane.wait_ready();
    let first = pane.say("What is the capital of France?");
    assert!(first.contains("Paris"), "first answer: {first:?}");
    // The second question only makes sense with the first.
    let second = pane.say("And of Germany?");
    assert!(second.contains("Berlin"), "second answer: {second:?}");
    let stats = pane.say("/stats");
    let n = last_turn_numbers(&stats);
    let (prompt, earlier, new, prefilled, cached) = (n[0], n[1], n[2], n[3], n[4]);
    assert_eq!(prompt, earlier + new, "{stats}");
    assert!(earlier > 20, "the first turn is reused: {stats}");
    assert_eq!(prefilled, new, "only the new tokens are prefilled: {stats}");
    assert_eq!(
        cached, earlier,
        "the rest comes from the prefix cache: {stats}"
    );

    // A new conversation: the same question has the same greedy answer.
    let reset = pane.say("/reset");
    assert!(reset.contains("conversation cleared"), "{reset}");
    assert_eq!(pane.say("What is the capital of France?"), first);
    let stats = pane.say("/stats");
    assert_eq!(
        last_turn_numbers(&stats)[1],
        0,
        "nothing from before: {stats}"
    );

    // Ctrl-C in the middle of a long answer stops it; the program stays.
    let ask = "Write a long story about a dragon.";
    pane.tmux(&["send-keys", "-t", "t", "-l", ask]);
    pane.tmux(&["send-keys", "-t", "t", "Enter"]);
    pane.wait("the story to start", |s| after_story(s, ask).len() > 40);
    pane.tmux(&["send-keys", "-t", "t", "C-c"]);
    let screen = pane.wait_ready();
    let story = after_input(&screen, ask);
    assert!(story.ends_with("[stopped]"), "{story}");
    let third = pane.say("Thank you!");
    assert!(!third.is_empty(), "an answer after the stopped one");
    let stats = pane.say("/stats");
    let third_prompt = last_turn_numbers(&stats)[0];

    let saved_note = pane.say(&format!("/save {saved_arg}"));
    assert!(saved_note.contains("saved 6 messages"), "{saved_note}");
    let messages = read_messages(&saved);
    let roles: Vec<&str> = messages.iter().map(|(r, _)| r.as_str()).collect();
    assert_eq!(
        roles,
        [
            "user",
            "assistant",
            "user",
            "assistant",
            "user",
            "assistant"
        ]
    );
    assert_eq!(messages[0].1, "What is the capital of France?");
    assert_eq!(messages[1].1.trim(), first);
    // (The terminal echoes the Ctrl-C as ^C where it came.)
    let shown = story.replace("^C", "");
    let shown = shown.trim_end_matches("[stopped]").trim();
    assert!(
        shown.starts_with(messages[3].1.trim()) && messages[3].1.len() > 40,
        "the stopped answer is kept as far as it went: {:?} (shown: {shown:?})",
        messages[3].1
    );

    // Ctrl-D quits.
    pane.tmux(&["send-keys", "-t", "t", "C-d"]);
    pane.wait("te to exit", |_| pane.dead());
    drop(pane);

    // A new process continues the saved conversation.
    let pane = Pane::start("load", &chat_args("smollm2-135m", &[]));
    pane.wait_ready();
    let loaded = pane.say(&format!("/load {saved_arg}"));
    assert!(loaded.contains("loaded 6 messages"), "{loaded}");
    assert!(
        loaded.contains("[user] What is the capital of France?"),
        "{loaded}"
    );
    let fourth = pane.say("What was my first question?");
    assert!(!fourth.is_empty());
    let stats = pane.say("/stats");
    let n = last_turn_numbers(&stats);
    // The whole saved conversation is in the prompt: more than the third
    // turn's prompt (which lacked the third answer and this question).
    assert!(n[0] > third_prompt, "{stats} vs {third_prompt}");
    assert_eq!(n[1], 0, "a new process computed nothing before: {stats}");
    std::fs::remove_dir_all(&dir).ok();
}

/// The text after the typed story request so far.
fn after_story(screen: &str, ask: &str) -> String {
    let typed = format!(">>> {ask}");
    match screen.find(&typed) {
        Some(at) => screen[at + typed.len()..].trim().to_string(),
        None => String::new(),
    }
}

#[test]
fn a_base_model_continues_text() {
    let pane = Pane::start(
        "base",
        &[
            "chat",
            "--model",
            "gemma3-270m",
            "--temperature",
            "0",
            "--max-new-tokens",
            "8",
            "-t",
            "2",
        ],
    );
    let screen = pane.wait_ready();
    assert!(
        screen.contains("has no chat template") && screen.contains("raw-completion mode"),
        "{screen}"
    );
    let text = pane.say("The capital of France is");
    // The continuation is printed after the text typed.
    assert!(text.starts_with("The capital of France is"), "{text}");
    assert!(text.len() > "The capital of France is".len(), "{text}");
}

#[test]
fn known_models_say_whether_they_are_base_or_instruct() {
    for m in te_formats::hub::KNOWN_MODELS {
        let (ok, stdout, stderr) = common::te(&["inspect", "--model", m.name, "--json"]);
        assert!(ok, "te inspect {}: {stderr}", m.name);
        let info: serde_json::Value = serde_json::from_str(&stdout).expect("JSON");
        assert_eq!(
            info["tokenizer"]["chat_template"].as_bool(),
            Some(m.instruct),
            "{}: instruct is {} in KNOWN_MODELS",
            m.name,
            m.instruct
        );
    }
    let (ok, stdout, _) = common::te(&["inspect", "--model", "gemma3-270m"]);
    assert!(ok);
    assert!(
        stdout.contains("no chat template: a base model"),
        "{stdout}"
    );
}

/// One HTTP/1.1 request to `addr`: the status and the body.
fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connecting to te serve");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    let status = reply
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("a status line");
    let body = reply.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, body.to_string())
}

#[test]
fn serve_refuses_chat_to_a_base_model_and_completes_text() {
    let common::Serve {
        mut child,
        addr,
        log,
    } = common::spawn_serve("gemma3-270m", &["-t", "2"], &[]);
    let chat = http(
        &addr,
        "POST",
        "/v1/chat/completions",
        r#"{"model": "gemma3-270m", "stream": true, "messages": [{"role": "user", "content": "Hi"}]}"#,
    );
    let completion = http(
        &addr,
        "POST",
        "/v1/completions",
        r#"{"model": "gemma3-270m", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}"#,
    );
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        log.contains("gemma3-270m has no chat template (a base model)"),
        "{log}"
    );
    assert_eq!(chat.0, 400, "{}", chat.1);
    assert!(
        chat.1
            .contains("The model `gemma3-270m` has no chat template"),
        "{}",
        chat.1
    );
    assert_eq!(completion.0, 200, "{}", completion.1);
    let v: serde_json::Value = serde_json::from_str(&completion.1).expect("JSON");
    assert!(
        !v["choices"][0]["text"].as_str().unwrap_or("").is_empty(),
        "{v}"
    );
}
