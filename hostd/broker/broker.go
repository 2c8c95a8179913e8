package broker

import (
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/hostd/metrics"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
)

// Session is one control channel of a guest. Send must not block: it queues
// the message, and drops the session if the guest does not keep up.
type Session interface {
	Send(m proto.Msg)
	Guest() *Guest
}

// Options tune the broker.
type Options struct {
	PairingTimeout time.Duration // how long one side waits for the other
	LookupTimeout  time.Duration // how long to wait for conntrack to show ESTABLISHED
	RememberFor    time.Duration // how long a timeout verdict is remembered
	// FirewallPoll is how often connections waiting for proof of passage
	// have their conntrack marks read; 0 = 300ms.
	FirewallPoll time.Duration
	// ProofOrig and ProofReply are the conntrack mark bits hostd's proof
	// chains set when a packet of that direction went past the operator's
	// filter (hostd/mark); 0: no proof (no ruleset watch), and no gate.
	ProofOrig, ProofReply uint32
	// ProofMaxAge bounds how long a connection may use the rings without
	// its lease showing packets past the filter both ways; 0 =
	// DefaultProofMaxAge.
	ProofMaxAge time.Duration
	// Witness, if set, must have seen the connection's SYN enter through
	// the active guest's own interface (hostd/witness).
	Witness interface {
		Origin(src, dst netip.AddrPort) (int, error)
	}
	// Remote, if set, says which peer host speaks for an address that no
	// local guest owns (remote.go); nil: no peers.
	Remote Remote
	// MarkMask is the part of the conntrack mark hostd sets (hostd/mark):
	// a guest's Mark is compared with these bits, its CTMark with the
	// others. 0 when hostd does not mark.
	MarkMask uint32
	// Limits bound what one guest may hold (zero fields: DefaultLimits).
	Limits Limits
	// PairRegionLinger is how long a pair region (and the guests'
	// mappings of it) outlives its last flow, so that a pair that opens
	// short connections one after the other does not make, hand over and
	// map a region for each; 0 = DefaultPairRegionLinger, < 0 = none.
	PairRegionLinger time.Duration
	// RevokeGrace is how long the ends of a retired pair region's flows
	// have to leave its rings before hostd takes its memory away
	// (revoke.go); 0 = DefaultRevokeGrace.
	RevokeGrace time.Duration
	// VsockServed, if set, says whether the vsock device of the VM with
	// this guest id has its hypervisor's front-end (hostd/vsockhost).
	// QEMU's vhost-user front-end dies with a hostd and does not come
	// back to the next one: a READY would only have the VM's library
	// wait out a vsock connect to a device nobody serves.
	VsockServed func(guest uint32) bool
}

// DefaultProofMaxAge is Options.ProofMaxAge's default: a little over two
// of the guest libraries' TCP keepalive intervals (15 s), so that an idle
// honest lease proves itself in time.
const DefaultProofMaxAge = 35 * time.Second

// DefaultPairRegionLinger is Options.PairRegionLinger's default.
const DefaultPairRegionLinger = 10 * time.Second

// Broker is the flow broker. It is safe for concurrent use; Close stops its
// timers and goroutines and waits for them.
type Broker struct {
	log    hclog.Logger
	ct     ctrack.Tracker
	m      *metrics.Set
	opts   Options
	policy atomic.Pointer[policy.Table]
	wg     sync.WaitGroup

	mu         sync.Mutex
	closed     bool
	guests     []*Guest
	sessions   map[Session]*sessionState
	waiting    map[ctrack.Tuple]*half               // by conntrack reply tuple
	waitingP   map[ctrack.Tuple]*half               // the passive ones again, by conntrack original tuple
	remembered ttlQueue[ctrack.Tuple, proto.Reason] // verdicts, by conntrack reply tuple
	flows      map[flowID]*Flow                     // live ring pairs
	conns      map[ctrack.Tuple]*Conn               // connection records, by conntrack reply tuple
	records    map[*Conn]bool                       // every connection record (adopted ones may have no key yet)
	nextConn   uint64                               // the last record's id
	shutting   bool                                 // Shutdown: no more READY
	fw         fwState                              // the ruleset's epoch, the proof poller (firewall.go)
	rg         regionState                          // regions and quotas (regions.go)
	hotplug    Hotplug                              // plugs VM pair regions into VMs; nil: none (hotplug.go)
	notes      rateLog                              // fallbacks and switches logged, rate-limited
	stop       chan struct{}                        // closed by Close
}

// New returns a broker over the given guests, conntrack and policy. The
// broker keeps guests (AddGuest and RemoveGuest change it from then on) and
// uses ct and m without closing them.
func New(log hclog.Logger, ct ctrack.Tracker, m *metrics.Set, pol *policy.Table, guests []*Guest, opts Options) *Broker {
	if opts.PairingTimeout <= 0 {
		opts.PairingTimeout = 2 * time.Second
	}
	if opts.LookupTimeout <= 0 {
		opts.LookupTimeout = 200 * time.Millisecond
	}
	if opts.FirewallPoll <= 0 {
		opts.FirewallPoll = 300 * time.Millisecond
	}
	if opts.ProofMaxAge <= 0 {
		opts.ProofMaxAge = DefaultProofMaxAge
	}
	if opts.RememberFor <= 0 {
		opts.RememberFor = 30 * time.Second
	}
	opts.Limits = opts.Limits.withDefaults()
	b := &Broker{
		log: log, ct: ct, m: m, opts: opts, guests: guests,
		sessions: map[Session]*sessionState{},
		waiting:  map[ctrack.Tuple]*half{}, waitingP: map[ctrack.Tuple]*half{},
		flows: map[flowID]*Flow{}, conns: map[ctrack.Tuple]*Conn{}, records: map[*Conn]bool{},
		stop: make(chan struct{}),
	}
	b.policy.Store(pol)
	return b
}

// Close stops the broker without revoking anything: flows keep running while
// hostd is away, and the next hostd adopts them. It waits for pending work.
func (b *Broker) Close() {
	b.mu.Lock()
	if !b.closed {
		close(b.stop)
	}
	b.closed = true
	for _, h := range b.waiting {
		h.timer.Stop()
	}
	b.mu.Unlock()
	b.wg.Wait()
}
