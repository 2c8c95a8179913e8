package proto

import "fmt"

// Reason says why a flow stays on TCP or was revoked. Values are part of the
// protocol; add, never renumber.
type Reason uint16

const (
	ReasonNone            Reason = iota
	ReasonLoopback               // a loopback connection: the kernel is fast enough
	ReasonNotLocal               // the peer is not a guest on this host
	ReasonNoIntent               // the connecting side did not announce it (not a Shunt client)
	ReasonNoListener             // the accepting guest has no Shunt listener on that address
	ReasonPolicy                 // policy keeps this flow on TCP
	ReasonNotOwner               // the claimed tuple's source is not this guest's
	ReasonNoConntrack            // no conntrack entry for the tuple
	ReasonNotEstablished         // the conntrack entry is not ESTABLISHED
	ReasonTimeout                // the other end did not show up in time
	ReasonNoSpace                // the trust group's region is full
	ReasonCrossGroup             // the peers are in different trust groups
	ReasonGuestLimit             // the guest has as many flows as policy allows
	ReasonInternal               // hostd failed; see its log
	ReasonConntrackGone          // revoked: the conntrack entry was destroyed
	ReasonPolicyReload           // revoked: a policy reload forbids the flow
	ReasonPeerGone               // revoked: the other guest disconnected or died
	ReasonAdmin                  // revoked by an operator
	ReasonMalformed              // ERROR: the guest sent a malformed message
	ReasonNoHostd                // guest side: hostd unreachable
	ReasonDisabled               // guest side: Shunt disabled by configuration
	ReasonGuestQuota             // the guest has used its quota of ring memory or flow slots
	ReasonVersion                // the guest library and hostd share no protocol version
	ReasonControlLimit           // the guest is over a control-plane limit (sessions, listeners, intents, pending opens)
	ReasonFirewall               // v3: the firewall's ruleset changed; back on the rings once the lease carried packets both ways under it
	ReasonShutdown               // v3: hostd is stopping (or gave up the flow's region)
	ReasonMigrating              // v3: the guest (a VM) is migrating; back on the rings once it arrived
	ReasonNotGuest               // ERROR: the connecting process is not in the guest's network namespace
	ReasonPeerUnreachable        // v3: the other end is a guest of a peer host whose hostd is down or refuses (docs/crosshost.md)
	ReasonVsockPair              // v3: a vsock-stretch VM to a peer host's guest: not built (docs/vsock.md); no longer sent between two such VMs
	ReasonVsockDown              // v3: the VM's vsock device has no hypervisor front-end (QEMU's died with an earlier hostd; docs/vsock.md)
	numReasons
)

var reasonNames = [...]string{
	"none", "loopback", "not-local", "no-intent", "no-listener", "policy", "not-owner",
	"no-conntrack", "not-established", "timeout", "no-space", "cross-group", "guest-limit",
	"internal", "conntrack-gone", "policy-reload", "peer-gone", "admin", "malformed",
	"no-hostd", "disabled", "guest-quota", "version", "control-limit", "firewall", "shutdown",
	"migrating", "not-guest", "peer-unreachable", "vsock-pair", "vsock-down",
}

func (r Reason) String() string {
	if r < numReasons {
		return reasonNames[r]
	}
	return fmt.Sprintf("reason(%d)", uint16(r))
}

// Reasons lists every known reason, for metrics that pre-create counters.
func Reasons() []Reason {
	out := make([]Reason, 0, numReasons)
	for r := Reason(0); r < numReasons; r++ {
		out = append(out, r)
	}
	return out
}
