// Drives cli-mcp-server with an official MCP TypeScript SDK:
//   --sdk v1: @modelcontextprotocol/sdk (protocol up to 2025-11-25, initialize handshake);
//   --sdk v2: @modelcontextprotocol/client (adds 2026-07-28, negotiated with server/discover).
//
// Prints one JSON object on stdout with what the SDK saw; server/tests/sdk.rs asserts on it,
// and on stderr, where the SDK's JSON Schema validator (Ajv) warns about schema problems
// such as unknown formats.
//
// CommonJS on purpose: the packages live in a cache outside the repository, which `require`
// finds through NODE_PATH (ES module resolution ignores NODE_PATH).
//
// Usage: node client.cjs --sdk v1|v2 --url URL --session SID [--mode legacy|auto|2026-07-28]
//        node client.cjs --sdk v1|v2 --stdio '["cli-mcp-server", "--transport", "stdio", ...]'
//        node client.cjs --sdk v1|v2 --url URL --session SID [--mode M] --cancel FIFO --marker MARKER
//          (cancels a long call the SDK's way, an AbortSignal, then calls again)
//        node client.cjs --sdk v1|v2 --url URL --session SID [--mode M] --progress yes
//          (a slow command with an onprogress callback)
//        node client.cjs --sdk v1|v2 --url URL --session SID [--mode M] --resources OUT
//          (a truncated output's spill and a binary workspace file read back in chunks; the
//          spill's bytes are written to OUT for the test to compare)
'use strict';

function parseArgs(argv) {
  const out = { mode: 'legacy' };
  for (let i = 0; i < argv.length; i += 2) {
    const key = argv[i];
    const value = argv[i + 1];
    if (!key.startsWith('--') || value === undefined) {
      throw new Error(`bad argument ${JSON.stringify(key)}; usage: --sdk v1|v2 --url URL --session SID [--mode M]`);
    }
    out[key.slice(2)] = value;
  }
  if (!out.sdk) throw new Error('missing --sdk');
  if (out.stdio !== undefined) {
    out.stdio = JSON.parse(out.stdio);
  } else if (!out.url || !out.session) {
    throw new Error('give --url and --session, or --stdio');
  }
  if ((out.cancel === undefined) !== (out.marker === undefined)) {
    throw new Error('--cancel FIFO goes with --marker MARKER');
  }
  return out;
}

function loadSdk(which) {
  if (which === 'v1') {
    const { Client } = require('@modelcontextprotocol/sdk/client/index.js');
    const { StreamableHTTPClientTransport } = require('@modelcontextprotocol/sdk/client/streamableHttp.js');
    const { StdioClientTransport } = require('@modelcontextprotocol/sdk/client/stdio.js');
    return { Client, StreamableHTTPClientTransport, StdioClientTransport };
  }
  if (which === 'v2') {
    const { Client, StreamableHTTPClientTransport } = require('@modelcontextprotocol/client');
    const { StdioClientTransport } = require('@modelcontextprotocol/client/stdio');
    return { Client, StreamableHTTPClientTransport, StdioClientTransport };
  }
  throw new Error(`--sdk must be v1 or v2, not ${JSON.stringify(which)}`);
}

function clientOptions(sdk, mode) {
  if (sdk === 'v1') {
    if (mode !== 'legacy') throw new Error('@modelcontextprotocol/sdk only speaks the initialize handshake: use --mode legacy');
    return {};
  }
  const negotiation = mode === 'legacy' || mode === 'auto' ? mode : { pin: mode };
  return { versionNegotiation: { mode: negotiation } };
}

async function connect(sdkName, sdk, target, session, mode) {
  let transport;
  if (Array.isArray(target)) {
    // stderr: 'inherit', so the server's log lands in this script's stderr for the test to show.
    transport = new sdk.StdioClientTransport({ command: target[0], args: target.slice(1), stderr: 'inherit' });
  } else {
    const headers = session ? { 'X-Session-ID': session } : {};
    transport = new sdk.StreamableHTTPClientTransport(new URL(target), { requestInit: { headers } });
  }
  const client = new sdk.Client({ name: `cli-mcp-sdk-test-${sdkName}`, version: '1.0.0' }, clientOptions(sdkName, mode));
  await client.connect(transport);
  return { client, transport };
}

async function call(client, name, args) {
  try {
    const r = await client.callTool({ name, arguments: args });
    return {
      is_error: Boolean(r.isError),
      text: (r.content || []).map((b) => (b.type === 'text' ? b.text : null)),
      structured: r.structuredContent === undefined ? null : r.structuredContent,
    };
  } catch (e) {
    if (typeof e.code === 'number') return { mcp_error: { code: e.code, message: e.message } };
    throw e;
  }
}

// What a model reads from a result: `[new session <handle>: pass ...]`.
function newSessionHandle(result) {
  for (const text of result.text || []) {
    if (typeof text === 'string' && text.startsWith('[new session ')) {
      return text.slice('[new session '.length).split(':', 1)[0];
    }
  }
  return null;
}

// One chat: two calls, the second passing the handle back when a result named one.
async function chat(args, sdk, name) {
  const { client, transport } = await connect(args.sdk, sdk, args.url, null, args.mode);
  const first = await call(client, 'bash', { command: `echo \${CHAT:-fresh}; export CHAT=${name}` });
  const handle = newSessionHandle(first);
  const second = await call(client, 'bash', {
    command: 'echo "$CHAT"',
    ...(handle ? { session: handle } : {}),
  });
  const mcpSessionId = transport.sessionId === undefined ? null : transport.sessionId;
  await client.close();
  return { first, second, handle, mcp_session_id: mcpSessionId };
}

// A callTool with an AbortSignal, in either SDK's signature.
function callWithSignal(sdkName, client, params, signal) {
  return sdkName === 'v1' ? client.callTool(params, undefined, { signal }) : client.callTool(params, { signal });
}

// Starts a 30 s command, aborts it once it runs, and calls again at once. The command writes
// its pid to FIFO when it starts and creates MARKER if it ever ends on its own. Times are
// seconds after the abort.
async function cancelScenario(args, sdk) {
  const fs = require('fs');
  const report = {};
  const { client, transport } = await connect(args.sdk, sdk, args.url, args.session, args.mode);
  report.protocol_version =
    typeof client.getNegotiatedProtocolVersion === 'function'
      ? client.getNegotiatedProtocolVersion()
      : transport.protocolVersion;
  report.set_state = await call(client, 'bash', { command: 'cd /tmp && export CANCEL_VAR=kept' });
  const controller = new AbortController();
  const command = `sh -c 'echo $$ > ${args.cancel}; exec sleep 30' && touch ${args.marker}`;
  const long = callWithSignal(args.sdk, client, { name: 'bash', arguments: { command } }, controller.signal).then(
    (r) => ({ finished: r }),
    (e) => ({ rejected: String(e && e.message ? e.message : e) }),
  );
  // Opening a FIFO for reading completes once the command opens it for writing.
  report.pid = Number((await fs.promises.readFile(args.cancel, 'utf8')).trim());
  const abortedAt = performance.now();
  controller.abort('the test cancels the call');
  const settled = await long;
  report.cancel_returned_after = (performance.now() - abortedAt) / 1000;
  report.long_call = settled;
  report.next = await call(client, 'bash', { command: 'echo "ok $PWD $CANCEL_VAR"' });
  report.next_answered_after = (performance.now() - abortedAt) / 1000;
  await client.close();
  return report;
}

// A callTool with an onprogress callback (the SDK then sends a progress token), in either
// SDK's signature.
function callWithProgress(sdkName, client, params, onprogress) {
  return sdkName === 'v1' ? client.callTool(params, undefined, { onprogress }) : client.callTool(params, { onprogress });
}

// A slow command with a progress callback. Times are seconds since the call started.
async function progressScenario(args, sdk) {
  const report = {};
  const target = args.stdio !== undefined ? args.stdio : args.url;
  const { client, transport } = await connect(args.sdk, sdk, target, args.session, args.mode);
  report.protocol_version =
    typeof client.getNegotiatedProtocolVersion === 'function'
      ? client.getNegotiatedProtocolVersion()
      : transport.protocolVersion;
  const seen = [];
  const started = performance.now();
  const command = 'for i in 1 2 3; do echo line$i; sleep 1.2; done';
  const r = await callWithProgress(args.sdk, client, { name: 'bash', arguments: { command } }, (p) => {
    seen.push({
      progress: p.progress,
      total: p.total === undefined ? null : p.total,
      message: p.message === undefined ? null : p.message,
      at: (performance.now() - started) / 1000,
    });
  });
  report.with_token_took = (performance.now() - started) / 1000;
  report.with_token = {
    is_error: Boolean(r.isError),
    text: (r.content || []).map((b) => (b.type === 'text' ? b.text : null)),
    structured: r.structuredContent === undefined ? null : r.structuredContent,
  };
  report.notifications = seen;
  await client.close();
  return report;
}

function resultJson(r) {
  return {
    is_error: Boolean(r.isError),
    text: (r.content || []).map((b) => (b.type === 'text' ? b.text : null)),
    structured: r.structuredContent === undefined ? null : r.structuredContent,
  };
}

const SEQ_COMMAND = 'seq 1 200000';
const BINARY_COMMAND =
  'head -c 300000 /dev/urandom > rand.bin && sha256sum rand.bin && ln -sf /etc/passwd passwd-link';
const ESCAPES = ['passwd-link', `${'..%2F'.repeat(16)}etc%2Fpasswd`, `${'../'.repeat(16)}etc/passwd`];
const CHUNK = 100000;

// Reads a resource whole: firstUri as given, then uri?offset=N&length=CHUNK as each chunk's
// `_meta.next` says. Returns the bytes and what each chunk looked like.
async function readChunks(client, firstUri, uri) {
  const parts = [];
  const chunks = [];
  let target = firstUri;
  for (;;) {
    const result = await client.readResource({ uri: target });
    if (result.contents.length !== 1) throw new Error(`${result.contents.length} contents for ${target}`);
    const c = result.contents[0];
    const meta = c._meta || {};
    const kind = c.blob !== undefined ? 'blob' : 'text';
    parts.push(kind === 'blob' ? Buffer.from(c.blob, 'base64') : Buffer.from(c.text, 'utf8'));
    chunks.push({ uri: c.uri, kind, mime_type: c.mimeType === undefined ? null : c.mimeType, meta });
    if (meta.next === undefined || chunks.length > 100) return { data: Buffer.concat(parts), chunks };
    target = `${uri}?offset=${meta.next}&length=${CHUNK}`;
  }
}

async function resourcesScenario(args, sdk) {
  const fs = require('fs');
  const crypto = require('crypto');
  const report = {};
  const target = args.stdio !== undefined ? args.stdio : args.url;
  const { client, transport } = await connect(args.sdk, sdk, target, args.session, args.mode);
  report.protocol_version =
    typeof client.getNegotiatedProtocolVersion === 'function'
      ? client.getNegotiatedProtocolVersion()
      : transport.protocolVersion;
  report.templates = (await client.listResourceTemplates()).resourceTemplates.map((t) => t.uriTemplate);

  const seq = await client.callTool({ name: 'bash', arguments: { command: SEQ_COMMAND } });
  report.seq = resultJson(seq);
  report.seq_links = (seq.content || [])
    .filter((b) => b.type === 'resource_link')
    .map((b) => ({ uri: b.uri, name: b.name, mime_type: b.mimeType === undefined ? null : b.mimeType }));
  if (report.seq_links.length > 0) {
    const link = report.seq_links[0].uri;
    const { data, chunks } = await readChunks(client, link, link);
    report.spill_chunks = chunks;
    fs.writeFileSync(args.resources, data);
  }

  const binary = await call(client, 'bash', { command: BINARY_COMMAND });
  report.binary = binary;
  const sid = binary.structured ? binary.structured.session_id : null;
  const uri = `sandbox://${sid}/workspace/rand.bin`;
  const { data, chunks } = await readChunks(client, `${uri}?length=${CHUNK}`, uri);
  report.binary_chunks = chunks;
  report.binary_sha256 = crypto.createHash('sha256').update(data).digest('hex');
  report.binary_size = data.length;

  report.escapes = [];
  for (const path of ESCAPES) {
    try {
      const read = await client.readResource({ uri: `sandbox://${sid}/workspace/${path}` });
      report.escapes.push({ path, read });
    } catch (e) {
      if (typeof e.code !== 'number') throw e;
      report.escapes.push({ path, mcp_error: { code: e.code, message: e.message } });
    }
  }
  await client.close();
  return report;
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const sdk = loadSdk(args.sdk);
  if (args.resources !== undefined) {
    process.stdout.write(JSON.stringify(await resourcesScenario(args, sdk)) + '\n');
    return;
  }
  if (args.progress !== undefined) {
    process.stdout.write(JSON.stringify(await progressScenario(args, sdk)) + '\n');
    return;
  }
  if (args.cancel !== undefined) {
    process.stdout.write(JSON.stringify(await cancelScenario(args, sdk)) + '\n');
    return;
  }
  const report = {};
  const target = args.stdio !== undefined ? args.stdio : args.url;
  const { client, transport } = await connect(args.sdk, sdk, target, args.session, args.mode);
  report.protocol_version =
    typeof client.getNegotiatedProtocolVersion === 'function'
      ? client.getNegotiatedProtocolVersion()
      : transport.protocolVersion;
  report.mcp_session_id = transport.sessionId === undefined ? null : transport.sessionId;
  const info = client.getServerVersion();
  report.server_name = info ? info.name : null;
  report.instructions = client.getInstructions() === undefined ? null : client.getInstructions();
  report.tools = (await client.listTools()).tools;
  report.echo = await call(client, 'bash', { command: 'echo hi' });
  report.set_state = await call(client, 'bash', { command: 'cd /tmp && export SDK_VAR=kept' });
  report.read_state = await call(client, 'bash', { command: 'echo "$PWD $SDK_VAR"' });
  report.exit_3 = await call(client, 'bash', { command: '(exit 3)' });
  report.unknown_tool = await call(client, 'no-such-tool', {});
  report.bad_arguments = await call(client, 'bash', { command: 5 });
  await client.close();

  if (args.stdio === undefined) {
    // Two chats from one configuration without X-Session-ID: each must get its own shell.
    report.chats = [await chat(args, sdk, 'a'), await chat(args, sdk, 'b')];
  }

  process.stdout.write(JSON.stringify(report) + '\n');
}

main().catch((e) => {
  process.stderr.write(`client failed: ${e && e.stack ? e.stack : e}\n`);
  process.exit(1);
});
