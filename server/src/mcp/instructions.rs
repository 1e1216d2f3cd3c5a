//! The `instructions` of the initialize result: what the model needs to know about the
//! shell and, over HTTP, about sessions.

/// What the model needs to know about the shell, whatever the transport.
const SHELL_INSTRUCTIONS: &str = "`cd`, `export` and functions carry over between calls. stdin \
is /dev/null, so use non-interactive commands. Output is stdout, then stderr, then a one-line \
summary with the exit code. `exit` ends the shell itself: the next call starts a new one and \
the session's state (directory, variables, functions) is lost. To end a command with a \
status, use `(exit N)`, or `return N` inside a function.";

/// How a call finds its shell over HTTP, for the model.
const SESSIONS: &str = "The session is the HTTP header X-Session-ID when the client sets one \
(calls with the same id share one shell); otherwise each MCP session (chat) gets its own \
shell. If a result says `new session <handle>`, pass that handle as the `session` argument of \
your later calls to keep the same shell; without it, each call starts a new one.";

/// The `instructions` of the `initialize` (and `server/discover`) result: the tool's own,
/// then the admin's (`--instructions`, which the operator renders from
/// `spec.server.instructions`) as written. Over stdio there is one session and no HTTP, so
/// neither the session header nor `DELETE /sessions` is mentioned: such a client cannot use
/// them.
pub fn instructions(stdio: bool, admin: Option<&str>) -> String {
    let mut text = if stdio {
        format!("One tool, `bash`, runs a command in a persistent bash shell. {SHELL_INSTRUCTIONS}")
    } else {
        format!(
            "One tool, `bash`, runs a command in a persistent bash shell of your session. \
             {SESSIONS} {SHELL_INSTRUCTIONS} End a session with DELETE /sessions/{{id}}."
        )
    };
    if let Some(admin) = admin.map(str::trim).filter(|a| !a.is_empty()) {
        text.push_str("\n\n");
        text.push_str(admin);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instructions_explain_exit_and_fit_the_transport() {
        let http = instructions(false, None);
        let stdio = instructions(true, None);
        for text in [&http, &stdio] {
            assert!(text.contains("`exit` ends the shell"), "{text}");
            assert!(
                text.contains("`(exit N)`") && text.contains("`return N`"),
                "{text}"
            );
        }
        assert!(http.contains("X-Session-ID") && http.contains("DELETE /sessions/{id}"));
        for http_only in ["X-Session-ID", "header", "DELETE", "/sessions"] {
            assert!(
                !stdio.contains(http_only),
                "stdio mentions {http_only}: {stdio}"
            );
        }
        let admin = "kubectl (context prod-ro) and jq.\nRead only.";
        let with = instructions(false, Some(admin));
        assert_eq!(with, format!("{http}\n\n{admin}"));
        assert_eq!(
            instructions(false, Some("  \n")),
            http,
            "blank text adds nothing"
        );
    }
}
