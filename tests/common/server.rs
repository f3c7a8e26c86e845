//! A `te serve` child process for the server tests, and loopback
//! connections from chosen client addresses.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Child;
use std::time::Duration;

/// A `te serve` child process on a free loopback port.
pub struct Server {
    pub child: Child,
    pub addr: SocketAddr,
}

impl Server {
    /// `te serve --model model extra...`.
    pub fn start(model: &str, extra: &[&str]) -> Server {
        Self::start_with_env(model, extra, &[])
    }

    /// [`Server::start`] with environment variables `env`.
    pub fn start_with_env(model: &str, extra: &[&str], env: &[(&str, &str)]) -> Server {
        let super::Serve { child, addr, .. } = super::spawn_serve(model, extra, env);
        Server {
            child,
            addr: addr.parse().expect("a socket address"),
        }
    }

    /// One request with `Connection: close` from `from` (a loopback
    /// address of the test's choosing); (status, body).
    pub fn request_from(
        &self,
        from: &str,
        method: &str,
        path: &str,
        headers: &str,
        body: Option<&str>,
    ) -> (u16, String) {
        let mut s = connect_from(from, self.addr);
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let body = body.unwrap_or("");
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: {}\r\n{headers}Content-Length: {}\r\n\
             Connection: close\r\n\r\n{body}",
            self.addr,
            body.len()
        )
        .unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        let out = String::from_utf8_lossy(&out);
        let (head, body) = out.split_once("\r\n\r\n").expect("an HTTP response");
        let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
        (status, body.to_string())
    }

    /// A JSON request from 127.0.0.1.
    pub fn post(&self, path: &str, body: &str) -> (u16, String) {
        self.request_from(
            "127.0.0.1",
            "POST",
            path,
            "Content-Type: application/json\r\n",
            Some(body),
        )
    }

    /// The value of the metric line `name` (with its labels).
    pub fn metric(&self, name: &str) -> f64 {
        let (status, text) = self.request_from("127.0.0.1", "GET", "/metrics", "", None);
        assert_eq!(status, 200);
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing in\n{text}"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A connection to `to` from loopback address `from` (127.0.0.0/8 is all
/// loopback: a second client address without a second machine).
pub fn connect_from(from: &str, to: SocketAddr) -> TcpStream {
    let socket =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("a socket");
    let local: SocketAddr = format!("{from}:0").parse().unwrap();
    socket
        .bind(&local.into())
        .expect("binding a loopback address");
    socket
        .connect_timeout(&to.into(), Duration::from_secs(5))
        .expect("connecting to te serve");
    socket.into()
}
