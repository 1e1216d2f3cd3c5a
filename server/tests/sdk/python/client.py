"""Drives cli-mcp-server with the official MCP Python SDK (`mcp` on PyPI).

Prints one JSON object on stdout with what the SDK saw: the negotiated protocol version,
the instructions, the tools, and the results of a fixed list of calls. server/tests/sdk.rs
runs this script and asserts on that object, so the checks and their messages stay in one
place for every SDK.

Usage: client.py --url URL --session SID --mode legacy|auto|2026-07-28
       client.py --stdio '["cli-mcp-server", "--transport", "stdio", ...]' --mode legacy
       client.py --url URL [--session SID] | --stdio '[...]' --mode M --cancel FIFO MARKER
         (cancels a long call the SDK's way, an anyio cancel scope, then calls again)
       client.py --url URL --session SID | --stdio '[...]' --mode M --progress
         (a slow command with a progress callback, then without one)
       client.py --url URL --session SID | --stdio '[...]' --mode M --resources OUT
         (a truncated output's spill and a binary workspace file read back in chunks; the
         spill's bytes are written to OUT for the test to compare)
"""

import argparse
import asyncio
import base64
import hashlib
import json
import sys
import time

import anyio

import httpx2
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError


def http_client(session):
    headers = {"X-Session-ID": session} if session else {}
    # trust_env=False: a proxy from the environment must not capture loopback traffic.
    return httpx2.AsyncClient(headers=headers, trust_env=False, timeout=httpx2.Timeout(30, read=120))


def result_json(result):
    return {
        "is_error": bool(result.is_error),
        "text": [getattr(block, "text", None) for block in result.content],
        "structured": result.structured_content,
    }


async def call(client, name, arguments):
    """A tool call's result, or the MCP (JSON-RPC) error it raised."""
    try:
        return result_json(await client.call_tool(name, arguments))
    except MCPError as e:
        return {"mcp_error": {"code": e.code, "message": e.message}}


async def scenario(url, stdio, session, mode):
    if stdio is not None:
        server = StdioServerParameters(command=stdio[0], args=stdio[1:])
        async with Client(server, mode=mode) as client:
            return await calls(client)
    async with http_client(session) as http:
        async with Client(streamable_http_client(url, http_client=http), mode=mode) as client:
            report = await calls(client)
    # Two chats from one configuration without X-Session-ID: each must get its own shell.
    report["chats"] = [await chat(url, mode, "a"), await chat(url, mode, "b")]
    return report


def read_fifo(path):
    with open(path) as f:
        return f.read().strip()


async def cancel_scenario(url, stdio, session, mode, fifo, marker):
    """Starts a 30 s command, cancels it once it runs, and calls again at once.

    The command writes its pid to FIFO when it starts and creates MARKER if it ever ends on
    its own. Times are seconds after the cancel."""
    if stdio is not None:
        server = StdioServerParameters(command=stdio[0], args=stdio[1:])
        async with Client(server, mode=mode) as client:
            return await cancel_calls(client, fifo, marker)
    async with http_client(session) as http:
        async with Client(streamable_http_client(url, http_client=http), mode=mode) as client:
            return await cancel_calls(client, fifo, marker)


async def cancel_calls(client, fifo, marker):
    """What `cancel_scenario` does once connected."""
    report = {}
    report["protocol_version"] = client.protocol_version
    report["set_state"] = await call(
        client, "bash", {"command": "cd /tmp && export CANCEL_VAR=kept"}
    )
    long_call = {"finished": None}
    scope = anyio.CancelScope()

    async def run_long_call():
        with scope:
            command = f"sh -c 'echo $$ > {fifo}; exec sleep 30' && touch {marker}"
            long_call["finished"] = result_json(
                await client.call_tool("bash", {"command": command})
            )

    async with anyio.create_task_group() as tg:
        tg.start_soon(run_long_call)
        with anyio.fail_after(30):
            report["pid"] = int(await anyio.to_thread.run_sync(read_fifo, fifo))
        cancelled_at = time.monotonic()
        scope.cancel()
    report["cancel_returned_after"] = time.monotonic() - cancelled_at
    report["long_call"] = long_call["finished"]
    report["scope_cancelled"] = scope.cancelled_caught
    report["next"] = await call(client, "bash", {"command": 'echo "ok $PWD $CANCEL_VAR"'})
    report["next_answered_after"] = time.monotonic() - cancelled_at
    return report


PROGRESS_COMMAND = "for i in 1 2 3; do echo line$i; sleep 1.2; done"


async def progress_scenario(url, stdio, session, mode):
    """A slow command with a `progress_callback` (the SDK sends a progress token), then the
    same without one. Times are seconds since the call started."""
    if stdio is not None:
        server = StdioServerParameters(command=stdio[0], args=stdio[1:])
        async with Client(server, mode=mode) as client:
            return await progress_calls(client)
    async with http_client(session) as http:
        async with Client(streamable_http_client(url, http_client=http), mode=mode) as client:
            return await progress_calls(client)


async def progress_calls(client):
    """What `progress_scenario` does once connected."""
    report = {"protocol_version": client.protocol_version}
    seen = []
    started = time.monotonic()

    async def on_progress(progress, total, message):
        seen.append(
            {
                "progress": progress,
                "total": total,
                "message": message,
                "at": time.monotonic() - started,
            }
        )

    report["with_token"] = result_json(
        await client.call_tool("bash", {"command": PROGRESS_COMMAND}, progress_callback=on_progress)
    )
    report["with_token_took"] = time.monotonic() - started
    report["notifications"] = seen
    return report


SEQ_COMMAND = "seq 1 200000"
BINARY_COMMAND = (
    "head -c 300000 /dev/urandom > rand.bin && sha256sum rand.bin "
    "&& ln -sf /etc/passwd passwd-link"
)
ESCAPES = ["passwd-link", "..%2F" * 16 + "etc%2Fpasswd", "../" * 16 + "etc/passwd"]
CHUNK = 100000


async def resources_scenario(url, stdio, session, mode, out):
    if stdio is not None:
        server = StdioServerParameters(command=stdio[0], args=stdio[1:])
        async with Client(server, mode=mode) as client:
            return await resources_calls(client, out)
    async with http_client(session) as http:
        async with Client(streamable_http_client(url, http_client=http), mode=mode) as client:
            return await resources_calls(client, out)


async def read_chunks(client, first_uri, uri):
    """Reads a resource whole: FIRST_URI as given, then URI?offset=N&length=CHUNK as each
    chunk's `_meta.next` says. Returns the bytes and what each chunk looked like."""
    data = bytearray()
    chunks = []
    target = first_uri
    while True:
        result = await client.read_resource(target)
        (content,) = result.contents
        meta = content.meta or {}
        if getattr(content, "blob", None) is not None:
            kind, piece = "blob", base64.b64decode(content.blob)
        else:
            kind, piece = "text", content.text.encode("utf-8")
        chunks.append({"uri": content.uri, "kind": kind, "mime_type": content.mime_type, "meta": meta})
        data.extend(piece)
        nxt = meta.get("next")
        if nxt is None or len(chunks) > 100:
            return bytes(data), chunks
        target = f"{uri}?offset={nxt}&length={CHUNK}"


async def resources_calls(client, out):
    """What `resources_scenario` does once connected."""
    report = {"protocol_version": client.protocol_version}
    templates = await client.list_resource_templates()
    report["templates"] = [t.uri_template for t in templates.resource_templates]

    seq = await client.call_tool("bash", {"command": SEQ_COMMAND})
    report["seq"] = result_json(seq)
    report["seq_links"] = [
        {"uri": b.uri, "name": b.name, "mime_type": b.mime_type}
        for b in seq.content
        if getattr(b, "type", None) == "resource_link"
    ]
    if report["seq_links"]:
        link = report["seq_links"][0]["uri"]
        data, report["spill_chunks"] = await read_chunks(client, link, link)
        with open(out, "wb") as f:
            f.write(data)

    binary = await call(client, "bash", {"command": BINARY_COMMAND})
    report["binary"] = binary
    sid = (binary.get("structured") or {}).get("session_id")
    uri = f"sandbox://{sid}/workspace/rand.bin"
    data, report["binary_chunks"] = await read_chunks(client, f"{uri}?length={CHUNK}", uri)
    report["binary_sha256"] = hashlib.sha256(data).hexdigest()
    report["binary_size"] = len(data)

    report["escapes"] = []
    for path in ESCAPES:
        try:
            result = await client.read_resource(f"sandbox://{sid}/workspace/{path}")
            report["escapes"].append({"path": path, "read": result.model_dump(mode="json")})
        except MCPError as e:
            report["escapes"].append({"path": path, "mcp_error": {"code": e.code, "message": e.message}})
    return report


def new_session_handle(result):
    """What a model reads from a result: `[new session <handle>: pass ...]`."""
    for text in result.get("text") or []:
        if text and text.startswith("[new session "):
            return text[len("[new session ") :].split(":", 1)[0]
    return None


async def chat(url, mode, name):
    """One chat: two calls, the second passing the handle back when a result named one."""
    async with http_client(None) as http:
        async with Client(streamable_http_client(url, http_client=http), mode=mode) as client:
            first = await call(
                client, "bash", {"command": f"echo ${{CHAT:-fresh}}; export CHAT={name}"}
            )
            handle = new_session_handle(first)
            arguments = {"command": 'echo "$CHAT"'}
            if handle:
                arguments["session"] = handle
            second = await call(client, "bash", arguments)
    return {"first": first, "second": second, "handle": handle}


async def calls(client):
    """What one connected client sees: its handshake, the tools, and a fixed list of calls."""
    report = {}
    report["protocol_version"] = client.protocol_version
    info = client.server_info
    report["server_name"] = info.name if info else None
    report["instructions"] = client.instructions
    listed = await client.list_tools()
    report["tools"] = [
        t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in listed.tools
    ]
    report["echo"] = await call(client, "bash", {"command": "echo hi"})
    report["set_state"] = await call(
        client, "bash", {"command": "cd /tmp && export SDK_VAR=kept"}
    )
    report["read_state"] = await call(client, "bash", {"command": 'echo "$PWD $SDK_VAR"'})
    report["exit_3"] = await call(client, "bash", {"command": "(exit 3)"})
    report["unknown_tool"] = await call(client, "no-such-tool", {})
    report["bad_arguments"] = await call(client, "bash", {"command": 5})
    return report


def main():
    parser = argparse.ArgumentParser()
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="Streamable HTTP endpoint")
    target.add_argument("--stdio", type=json.loads, help="JSON list: the server's command line")
    parser.add_argument("--session", help="X-Session-ID (HTTP only)")
    parser.add_argument("--mode", required=True, choices=["legacy", "auto", "2026-07-28"])
    parser.add_argument("--cancel", nargs=2, metavar=("FIFO", "MARKER"))
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--resources", metavar="OUT")
    args = parser.parse_args()
    if args.resources:
        report = asyncio.run(
            resources_scenario(args.url, args.stdio, args.session, args.mode, args.resources)
        )
        json.dump(report, sys.stdout)
        sys.stdout.write("\n")
        return
    if args.progress:
        report = asyncio.run(progress_scenario(args.url, args.stdio, args.session, args.mode))
        json.dump(report, sys.stdout)
        sys.stdout.write("\n")
        return
    if args.cancel:
        fifo, marker = args.cancel
        report = asyncio.run(
            cancel_scenario(args.url, args.stdio, args.session, args.mode, fifo, marker)
        )
        json.dump(report, sys.stdout)
        sys.stdout.write("\n")
        return
    if args.url and not args.session:
        parser.error("--url needs --session")
    report = asyncio.run(scenario(args.url, args.stdio, args.session, args.mode))
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
