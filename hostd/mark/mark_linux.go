//go:build linux

package mark

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	"github.com/hashicorp/go-hclog"
	"golang.org/x/sys/unix"
)

// Table is the name of hostd's nftables table (family inet), one per
// network namespace.
const Table = "shunt_hostd"

// Priority is where hostd's chains run on the forward and input hooks:
// after the filter (0) and security (50) chains, so that an operator's
// rules that set the mark run first and keep their bits.
const Priority = 100

// Options configure a Marker.
type Options struct {
	Netns  string        // path of the network namespace whose table to keep; "" = hostd's own
	Mask   uint32        // the part of the conntrack mark hostd owns; 0 = DefaultMask
	Resync time.Duration // how often the keeper checks the table; 0 = 2s
	Log    hclog.Logger  // nil = none
}

// Entry is one guest's rule.
type Entry struct {
	Guest   string // guest name
	GuestID uint32 // the guest's id (hostd.hcl or libvirt metadata)
	Ifname  string // its host-side interface
	ID      uint32 // its mark id
	Value   uint32 // ID in the mark field: the bits its connections carry
}

// Marker keeps hostd's nftables table. It is safe for concurrent use.
// Close removes the table and stops the keeper.
type Marker struct {
	field Field
	log   hclog.Logger
	nsfd  int // -1: hostd's own namespace
	c     *nftables.Conn

	reinstalls atomic.Uint64
	stop       chan struct{}
	done       chan struct{}

	mu      sync.Mutex
	closed  bool
	ids     *ids
	entries map[string]Entry // by guest name
}

// Open installs hostd's table, empty (replacing what an earlier hostd left),
// and starts the keeper. It needs CAP_NET_ADMIN in the namespace.
func Open(o Options) (_ *Marker, err error) {
	if o.Mask == 0 {
		o.Mask = DefaultMask
	}
	if err := CheckMask(o.Mask); err != nil {
		return nil, err
	}
	if o.Resync <= 0 {
		o.Resync = 2 * time.Second
	}
	if o.Log == nil {
		o.Log = hclog.NewNullLogger()
	}
	m := &Marker{field: Field{o.Mask}, log: o.Log, nsfd: -1, ids: newIDs(Field{o.Mask}.MaxID()),
		entries: map[string]Entry{}, stop: make(chan struct{}), done: make(chan struct{})}
	opts := []nftables.ConnOption{nftables.AsLasting()}
	if o.Netns != "" {
		if m.nsfd, err = unix.Open(o.Netns, unix.O_RDONLY|unix.O_CLOEXEC, 0); err != nil {
			return nil, fmt.Errorf("open netns %s: %w", o.Netns, err)
		}
		opts = append(opts, nftables.WithNetNSFd(m.nsfd))
	}
	defer func() {
		if err != nil && m.nsfd >= 0 {
			unix.Close(m.nsfd)
		}
	}()
	if m.c, err = nftables.New(opts...); err != nil {
		return nil, fmt.Errorf("nftables netlink: %w%s", err, hint(err))
	}
	if err := m.apply(); err != nil {
		m.c.CloseLasting()
		return nil, err
	}
	go m.keep(o.Resync)
	return m, nil
}

// hint says what to do about a netlink error.
func hint(err error) string {
	switch {
	case errors.Is(err, os.ErrPermission):
		return " (needs CAP_NET_ADMIN: run hostd as root)"
	case errors.Is(err, unix.ENOENT), errors.Is(err, unix.EPROTONOSUPPORT), errors.Is(err, unix.EOPNOTSUPP):
		return " (is nf_tables loaded? try: modprobe nf_tables nft_ct)"
	}
	return ""
}

// Field is the part of the conntrack mark hostd owns.
func (m *Marker) Field() Field { return m.field }

// Add gives guest name (guest id guestID) a mark id and stamps the new
// connections that enter by interface ifname with it; it returns the
// guest's Entry. A guest that comes back (a VM restarted or migrated,
// with a new tap) gets the id it had, if still free. An interface has one
// guest, and a guest one interface: either being taken is an error.
func (m *Marker) Add(name string, guestID uint32, ifname string) (Entry, error) {
	if ifname == "" || len(ifname) >= unix.IFNAMSIZ || strings.ContainsAny(ifname, "/ \x00") {
		return Entry{}, fmt.Errorf("guest %s: interface name %q: want 1 to 15 characters, no '/', space or NUL", name, ifname)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return Entry{}, errors.New("marker closed")
	}
	if e, ok := m.entries[name]; ok {
		return Entry{}, fmt.Errorf("guest %s already has a mark rule, on %s", name, e.Ifname)
	}
	for _, e := range m.entries {
		if e.Ifname == ifname {
			return Entry{}, fmt.Errorf("guest %s: interface %s is already guest %s's", name, ifname, e.Guest)
		}
	}
	id, err := m.ids.take(name, guestID)
	if err != nil {
		return Entry{}, fmt.Errorf("guest %s: %w", name, err)
	}
	e := Entry{Guest: name, GuestID: guestID, Ifname: ifname, ID: id, Value: m.field.Value(id)}
	m.entries[name] = e
	if err := m.apply(); err != nil {
		delete(m.entries, name)
		m.ids.give(id)
		return Entry{}, err
	}
	m.log.Info("guest's new connections are marked", "guest", name, "interface", ifname, "mark", fmt.Sprintf("%#08x/%#08x", e.Value, m.field.Mask))
	return e, nil
}

// Remove takes guest name's rule out; its id is free again (and reused as
// late as possible). If the table cannot be updated, the keeper retries.
func (m *Marker) Remove(name string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.entries[name]
	if !ok || m.closed {
		return
	}
	delete(m.entries, name)
	m.ids.give(e.ID)
	if err := m.apply(); err != nil {
		m.log.Warn("could not take a guest's mark rule out; retrying", "guest", name, "error", err)
	}
}

// Entries returns the guests' rules, sorted by interface.
func (m *Marker) Entries() []Entry {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.sortedLocked()
}

func (m *Marker) sortedLocked() []Entry {
	out := make([]Entry, 0, len(m.entries))
	for _, e := range m.entries {
		out = append(out, e)
	}
	slices.SortFunc(out, func(a, b Entry) int { return strings.Compare(a.Ifname, b.Ifname) })
	return out
}

// Reinstalls counts the times the keeper found the table changed by
// someone else and put it back.
func (m *Marker) Reinstalls() uint64 { return m.reinstalls.Load() }

// Close stops the keeper and removes the table. It is idempotent.
func (m *Marker) Close() error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil
	}
	m.closed = true
	m.mu.Unlock()
	close(m.stop)
	<-m.done
	m.c.DelTable(table())
	err := m.c.Flush()
	if errors.Is(err, unix.ENOENT) {
		err = nil
	}
	m.c.CloseLasting()
	if m.nsfd >= 0 {
		unix.Close(m.nsfd)
	}
	if err != nil {
		return fmt.Errorf("remove nftables table inet %s: %w", Table, err)
	}
	return nil
}

// keep puts the table back when it is not what hostd installed.
func (m *Marker) keep(every time.Duration) {
	defer close(m.done)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-m.stop:
			return
		case <-t.C:
		}
		m.mu.Lock()
		if !m.closed && !m.intactLocked() {
			if err := m.apply(); err != nil {
				m.log.Warn("hostd's nftables table was changed and cannot be put back: guests' connections are not marked and stay on TCP (not-owner)", "table", "inet "+Table, "error", err)
			} else {
				m.reinstalls.Add(1)
				m.log.Warn("hostd's nftables table was changed or removed (a firewall reload that flushes the ruleset?); put back", "table", "inet "+Table)
			}
		}
		m.mu.Unlock()
	}
}

// intactLocked reports whether every chain holds exactly the rules hostd
// wants, by their comments.
func (m *Marker) intactLocked() bool {
	cs, rs := Ruleset(m.field, m.sortedLocked())
	for _, c := range cs {
		var want []string
		for _, r := range rs {
			if r.Chain == c {
				s, _ := userdata.GetString(r.UserData, userdata.TypeComment)
				want = append(want, s)
			}
		}
		rules, err := m.c.GetRules(c.Table, c)
		if err != nil || len(rules) != len(want) {
			return false
		}
		for i, r := range rules {
			if s, _ := userdata.GetString(r.UserData, userdata.TypeComment); s != want[i] {
				return false
			}
		}
	}
	return true
}

// apply replaces the table with one that holds the current entries, in
// one batch (add, delete and add the table again, so that it works
// whether or not the table exists).
func (m *Marker) apply() error {
	t := table()
	m.c.AddTable(t)
	m.c.DelTable(t)
	m.c.AddTable(t)
	cs, rs := Ruleset(m.field, m.sortedLocked())
	for _, c := range cs {
		m.c.AddChain(c)
	}
	for _, r := range rs {
		m.c.AddRule(r)
	}
	if err := m.c.Flush(); err != nil {
		return fmt.Errorf("install nftables table inet %s: %w%s", Table, err, hint(err))
	}
	return nil
}

func table() *nftables.Table { return &nftables.Table{Name: Table, Family: nftables.TableFamilyINet} }

// chains are hostd's base chains: new connections from a guest either go
// through the host (forward) or to it (input).
func chains(t *nftables.Table) []*nftables.Chain {
	return []*nftables.Chain{baseChain(t, "forward", nftables.ChainHookForward, Priority), baseChain(t, "input", nftables.ChainHookInput, Priority)}
}

// baseChain is one of hostd's base chains: a filter chain on hook at
// priority prio that accepts what its rules do not drop (they drop
// nothing: they set marks).
func baseChain(t *nftables.Table, name string, hook *nftables.ChainHook, prio int32) *nftables.Chain {
	p := nftables.ChainPriority(prio)
	pol := nftables.ChainPolicyAccept
	return &nftables.Chain{Name: name, Table: t, Type: nftables.ChainTypeFilter, Hooknum: hook, Priority: &p, Policy: &pol}
}

// Ruleset is hostd's table for the given entries: its marking chains,
// with one rule per entry in each, in order, then its proof chains
// (proof_linux.go). Pure, for tests.
func Ruleset(f Field, entries []Entry) ([]*nftables.Chain, []*nftables.Rule) {
	t := table()
	cs := chains(t)
	var rs []*nftables.Rule
	for _, c := range cs {
		for _, e := range entries {
			rs = append(rs, &nftables.Rule{
				Table: c.Table, Chain: c, Exprs: Exprs(f, e),
				UserData: userdata.AppendString(nil, userdata.TypeComment, comment(e)),
			})
		}
	}
	for _, c := range proofChains(t) {
		cs = append(cs, c)
		rs = append(rs, proofRules(f, c)...)
	}
	return cs, rs
}

func comment(e Entry) string { return fmt.Sprintf("shunt guest %s", e.Guest) }

// Exprs is one guest's rule (IDS: the field's id bits):
//
//	iifname IFNAME ct state new ct mark & IDS == 0
//	counter ct mark set ct mark & ^IDS ^ VALUE
//
// It stamps a connection once, by its first packet, and keeps the mark
// bits outside the id bits (the operator's, and the proof bits).
func Exprs(f Field, e Entry) []expr.Any {
	ne := binaryutil.NativeEndian.PutUint32
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: append([]byte(e.Ifname), 0)},
		&expr.Ct{Key: expr.CtKeySTATE, Register: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: ne(expr.CtStateBitNEW), Xor: ne(0)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: ne(0)},
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 2, Len: 4, Mask: ne(f.IDMask()), Xor: ne(0)},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 2, Data: ne(0)},
		&expr.Counter{},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: ne(^f.IDMask()), Xor: ne(e.Value)},
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1, SourceRegister: true},
	}
}
