#!/usr/bin/env python3
"""A stand-in for a peer agent speaking the Go original's wire, for the bench's own test of
its `--peer` harness (bench/src/agent_peer.rs). Not the original and never measured as it:
one bash per request, GET /health, POST /exec with the bearer token from SANDBOX_AUTH_TOKEN,
listening on 127.0.0.1:$CLI_MCP_BENCH_PEER_PORT."""

import json
import os
import subprocess
from http.server import BaseHTTPRequestHandler, HTTPServer

TOKEN = os.environ["SANDBOX_AUTH_TOKEN"]
PORT = int(os.environ.get("CLI_MCP_BENCH_PEER_PORT", "8090"))


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self.answer(200, {"status": "ok"})
        else:
            self.answer(404, {"error": "not found"})

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.path != "/exec":
            return self.answer(404, {"error": "not found"})
        if self.headers.get("Authorization") != "Bearer " + TOKEN:
            return self.answer(401, {"error": "unauthorized"})
        try:
            command = json.loads(body)["command"]
        except (ValueError, KeyError):
            return self.answer(400, {"error": "invalid request body"})
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True)
        self.answer(200, {"stdout": done.stdout, "stderr": done.stderr,
                          "exit_code": done.returncode, "duration_ms": 0})


HTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
