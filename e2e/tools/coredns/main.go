// CoreDNS with only the plugins the local cluster's DNS needs: cluster names from the
// Kubernetes API, nothing forwarded anywhere (no forward/proxy plugin is linked in).
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

// The order plugins run in (a subset of CoreDNS's plugin.cfg order).
var directives = []string{
	"bind",
	"ready",
	"health",
	"errors",
	"log",
	"cache",
	"kubernetes",
}

func init() {
	dnsserver.Directives = directives
}

func main() {
	coremain.Run()
}
