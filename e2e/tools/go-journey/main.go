// go-journey is the design's client, a Go service, as the e2e test drives it: the official Go
// MCP SDK's streamable HTTP client with an http.Client whose RoundTripper adds X-Session-ID
// and a bearer token to every request, a few bash calls, then DELETE /sessions/{id}.
//
// It judges nothing: it prints what it saw as JSON and the Rust test asserts on it, so a
// failure message shows the whole exchange. Two phases, one JSON line each on stdout:
//
//  1. connect, list tools, the calls of -commands (a JSON array of strings), in order;
//  2. after a line on stdin (the test has looked at the session's pod meanwhile):
//     DELETE /sessions/{id}, and every HTTP request the client sent.
//
// A call's transport failure is printed as its "error", not fatal, so the test names the
// call that failed; only a failed connect or bad flags exit non-zero.
package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
)

// seen is one HTTP request as the server got it (never the token itself).
type seen struct {
	Method    string `json:"method"`
	Path      string `json:"path"`
	SessionID string `json:"x_session_id"`
	Bearer    bool   `json:"bearer"`
	Status    int    `json:"status"`
	Error     string `json:"error,omitempty"`
}

// inject adds the session header and the bearer token to every request, and records it.
type inject struct {
	base    http.RoundTripper
	session string
	token   string

	mu   sync.Mutex
	seen []seen
}

func (t *inject) RoundTrip(req *http.Request) (*http.Response, error) {
	// A RoundTripper must not modify the caller's request.
	r := req.Clone(req.Context())
	r.Header.Set("X-Session-ID", t.session)
	r.Header.Set("Authorization", "Bearer "+t.token)
	resp, err := t.base.RoundTrip(r)
	s := seen{
		Method:    r.Method,
		Path:      r.URL.Path,
		SessionID: r.Header.Get("X-Session-ID"),
		Bearer:    r.Header.Get("Authorization") == "Bearer "+t.token,
	}
	if err != nil {
		s.Error = err.Error()
	} else {
		s.Status = resp.StatusCode
	}
	t.mu.Lock()
	t.seen = append(t.seen, s)
	t.mu.Unlock()
	return resp, err
}

type call struct {
	Command string          `json:"command"`
	Result  json.RawMessage `json:"result,omitempty"`
	Error   string          `json:"error,omitempty"`
}

type phase1 struct {
	ProtocolVersion string   `json:"protocol_version"`
	Server          string   `json:"server"`
	Instructions    string   `json:"instructions"`
	Tools           []string `json:"tools"`
	Calls           []call   `json:"calls"`
}

type phase2 struct {
	DeleteStatus int    `json:"delete_status"`
	DeleteError  string `json:"delete_error,omitempty"`
	Requests     []seen `json:"requests"`
}

type options struct {
	endpoint, connect, caFile, tokenFile, session, commands string
}

func main() {
	var o options
	flag.StringVar(&o.endpoint, "endpoint", "", "the MCP endpoint, https://<service host>:<port>/mcp")
	flag.StringVar(&o.connect, "connect", "", "host:port every connection goes to (the test's forward to the Service); default: the endpoint's")
	flag.StringVar(&o.caFile, "ca", "", "PEM file of the instance CA; default: none (plain HTTP)")
	flag.StringVar(&o.tokenFile, "token-file", "", "file holding the bearer token")
	flag.StringVar(&o.session, "session", "", "the X-Session-ID of every request")
	flag.StringVar(&o.commands, "commands", "[]", "JSON array of bash commands to call in order")
	flag.Parse()
	if err := run(o); err != nil {
		fmt.Fprintln(os.Stderr, "go-journey:", err)
		os.Exit(1)
	}
}

// httpClient trusts only the instance CA (-ca; without it, plain HTTP to a local server),
// dials only o.connect (the TLS name stays the Service's, which the certificate names) and
// ignores proxy variables.
func httpClient(o options, rt *inject) (*http.Client, error) {
	tlsConfig := &tls.Config{MinVersion: tls.VersionTLS12}
	if o.caFile != "" {
		pem, err := os.ReadFile(o.caFile)
		if err != nil {
			return nil, err
		}
		tlsConfig.RootCAs = x509.NewCertPool()
		if !tlsConfig.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("no certificate in %s", o.caFile)
		}
	}
	dialer := &net.Dialer{Timeout: 10 * time.Second}
	rt.base = &http.Transport{
		Proxy: nil,
		DialContext: func(ctx context.Context, network, address string) (net.Conn, error) {
			if o.connect != "" {
				address = o.connect
			}
			return dialer.DialContext(ctx, network, address)
		},
		TLSClientConfig:     tlsConfig,
		TLSHandshakeTimeout: 10 * time.Second,
	}
	return &http.Client{Transport: rt, Timeout: 2 * time.Minute}, nil
}

func run(o options) error {
	token, err := os.ReadFile(o.tokenFile)
	if err != nil {
		return err
	}
	var commands []string
	if err := json.Unmarshal([]byte(o.commands), &commands); err != nil {
		return fmt.Errorf("-commands: %w", err)
	}
	rt := &inject{session: o.session, token: strings.TrimSpace(string(token))}
	hc, err := httpClient(o, rt)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	client := mcp.NewClient(&mcp.Implementation{Name: "cli-mcp-go-journey", Version: "0"}, nil)
	transport := &mcp.StreamableClientTransport{Endpoint: o.endpoint, HTTPClient: hc, MaxRetries: -1}
	cs, err := client.Connect(ctx, transport, nil)
	if err != nil {
		return fmt.Errorf("connect to %s: %w", o.endpoint, err)
	}
	out := phase1{Tools: []string{}, Calls: []call{}}
	if init := cs.InitializeResult(); init != nil {
		out.ProtocolVersion = init.ProtocolVersion
		out.Instructions = init.Instructions
		if init.ServerInfo != nil {
			out.Server = init.ServerInfo.Name
		}
	}
	tools, err := cs.ListTools(ctx, nil)
	if err != nil {
		return fmt.Errorf("tools/list: %w", err)
	}
	for _, t := range tools.Tools {
		out.Tools = append(out.Tools, t.Name)
	}
	for _, c := range commands {
		out.Calls = append(out.Calls, bash(ctx, cs, c))
	}
	if err := cs.Close(); err != nil {
		return fmt.Errorf("closing the MCP session: %w", err)
	}
	if err := emit(out); err != nil {
		return err
	}

	// The test looks at the session's pod, then says go on.
	if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
		return fmt.Errorf("waiting for the test's go-ahead on stdin: %w", err)
	}
	status, derr := deleteSession(ctx, hc, o)
	end := phase2{DeleteStatus: status}
	if derr != nil {
		end.DeleteError = derr.Error()
	}
	rt.mu.Lock()
	end.Requests = rt.seen
	rt.mu.Unlock()
	return emit(end)
}

func bash(ctx context.Context, cs *mcp.ClientSession, command string) call {
	c := call{Command: command}
	res, err := cs.CallTool(ctx, &mcp.CallToolParams{
		Name:      "bash",
		Arguments: map[string]any{"command": command},
	})
	if err != nil {
		c.Error = err.Error()
		return c
	}
	raw, err := json.Marshal(res)
	if err != nil {
		c.Error = "encoding the result: " + err.Error()
		return c
	}
	c.Result = raw
	return c
}

// deleteSession ends the shell as the design's client does on finish: a plain DELETE
// through the same client, so it carries the same headers.
func deleteSession(ctx context.Context, hc *http.Client, o options) (int, error) {
	base := strings.TrimSuffix(o.endpoint, "/mcp")
	req, err := http.NewRequestWithContext(ctx, http.MethodDelete, base+"/sessions/"+o.session, nil)
	if err != nil {
		return 0, err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	return resp.StatusCode, nil
}

func emit(v any) error {
	line, err := json.Marshal(v)
	if err != nil {
		return err
	}
	_, err = fmt.Println(string(line))
	return err
}
