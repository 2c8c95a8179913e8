package preflight

import (
	"context"
	"fmt"
	"time"

	"github.com/shuntnet/shunt/hostd/peers"
)

// checkPeering: the peering block's TLS material loads, this hostd's own
// certificate verifies against the CA as its peers will check it, and it
// is not about to expire (docs/crosshost.md).
func checkPeering(_ context.Context, e *env) {
	pc := e.cfg.Peering
	if pc == nil {
		return
	}
	info, err := peers.Inspect(pc)
	if err != nil {
		e.problem(err.Error(), "give the peering block a certificate signed by its ca, with this hostd's name as its first DNS name, for server and client authentication")
		return
	}
	for _, p := range pc.Peers {
		if p.Name == info.Name {
			e.problem(fmt.Sprintf("peer %q is this hostd's own name", p.Name), "remove that peer block, or give this hostd a certificate of its own name")
		}
	}
	if left := time.Until(info.NotAfter); left < 30*24*time.Hour {
		e.warn(fmt.Sprintf("this hostd's peering certificate expires %s", info.NotAfter.UTC().Format(time.RFC3339)),
			"renew it and run hostd reload (new handshakes use it)")
	}
	e.ok("peering as %s with %s; certificate valid until %s", info.Name, plural(len(pc.Peers), "peer"), info.NotAfter.UTC().Format("2006-01-02"))
}
