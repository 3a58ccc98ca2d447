//! hyper's own refusals in the API's error envelope. hyper answers a
//! request head it cannot parse (400), a path too long (414) or headers too
//! large (431) itself, before any handler runs, with an empty body; the API
//! promises every error as `{"error": {"code", "message"}}`. [`JsonRefusals`]
//! sits between hyper and a connection's stream and rewrites those answers
//! as they are written. It knows them by what no answer of the router's own
//! lacks: every answer the router builds carries `X-Request-Id`
//! (`super::handle`), hyper's refusals never do.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::answers::{ErrorBody, ErrorDetail};
use super::request_id;

/// A connection's stream whose writes of hyper's own refusals are
/// rewritten as JSON errors; everything else passes through untouched.
pub struct JsonRefusals<T> {
    io: T,
    /// A rewritten refusal not yet written out, and how much of it was.
    pending: Option<(Vec<u8>, usize)>,
}

impl<T> JsonRefusals<T> {
    pub fn new(io: T) -> Self {
        Self { io, pending: None }
    }
}

impl<T: AsyncWrite + Unpin> JsonRefusals<T> {
    /// Writes out what is left of a rewritten refusal.
    fn drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some((bytes, written)) = &mut self.pending {
            if *written == bytes.len() {
                self.pending = None;
                break;
            }
            let n = ready!(Pin::new(&mut self.io).poll_write(cx, &bytes[*written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            *written += n;
        }
        Poll::Ready(Ok(()))
    }

    /// Takes `head` (hyper's whole refusal) as written, and writes its
    /// JSON form instead.
    fn replace(
        &mut self,
        cx: &mut Context<'_>,
        rewritten: Vec<u8>,
        len: usize,
    ) -> Poll<io::Result<usize>> {
        self.pending = Some((rewritten, 0));
        // What cannot be written now goes with the next write, flush or
        // shutdown, each of which drains it first.
        let _ = self.drain(cx)?;
        Poll::Ready(Ok(len))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for JsonRefusals<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for JsonRefusals<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.drain(cx))?;
        match rewrite(buf) {
            Some(rewritten) => this.replace(cx, rewritten, buf.len()),
            None => Pin::new(&mut this.io).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.drain(cx))?;
        // A refusal is a head alone: one buffer, nothing after it.
        let alone = bufs.iter().skip(1).all(|b| b.is_empty());
        match bufs.first().filter(|_| alone).and_then(|b| rewrite(b)) {
            Some(rewritten) => this.replace(cx, rewritten, bufs[0].len()),
            None => Pin::new(&mut this.io).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.drain(cx))?;
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.drain(cx))?;
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

/// The JSON form of `out` when it is one of hyper's refusals, whole: a 400,
/// 414 or 431 head with no body and no `X-Request-Id`. Its status line and
/// `Date` are kept; it says `Connection: close`, as hyper closes the
/// connection after it.
fn rewrite(out: &[u8]) -> Option<Vec<u8>> {
    let status = out
        .strip_prefix(b"HTTP/1.1 ")
        .or_else(|| out.strip_prefix(b"HTTP/1.0 "))?
        .get(..3)?;
    let message = match status {
        b"400" => "the request could not be read as HTTP/1.1: its method, path, version or headers are malformed",
        b"414" => "the request's path is too long",
        b"431" => "the request's headers are too large",
        _ => return None,
    };
    let head = out.strip_suffix(b"\r\n\r\n")?;
    let mut lines = head
        .split(|&b| b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l));
    let status_line = lines.next()?;
    let mut date = None;
    let mut empty = false;
    for line in lines {
        let (name, value) = match line.iter().position(|&b| b == b':') {
            Some(at) => (&line[..at], line[at + 1..].trim_ascii()),
            None => return None,
        };
        if name.eq_ignore_ascii_case(request_id::HEADER.as_bytes()) {
            return None;
        } else if name.eq_ignore_ascii_case(b"content-length") {
            empty = value == b"0";
        } else if name.eq_ignore_ascii_case(b"date") {
            date = Some(line);
        }
    }
    if !empty {
        return None;
    }
    let id = request_id::generated();
    let body = serde_json::to_vec(&ErrorBody {
        error: ErrorDetail {
            code: "invalid_argument",
            message,
            request_id: Some(&id),
        },
    })
    .ok()?;
    let mut answer = Vec::with_capacity(256 + body.len());
    answer.extend_from_slice(status_line);
    answer.extend_from_slice(b"\r\ncontent-type: application/json\r\ncontent-length: ");
    answer.extend_from_slice(body.len().to_string().as_bytes());
    answer.extend_from_slice(b"\r\n");
    answer.extend_from_slice(request_id::HEADER.as_bytes());
    answer.extend_from_slice(b": ");
    answer.extend_from_slice(id.as_bytes());
    answer.extend_from_slice(b"\r\nconnection: close\r\n");
    if let Some(date) = date {
        answer.extend_from_slice(date);
        answer.extend_from_slice(b"\r\n");
    }
    answer.extend_from_slice(b"\r\n");
    answer.extend_from_slice(&body);
    Some(answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(out: &[u8]) -> (String, serde_json::Value) {
        let rewritten = rewrite(out).expect("rewritten");
        let text = String::from_utf8(rewritten).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(length, body.len(), "{text}");
        (head.to_string(), serde_json::from_str(body).unwrap())
    }

    #[test]
    fn hypers_refusals_become_json_errors_with_their_status_and_date() {
        for status in [
            "400 Bad Request",
            "414 URI Too Long",
            "431 Request Header Fields Too Large",
        ] {
            let out = format!(
                "HTTP/1.1 {status}\r\ncontent-length: 0\r\ndate: Thu, 03 Dec 2026 19:00:00 GMT\r\n\r\n"
            );
            let (head, body) = answer(out.as_bytes());
            assert!(
                head.starts_with(&format!("HTTP/1.1 {status}\r\n")),
                "{head}"
            );
            assert!(
                head.contains("\r\ncontent-type: application/json\r\n"),
                "{head}"
            );
            assert!(head.contains("\r\nconnection: close\r\n"), "{head}");
            assert!(
                head.contains("\r\ndate: Thu, 03 Dec 2026 19:00:00 GMT"),
                "{head}"
            );
            assert_eq!(body["error"]["code"], "invalid_argument");
            assert!(body["error"]["message"].as_str().unwrap().len() > 10);
            let id = body["error"]["requestId"].as_str().unwrap();
            assert!(head.contains(&format!("\r\nx-request-id: {id}")), "{head}");
        }
    }

    #[test]
    fn the_routers_own_answers_and_other_writes_pass_untouched() {
        let untouched: &[&[u8]] = &[
            // The router's own 400: it names its request.
            b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 0\r\nx-request-id: abc\r\n\r\n",
            b"HTTP/1.1 400 Bad Request\r\nX-Request-Id: abc\r\ncontent-length: 0\r\n\r\n",
            // A body follows, or the head is not whole.
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 2\r\n\r\n{}",
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n",
            // Other statuses, answers with bodies, HTTP/2 frames, body bytes.
            b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
            b"\0\0\x08\x06\x01\0\0\0\0\x02\x04\x10\x10\t\x0e\x07\x07",
            b"{\"error\":{}}",
            b"",
        ];
        for out in untouched {
            assert!(rewrite(out).is_none(), "{}", String::from_utf8_lossy(out));
        }
    }

    #[tokio::test]
    async fn a_refusal_is_written_whole_through_a_stream_that_takes_a_byte_at_a_time() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (near, mut far) = tokio::io::duplex(1);
        let mut io = JsonRefusals::new(near);
        let out = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n\r\n";
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            far.read_to_end(&mut got).await.unwrap();
            got
        });
        assert_eq!(io.write(out).await.unwrap(), out.len());
        io.shutdown().await.unwrap();
        drop(io);
        let got = String::from_utf8(reader.await.unwrap()).unwrap();
        assert!(got.starts_with("HTTP/1.1 431 "), "{got}");
        assert!(got.ends_with("}}"), "{got}");
        assert!(got.contains("\"code\":\"invalid_argument\""), "{got}");
    }
}
