//! Just enough HTTP for etcd's JSON gateway: one POST with a JSON body and
//! its answer, over any byte stream (a TCP connection, or a TLS session on
//! one). The request says HTTP/1.0, so the answer is never chunked: its
//! body runs for Content-Length bytes, or to the end of the connection.
//! The server's bytes are not trusted: the head and the body are capped
//! before anything is kept, and whatever does not parse is a typed error.

use std::io::{self, Read, Write};

/// The most header bytes an answer may have.
pub(crate) const MAX_HEAD: usize = 64 << 10;
/// The most body bytes an answer may have (a registry of thousands of
/// hosts is a few MiB of base64).
pub(crate) const MAX_BODY: usize = 16 << 20;

/// An answer: its status and its body.
#[derive(Debug)]
pub(crate) struct Answer {
    pub status: u16,
    pub body: Vec<u8>,
}

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HttpError {
    /// The stream failed (refused, reset, timed out, TLS).
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The connection closed before any answer came.
    #[error("the connection closed without an answer")]
    NoAnswer,
    /// The answer is not HTTP/1.x.
    #[error("the answer is not HTTP: {0}")]
    NotHttp(String),
    /// The headers do not end within the cap.
    #[error("the answer's headers exceed {MAX_HEAD} bytes")]
    HeadTooLong,
    /// The body is longer than the cap.
    #[error("the answer's body exceeds {MAX_BODY} bytes")]
    BodyTooLong,
    /// The connection closed before the body did.
    #[error("the answer ended after {got} of its {want} bytes")]
    Truncated {
        /// Bytes received.
        got: usize,
        /// Bytes announced.
        want: usize,
    },
}

/// POSTs `body` (JSON) to `path` and reads the whole answer.
pub(crate) fn post<S: Read + Write>(
    s: &mut S,
    host: &str,
    path: &str,
    body: &[u8],
) -> Result<Answer, HttpError> {
    let head = format!(
        "POST {path} HTTP/1.0\r\nHost: {host}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    let mut request = head.into_bytes();
    request.extend_from_slice(body);
    s.write_all(&request)?;
    s.flush()?;
    read_answer(s)
}

/// Reads an answer: status line and headers, then the body.
pub(crate) fn read_answer<R: Read>(r: &mut R) -> Result<Answer, HttpError> {
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if buf.len() > MAX_HEAD {
            return Err(HttpError::HeadTooLong);
        }
        let n = read_some(r, &mut chunk)?;
        if n == 0 {
            return Err(if buf.is_empty() {
                HttpError::NoAnswer
            } else {
                HttpError::NotHttp(format!(
                    "the connection closed inside the headers: {}",
                    shown(&buf)
                ))
            });
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    if head_end > MAX_HEAD {
        return Err(HttpError::HeadTooLong);
    }
    let (status, length) = parse_head(&buf[..head_end])?;
    let mut body = buf.split_off(head_end);
    match length {
        Some(want) => {
            body.truncate(want);
            // `want` is capped in parse_head.
            body.reserve_exact(want - body.len());
            while body.len() < want {
                let n = read_some(r, &mut chunk)?;
                if n == 0 {
                    return Err(HttpError::Truncated {
                        got: body.len(),
                        want,
                    });
                }
                let take = n.min(want - body.len());
                body.extend_from_slice(&chunk[..take]);
            }
        }
        None => loop {
            if body.len() > MAX_BODY {
                return Err(HttpError::BodyTooLong);
            }
            let n = read_some(r, &mut chunk)?;
            if n == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..n]);
        },
    }
    Ok(Answer { status, body })
}

/// The status and the Content-Length (if any) of a head that ends in an
/// empty line.
fn parse_head(head: &[u8]) -> Result<(u16, Option<usize>), HttpError> {
    let text = std::str::from_utf8(head)
        .map_err(|_| HttpError::NotHttp(format!("headers that are not text: {}", shown(head))))?;
    let mut lines = text.split("\r\n");
    let first = lines.next().unwrap_or("");
    let mut words = first.splitn(3, ' ');
    let version = words.next().unwrap_or("");
    let code = words.next().unwrap_or("");
    if !version.starts_with("HTTP/1.") || code.len() != 3 {
        return Err(HttpError::NotHttp(format!(
            "status line {}",
            shown(first.as_bytes())
        )));
    }
    let status: u16 = code
        .parse()
        .map_err(|_| HttpError::NotHttp(format!("status {}", shown(code.as_bytes()))))?;
    let mut length = None;
    for line in lines.take_while(|l| !l.is_empty()) {
        let (name, value) = line
            .split_once(':')
            .ok_or_else(|| HttpError::NotHttp(format!("header line {}", shown(line.as_bytes()))))?;
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            let n: usize = value.parse().map_err(|_| {
                HttpError::NotHttp(format!("Content-Length {}", shown(value.as_bytes())))
            })?;
            if length.is_some_and(|l| l != n) {
                return Err(HttpError::NotHttp("two different Content-Lengths".into()));
            }
            if n > MAX_BODY {
                return Err(HttpError::BodyTooLong);
            }
            length = Some(n);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(HttpError::NotHttp(format!(
                "Transfer-Encoding {} on an answer to HTTP/1.0",
                shown(value.as_bytes())
            )));
        }
    }
    Ok((status, length))
}

fn read_some<R: Read>(r: &mut R, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        match r.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

/// At most 120 bytes of what the server sent, printable, for a message.
pub(crate) fn shown(bytes: &[u8]) -> String {
    let cut = &bytes[..bytes.len().min(120)];
    let s: String = String::from_utf8_lossy(cut)
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let s = s.trim();
    if bytes.len() > cut.len() {
        format!("{s:?}…")
    } else {
        format!("{s:?}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(bytes: &[u8]) -> Result<Answer, HttpError> {
        read_answer(&mut &bytes[..])
    }

    #[test]
    fn a_sized_and_an_unsized_body_are_read() {
        let a = answer(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n{}trailing").unwrap();
        assert_eq!((a.status, &a.body[..]), (200, &b"{}"[..]));
        let a = answer(b"HTTP/1.1 404 Not Found\r\nX: y\r\n\r\n{\"a\":1}").unwrap();
        assert_eq!((a.status, &a.body[..]), (404, &b"{\"a\":1}"[..]));
    }

    #[test]
    fn a_post_is_http_1_0_with_its_length() {
        struct Both(Vec<u8>, &'static [u8]);
        impl Read for Both {
            fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
                self.1.read(b)
            }
        }
        impl Write for Both {
            fn write(&mut self, b: &[u8]) -> io::Result<usize> {
                self.0.write(b)
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let mut s = Both(Vec::new(), b"HTTP/1.0 200 OK\r\n\r\n{}");
        let a = post(&mut s, "h:1", "/v3/kv/range", b"{\"k\":1}").unwrap();
        assert_eq!(a.body, b"{}");
        let sent = String::from_utf8(s.0).unwrap();
        assert!(
            sent.starts_with("POST /v3/kv/range HTTP/1.0\r\nHost: h:1\r\n"),
            "{sent}"
        );
        assert!(
            sent.ends_with("Content-Length: 7\r\n\r\n{\"k\":1}"),
            "{sent}"
        );
    }

    #[test]
    fn hostile_answers_are_refused_before_they_are_kept() {
        // An announced body past the cap is refused before any allocation.
        let big = format!("HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n", usize::MAX);
        assert!(matches!(
            answer(big.as_bytes()),
            Err(HttpError::BodyTooLong)
        ));
        let over = "HTTP/1.0 200 OK\r\nContent-Length: 99999999999999999999999\r\n\r\n";
        assert!(matches!(
            answer(over.as_bytes()),
            Err(HttpError::NotHttp(_))
        ));
        let big = format!(
            "HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n",
            MAX_BODY + 1
        );
        assert!(matches!(
            answer(big.as_bytes()),
            Err(HttpError::BodyTooLong)
        ));
        // Headers that never end.
        let endless = vec![b'a'; MAX_HEAD + 10_000];
        assert!(matches!(answer(&endless), Err(HttpError::HeadTooLong)));
        // A body without a length that never ends.
        let mut long = b"HTTP/1.0 200 OK\r\n\r\n".to_vec();
        long.resize(long.len() + MAX_BODY + 10_000, b'x');
        assert!(matches!(answer(&long), Err(HttpError::BodyTooLong)));
        // A short body.
        assert!(matches!(
            answer(b"HTTP/1.0 200 OK\r\nContent-Length: 10\r\n\r\n{}"),
            Err(HttpError::Truncated { got: 2, want: 10 })
        ));
        // Chunks, two lengths, a bad status, no answer, garbage.
        for bad in [
            &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"[..],
            b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\ncontent-length: 2\r\n\r\n{}",
            b"HTTP/1.0 2000 OK\r\n\r\n",
            b"HTTP/1.0 20x OK\r\n\r\n",
            b"SSH-2.0-OpenSSH\r\n\r\n",
            b"HTTP/1.0 200 OK\r\nno colon\r\n\r\n",
            b"\x16\x03\x01\x00\x05\xff\xfe\r\n\r\n",
        ] {
            assert!(
                matches!(answer(bad), Err(HttpError::NotHttp(_))),
                "{:?}",
                answer(bad)
            );
        }
        assert!(matches!(answer(b""), Err(HttpError::NoAnswer)));
        assert!(matches!(
            answer(b"HTTP/1.0 200"),
            Err(HttpError::NotHttp(_))
        ));
    }
}
