//! `POST /invocations` at the HTTP edge: the request becomes an [`Invocation`] carrying
//! its connection, and the VM that runs the handler answers on that connection with
//! [`answer`] (docs/invoke.md).

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use api_types::invoke::{
    InvokeOptions, InvokeOptionsError, Outcome, HEADER_CLONE_ID, HEADER_CLONE_US,
    HEADER_HANDLER_US, HEADER_OUTCOME, HEADER_PRIMED, HEADER_SOCKET, HEADER_STRETCHED_US,
    HEADER_TOTAL_US,
};
use api_types::ErrorBody;

use crate::ApiReply;
use forkvm_client::http::{self, response_head, write_response_with};
use vmm::invoke::{Connection, Finished, Invocation, LiveLog};

/// How long the VM that ran the handler may take to write the answer to the caller.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// The invocation `req` asks for: its options from the query string.
pub fn route(req: http::Request, conn: Option<Connection>) -> Result<Invocation, ApiReply> {
    let received_ns = vmm::vstate::vcpu::monotonic_ns();
    let options: InvokeOptions = serde_urlencoded::from_str(&req.query)
        .map_err(|e| ApiReply::error(400, format!("invalid query string: {e}")))?;
    options.check().map_err(|e| match e {
        // Each part valid, but they do not fit together (no schema says so).
        InvokeOptionsError::GatewayWithoutAddress => ApiReply::error(422, e),
        InvokeOptionsError::Timeout(_) | InvokeOptionsError::TapName(_) => ApiReply::error(400, e),
    })?;
    let conn = conn.ok_or_else(|| ApiReply::error(500, "the request's connection is gone"))?;
    Ok(Invocation {
        options,
        payload: req.body,
        conn,
        received_ns,
    })
}

/// Answers the caller of the finished invocation `f`, run in the VM with clone id
/// `clone_id` serving on `socket`; an error answer quotes `console` (the VM's console
/// tail) when given, and carries `logs` (what the handler printed, for an invocation
/// that ended without a reply) when given.
pub fn answer(
    f: &Finished,
    clone_id: &str,
    socket: &Path,
    console: Option<String>,
    logs: Option<LiveLog>,
) -> std::io::Result<()> {
    let t = f.timings;
    let headers = [
        (HEADER_OUTCOME, f.outcome.as_str().to_string()),
        (HEADER_CLONE_ID, clone_id.to_string()),
        (HEADER_SOCKET, socket.display().to_string()),
        (HEADER_CLONE_US, t.clone_us.to_string()),
        (HEADER_HANDLER_US, t.handler_us.to_string()),
        (HEADER_TOTAL_US, t.total_us.to_string()),
        (HEADER_PRIMED, f.primed.to_string()),
        (HEADER_STRETCHED_US, t.stretched_us.to_string()),
    ];
    let stream = f.conn.stream();
    stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
    // Shut down once written: the template, which holds the connection too in case this
    // VM dies first, then cannot answer again.
    let done = |r: std::io::Result<()>| {
        let _ = stream.shutdown(std::net::Shutdown::Both);
        r
    };
    if f.outcome == Outcome::Ok {
        // The head, then the reply from where the runtime wrote it (`Body`).
        let kind = Some("application/octet-stream");
        let head = response_head(200, &headers, kind, f.body.len());
        let mut w = stream;
        return done((w.write_all(head.as_bytes())).and_then(|()| f.body.write_to(&mut w)));
    }
    let text = f.body.bytes();
    let mut error = match f.outcome {
        Outcome::HandlerError => {
            format!("the handler failed: {}", String::from_utf8_lossy(&text))
        }
        _ => String::from_utf8_lossy(&text).into_owned(),
    };
    if let Some(tail) = console.filter(|t| !t.is_empty()) {
        error.push_str("\n--- console tail ---\n");
        error.push_str(&tail);
    }
    let body = ErrorBody {
        error,
        logs_dropped: logs.as_ref().map(|l| l.dropped),
        logs: logs.map(|l| l.text),
    };
    let body = serde_json::to_vec(&body).unwrap_or_default();
    let kind = Some("application/json");
    done(write_response_with(
        stream,
        f.outcome.status(),
        &headers,
        kind,
        &body,
    ))
}

/// Answers the caller of a held invocation refused (`e`) when its runtime came back,
/// as the API thread answers one refused at once.
pub fn refuse(conn: &Connection, e: vmm::rpc::VmmActionError) {
    let reply = crate::reply(Err(e));
    let stream = conn.stream();
    let written = stream
        .set_write_timeout(Some(WRITE_TIMEOUT))
        .and_then(|()| http::write_response(stream, reply.status, reply.body.as_deref()));
    if let Err(e) = written {
        tracing::warn!("cannot answer a refused invocation's caller: {e}");
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;
    use vmm::invoke::{Connection, Timings};

    fn finished(outcome: Outcome, body: &[u8]) -> (Finished, UnixStream) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let f = Finished {
            conn: Connection::new(ours),
            outcome,
            body: body.to_vec().into(),
            timings: Timings {
                clone_us: 1,
                handler_us: 2,
                total_us: 3,
                stretched_us: 0,
            },
            keep_alive: false,
            vcpu: 0,
            primed: true,
            derived: false,
            sequence: 1,
        };
        (f, theirs)
    }

    fn answered(f: Finished, them: UnixStream, console: Option<&str>) -> http::Response {
        answered_with(f, them, console, None)
    }

    fn answered_with(
        f: Finished,
        them: UnixStream,
        console: Option<&str>,
        logs: Option<LiveLog>,
    ) -> http::Response {
        answer(
            &f,
            "4",
            Path::new("/tmp/s.4"),
            console.map(String::from),
            logs,
        )
        .unwrap();
        drop(f);
        http::read_response(them).unwrap()
    }

    #[test]
    fn a_reply_is_the_body_and_the_timings_are_headers() {
        let (f, them) = finished(Outcome::Ok, b"\x00\xffecho");
        let r = answered(f, them, Some("ignored"));
        assert_eq!(r.status, 200);
        assert_eq!(r.bytes, b"\x00\xffecho");
        assert_eq!(r.header("x-forkvm-outcome"), Some("ok"));
        assert_eq!(r.header("x-forkvm-clone-id"), Some("4"));
        assert_eq!(r.header("x-forkvm-socket"), Some("/tmp/s.4"));
        assert_eq!(r.header("x-forkvm-handler-us"), Some("2"));
        assert_eq!(r.header("x-forkvm-primed"), Some("true"));
        assert_eq!(r.header("content-type"), Some("application/octet-stream"));
    }

    #[test]
    fn failures_carry_the_runtime_text_and_the_console_tail() {
        let (f, them) = finished(Outcome::HandlerError, b"ZeroDivisionError");
        let r = answered(f, them, None);
        assert_eq!(r.status, 500);
        let e: ErrorBody = serde_json::from_str(&r.body).unwrap();
        assert_eq!(e.error, "the handler failed: ZeroDivisionError");
        let (f, them) = finished(Outcome::Timeout, b"late");
        let r = answered(f, them, Some("tiny: beat 3\n"));
        assert_eq!(r.status, 504);
        let e: ErrorBody = serde_json::from_str(&r.body).unwrap();
        assert!(
            e.error.ends_with("--- console tail ---\ntiny: beat 3\n"),
            "{}",
            e.error
        );
        assert_eq!((e.logs, e.logs_dropped), (None, None), "no live log");
        assert!(!r.body.contains("logs"), "{}", r.body);
    }

    #[test]
    fn a_timeout_carries_the_handlers_live_log() {
        let (f, them) = finished(Outcome::Timeout, b"the handler did not reply in time");
        let log = LiveLog {
            text: "step 1\nstep 2\n".into(),
            dropped: 12,
        };
        let r = answered_with(f, them, None, Some(log));
        assert_eq!(r.status, 504);
        let e: ErrorBody = serde_json::from_str(&r.body).unwrap();
        assert_eq!(e.error, "the handler did not reply in time");
        assert_eq!(e.logs.as_deref(), Some("step 1\nstep 2\n"));
        assert_eq!(e.logs_dropped, Some(12));
    }

    #[test]
    fn options_come_from_the_query_string() {
        let (a, _b) = UnixStream::pair().unwrap();
        let req = |query: &str| http::Request {
            method: "POST".into(),
            path: "/invocations".into(),
            query: query.into(),
            body: b"x".to_vec(),
        };
        let route = |req: http::Request| route(req, Some(Connection::new(a.try_clone().unwrap())));
        let inv = route(req("timeout_ms=250&keep_alive=true&net_rate=bytes%3D1M")).unwrap();
        assert_eq!(inv.options.timeout_ms, Some(250));
        assert!(inv.options.keep_alive);
        assert!(inv.options.net_rate.is_some());
        assert_eq!(inv.payload, b"x");
        assert_eq!(route(req("")).unwrap().options, InvokeOptions::default());
        let own = route(req("tap=fkc1&ipv4=10.0.0.5%2F24&gateway=10.0.0.1")).unwrap();
        assert_eq!(own.options.tap.as_deref(), Some("fkc1"));
        assert_eq!(own.options.ipv4, Some("10.0.0.5/24".parse().unwrap()));
        assert_eq!(own.options.gateway, Some([10, 0, 0, 1].into()));
        for bad in [
            "ipv4=10.0.0.5",
            "ipv4=10.0.0.5%2F33",
            "tap=a%2Fb",
            "tap=sixteen-bytes-xx",
            "timeout_ms=0",
            "timeout_ms=soon",
            "colour=red",
            "keep_alive=perhaps",
        ] {
            assert_eq!(route(req(bad)).unwrap_err().status, 400, "{bad}");
        }
        // Each part valid, but a gateway needs an address.
        assert_eq!(route(req("gateway=10.0.0.1")).unwrap_err().status, 422);
    }
}
