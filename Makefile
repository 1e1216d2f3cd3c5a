# cli-mcp — the two commands a newcomer needs are `make run` and `make test`.
# Everything here needs root (network namespaces for the local Kubernetes); CI runs as root.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
CARGO ?= cargo
TARGET_DIR := $(or $(CARGO_TARGET_DIR),$(CURDIR)/target)
CLUSTER := $(TARGET_DIR)/debug/cli-mcp-cluster

.PHONY: help run cluster prereqs test test-unit lint fmt build control-plane tools gvisor images pins publish crdgen bundle bench clean

# Where a release goes: `make publish` pushes the images, the chart and the bundle image there
# and pins the manifests to what it pushed (docs/install.md). The manifests in git name it.
RELEASE_REGISTRY := quay.io/cli-mcp
REGISTRY ?= $(RELEASE_REGISTRY)
# The release's image tag and chart version; empty: the workspace version (Cargo.toml).
VERSION ?=

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

run: ## host prereqs, local Kubernetes (real node + project images; CLI_MCP_NODE=process: process kubelet) + operator + sample instance until Ctrl-C; prints how to reach MCP
	hack/run.sh

cluster: ## host prereqs, then only the local Kubernetes (real node + project images; CLI_MCP_NODE=process: process kubelet), until Ctrl-C
	hack/cluster-up.sh

# hack/run.sh and hack/cluster-up.sh call hack/prereqs.sh themselves; silent when nothing is missing.
prereqs: ## install and set what the host lacks (apt packages, IPv4 forwarding, routes; root)
	@hack/prereqs.sh $(PREREQS_FLAGS)

test: PREREQS_FLAGS := --test
test: prereqs lint control-plane tools gvisor build ## everything: lint, unit, integration and end-to-end tests on one local cluster
	$(CARGO) test --workspace --no-run
	CARGO="$(CARGO)" $(CLUSTER) exec -- hack/test-lanes.sh

test-unit: ## tests that need no cluster (api, agent)
	$(CARGO) test -p cli-mcp-api -p cli-mcp-agent

lint: ## rustfmt check, clippy with warnings as errors, and the shape check (hack/shape-check.py)
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	python3 hack/shape_check_test.py
	python3 hack/shape-check.py

fmt: ## format the code
	$(CARGO) fmt --all

build: ## debug binaries of every crate (the local cluster runs these)
	$(CARGO) build --workspace --bins

control-plane: ## kube-apiserver, controller-manager, scheduler, etcd, kubectl from the Go module proxy (cached)
	@bin="$$(hack/build-control-plane.sh | tail -n1)"; \
	link=/usr/local/bin/kubectl; \
	if [[ ! -e $$link || "$$(readlink $$link)" == */control-plane/*/bin/kubectl ]]; then \
	  ln -sfn "$$bin/kubectl" $$link; echo "kubectl -> $$bin/kubectl (sandbox pods of the local cluster use it)"; \
	else echo "keeping the existing $$link"; fi

bench: prereqs control-plane tools gvisor build ## speed and memory figures, printed as tables (see docs/benchmarks.md)
	$(CARGO) build --release -p cli-mcp-agent -p cli-mcp-server -p cli-mcp-operator -p cli-mcp-proxy -p cli-mcp-bench -p cli-mcp-kubelet
	$(TARGET_DIR)/release/cli-mcp-bench agent --agent $(TARGET_DIR)/release/cli-mcp-agent
	$(TARGET_DIR)/release/cli-mcp-bench images
	env -u CLI_MCP_KUBECONFIG $(TARGET_DIR)/release/cli-mcp-bench cluster --bin-dir $(TARGET_DIR)/release --kubelet $(TARGET_DIR)/debug/cli-mcp-kubelet
	env -u CLI_MCP_KUBECONFIG $(TARGET_DIR)/release/cli-mcp-bench cluster --node real --runtimes runc,gvisor --bin-dir $(TARGET_DIR)/release --kubelet $(TARGET_DIR)/debug/cli-mcp-kubelet --starts 20 --calls 300 --sessions 50 --commands 50 --admission-limit 50 --idle 200 --arrivals 2
	env -u CLI_MCP_KUBECONFIG CLI_MCP_CLUSTER_BIN=$(TARGET_DIR)/debug/cli-mcp-cluster $(TARGET_DIR)/release/cli-mcp-bench proxy --proxy $(TARGET_DIR)/release/cli-mcp-proxy
	env -u CLI_MCP_KUBECONFIG $(TARGET_DIR)/release/cli-mcp-bench scale --bin-dir $(TARGET_DIR)/release --kubelet $(TARGET_DIR)/release/cli-mcp-kubelet
	$(CARGO) bench -p cli-mcp-server --bench server
	$(CARGO) bench -p cli-mcp-operator --bench operator

tools: ## helm, kustomize, operator-sdk, the image registry and crane from the Go module proxy (cached)
	@hack/build-helm-kustomize.sh >/dev/null
	@hack/build-operator-sdk.sh >/dev/null
	@hack/build-registry.sh >/dev/null

# Built once here, before the test lanes start several real nodes at once, each of which
# would otherwise build it (the real node registers it; `make run` builds it as it starts).
gvisor: ## gVisor's runsc and containerd shim from the Go module proxy (cached), the real node's sandboxed runtime
	@hack/build-gvisor.sh >/dev/null

images: ## OCI image archives of operator, server, proxy and sandbox, no container engine (cached; images/README.md)
	$(CARGO) build --release -p cli-mcp-operator -p cli-mcp-server -p cli-mcp-proxy -p cli-mcp-agent
	@hack/build-images.sh

publish: ## push the images, the Helm chart (OCI) and the OLM bundle image to REGISTRY=host[:port]/path (default RELEASE_REGISTRY), VERSION=…, and pin config/, charts/ and bundle/ to their digests
	REGISTRY="$(REGISTRY)" VERSION="$(VERSION)" hack/publish.sh

pins: ## pin the images' Debian packages to the archive's current versions (root; rewrites images/*/debian-packages.<arch>.lock)
	images/debian-pins.sh refresh

crdgen: ## regenerate the CRD YAML (config/crd, chart) from the Rust types
	hack/crdgen.sh

bundle: ## regenerate the OLM bundle (bundle/) from config/ (docs/olm.md)
	hack/olm-bundle.sh

clean: ## remove build outputs (the control-plane cache outside the repo is kept)
	$(CARGO) clean
	rm -rf .run
