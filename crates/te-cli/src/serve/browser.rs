//! The browser policy of `te serve` (`--allowed-host`, `--cors-origin`,
//! whether the server has API keys): which `Host` names a browser may
//! reach it as. [`super::guard`] applies it.

/// Which hosts and origins a browser may reach the server as.
#[derive(Clone, Debug, Default)]
pub struct BrowserPolicy {
    /// `--allowed-host`s, lowercase (`*`: any).
    pub allowed_hosts: Vec<String>,
    /// `--cors-origin`s (`scheme://host[:port]`).
    pub cors_origins: Vec<String>,
    /// A server without API keys: `Host` and the content type of `POST`s
    /// are checked (with keys, a forged request lacks the key anyway).
    pub keyless: bool,
}

impl BrowserPolicy {
    /// Whether `host` (a `Host` header: name or address, maybe a port)
    /// may be served.
    pub fn host_allowed(&self, host: &str) -> bool {
        let name = host_name(host).to_ascii_lowercase();
        let name = name.trim_end_matches('.');
        name.parse::<std::net::IpAddr>().is_ok()
            || name == "localhost"
            || self.allowed_hosts.iter().any(|h| h == "*" || h == name)
    }
}

/// The name or address of a `Host` value, without port or brackets.
fn host_name(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_without_keys() {
        let p = BrowserPolicy {
            allowed_hosts: vec!["llm.lan".into()],
            ..BrowserPolicy::default()
        };
        for ok in [
            "127.0.0.1:8080",
            "localhost",
            "LOCALHOST.:80",
            "[::1]:8080",
            "10.0.0.5",
            "llm.lan:8080",
        ] {
            assert!(p.host_allowed(ok), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:8080",
            "localhost.evil.example",
            "",
        ] {
            assert!(!p.host_allowed(bad), "{bad}");
        }
    }
}
