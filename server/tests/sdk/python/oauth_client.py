"""MCP authorization with the official MCP Python SDK against cli-mcp-server.

The client starts without a token. The SDK's OAuthClientProvider must: get the 401, read the
resource_metadata URL from WWW-Authenticate, fetch the protected resource metadata, find the
authorization server in it, fetch that server's metadata, register (dynamic client
registration), run the authorization code grant with PKCE and RFC 8707 `resource`, and retry
with the token it got. The test's authorization server answers /authorize with a redirect at
once (no person logs in); the redirect handler here reads the code from it.

Prints one JSON object: every HTTP request the SDK made (method, URL, status, and the
WWW-Authenticate of a 401) and the results of a few bash calls. server/tests/oauth.rs checks it.

Usage: oauth_client.py --url URL --session SID --ca CA.pem
"""

import argparse
import asyncio
import json
import ssl
import sys
from urllib.parse import parse_qs, urlsplit

import httpx2
from mcp import Client
from mcp.client.auth import AuthorizationCodeResult, OAuthClientProvider, TokenStorage
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.auth import OAuthClientMetadata
from mcp.shared.exceptions import MCPError

REDIRECT_URI = "http://127.0.0.1:9/callback"


class Memory(TokenStorage):
    def __init__(self):
        self.tokens = None
        self.client = None

    async def get_tokens(self):
        return self.tokens

    async def set_tokens(self, tokens):
        self.tokens = tokens

    async def get_client_info(self):
        return self.client

    async def set_client_info(self, client_info):
        self.client = client_info


def result_json(result):
    return {
        "is_error": bool(result.is_error),
        "text": [getattr(block, "text", None) for block in result.content],
        "structured": result.structured_content,
    }


async def call(client, command):
    try:
        return result_json(await client.call_tool("bash", {"command": command}))
    except MCPError as e:
        return {"mcp_error": {"code": e.code, "message": e.message}}


async def main_async(url, session, ca, mode):
    tls = ssl.create_default_context(cafile=ca)
    requests = []
    redirect = {}

    async def record(response):
        requests.append(
            {
                "method": response.request.method,
                "url": str(response.request.url),
                "status": response.status_code,
                "www_authenticate": response.headers.get("www-authenticate"),
            }
        )

    async def redirect_handler(authorization_url):
        redirect["authorization_url"] = authorization_url
        async with httpx2.AsyncClient(verify=tls, trust_env=False) as h:
            answer = await h.get(authorization_url)
        location = answer.headers.get("location", "")
        redirect["location"] = location
        query = parse_qs(urlsplit(location).query)
        redirect["params"] = {k: v[0] for k, v in query.items()}

    async def callback_handler():
        p = redirect.get("params", {})
        return AuthorizationCodeResult(code=p.get("code", ""), state=p.get("state"), iss=p.get("iss"))

    oauth = OAuthClientProvider(
        server_url=url,
        client_metadata=OAuthClientMetadata(
            client_name="cli-mcp oauth test",
            redirect_uris=[REDIRECT_URI],
            grant_types=["authorization_code"],
            response_types=["code"],
            token_endpoint_auth_method="none",
        ),
        storage=Memory(),
        redirect_handler=redirect_handler,
        callback_handler=callback_handler,
    )
    report = {}
    async with httpx2.AsyncClient(
        headers={"X-Session-ID": session},
        auth=oauth,
        verify=tls,
        trust_env=False,
        timeout=httpx2.Timeout(30, read=120),
        event_hooks={"response": [record]},
    ) as http:
        try:
            async with Client(streamable_http_client(url, http_client=http), mode=mode) as client:
                report["protocol_version"] = client.protocol_version
                report["echo"] = await call(client, "echo hi")
                report["set_state"] = await call(client, "export OAUTH_VAR=kept")
                report["read_state"] = await call(client, 'echo "$OAUTH_VAR"')
        except BaseException:
            # What the SDK got as far as, for the test's failure message.
            json.dump({"requests_before_the_error": requests, "redirect": redirect}, sys.stderr)
            sys.stderr.write("\n")
            raise
    report["requests"] = requests
    report["authorization_url"] = redirect.get("authorization_url")
    report["redirect_params"] = redirect.get("params")
    return report


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--session", required=True)
    parser.add_argument("--ca", required=True, help="PEM CA of the server and the authorization server")
    parser.add_argument("--mode", default="legacy", choices=["legacy", "auto"])
    args = parser.parse_args()
    report = asyncio.run(main_async(args.url, args.session, args.ca, args.mode))
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
