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
/// then the sandbox briefing (`--briefing`, which the operator generates: tools, clusters
/// and rights, reachable domains, limits), then the admin's (`--instructions`, which the
/// operator renders from `spec.server.instructions`) as written. The briefing comes before
/// the admin's text so that the admin has the last word. Over stdio there is one session and
/// no HTTP, so neither the session header nor `DELETE /sessions` is mentioned: such a client
/// cannot use them.
pub fn instructions(stdio: bool, briefing: Option<&str>, admin: Option<&str>) -> String {
    let mut text = if stdio {
        format!("One tool, `bash`, runs a command in a persistent bash shell. {SHELL_INSTRUCTIONS}")
    } else {
        format!(
            "One tool, `bash`, runs a command in a persistent bash shell of your session. \
             {SESSIONS} {SHELL_INSTRUCTIONS} End a session with DELETE /sessions/{{id}}."
        )
    };
    for part in [briefing, admin] {
        if let Some(part) = part.map(str::trim).filter(|p| !p.is_empty()) {
            text.push_str("\n\n");
            text.push_str(part);
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instructions_explain_exit_and_fit_the_transport() {
        let http = instructions(false, None, None);
        let stdio = instructions(true, None, None);
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
        let with = instructions(false, None, Some(admin));
        assert_eq!(with, format!("{http}\n\n{admin}"));
        assert_eq!(
            instructions(false, Some(" "), Some("  \n")),
            http,
            "blank text adds nothing"
        );
    }

    /// The briefing sits between the tool's own text and the admin's, so the admin's words
    /// come last and can correct or add to it; in both transports.
    #[test]
    fn the_briefing_comes_after_the_tools_text_and_before_the_admins() {
        let briefing = "Sandbox briefing:\nTools: bash 5.2.15, kubectl v1.37.2.";
        let admin = "Investigate; never apply.";
        for stdio in [false, true] {
            let own = instructions(stdio, None, None);
            assert_eq!(
                instructions(stdio, Some(briefing), Some(admin)),
                format!("{own}\n\n{briefing}\n\n{admin}")
            );
            assert_eq!(
                instructions(stdio, Some(briefing), None),
                format!("{own}\n\n{briefing}")
            );
        }
    }
}
