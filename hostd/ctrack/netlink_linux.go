//go:build linux

package ctrack

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
	"github.com/ti-mo/netfilter"
)

// Netlink is the kernel Tracker.
type Netlink struct {
	netns string
	mu    sync.Mutex // serializes queries on query
	query *getter
}

// Dial opens a query connection in the network namespace at netnsPath
// ("" for the caller's own). Close releases it.
func Dial(netnsPath string) (*Netlink, error) {
	g, err := newGetter(netnsPath)
	if err != nil {
		return nil, fmt.Errorf("%w (is nf_conntrack loaded? try: modprobe nf_conntrack_netlink)", err)
	}
	return &Netlink{netns: netnsPath, query: g}, nil
}

func dial(netnsPath string) (*conntrack.Conn, error) {
	cfg := &netlink.Config{}
	if netnsPath != "" {
		f, err := os.Open(netnsPath)
		if err != nil {
			return nil, fmt.Errorf("open netns %s for conntrack: %w", netnsPath, err)
		}
		defer f.Close()
		cfg.NetNS = int(f.Fd())
	}
	c, err := conntrack.Dial(cfg)
	if err != nil {
		return nil, fmt.Errorf("conntrack netlink: %w (is nf_conntrack loaded? try: modprobe nf_conntrack_netlink)", err)
	}
	return c, nil
}

// Lookup implements Tracker.
func (n *Netlink) Lookup(t Tuple) (Entry, error) {
	t = t.Unmap() // an IPv4 entry is asked for as AF_INET
	n.mu.Lock()
	f, err := n.query.get(t)
	n.mu.Unlock()
	if err != nil {
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ENOENT) {
			return Entry{}, fmt.Errorf("%s: %w", t, ErrNotFound)
		}
		return Entry{}, fmt.Errorf("conntrack lookup %s: %w", t, err)
	}
	return entry(f), nil
}

func entry(f conntrack.Flow) Entry {
	tuple := func(t conntrack.Tuple) Tuple {
		return Tuple{
			Src: netip.AddrPortFrom(t.IP.SourceAddress.Unmap(), t.Proto.SourcePort),
			Dst: netip.AddrPortFrom(t.IP.DestinationAddress.Unmap(), t.Proto.DestinationPort),
		}
	}
	return Entry{
		ID:   f.ID,
		Orig: tuple(f.TupleOrig), Reply: tuple(f.TupleReply),
		TCPState: f.ProtoInfo.TCP.State, Assured: f.Status.Assured(), Mark: f.Mark, Zone: f.Zone, Start: f.Timestamp.Start,
		PacketsOrig: f.CountersOrig.Packets, PacketsReply: f.CountersReply.Packets,
		BytesOrig: f.CountersOrig.Bytes, BytesReply: f.CountersReply.Bytes,
	}
}

// ClearMark implements Tracker.
func (n *Netlink) ClearMark(t Tuple, bits uint32) error {
	t = t.Unmap()
	n.mu.Lock()
	err := n.query.setMark(t, bits, 0)
	n.mu.Unlock()
	if err != nil {
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ENOENT) {
			return fmt.Errorf("%s: %w", t, ErrNotFound)
		}
		return fmt.Errorf("conntrack update %s: %w", t, err)
	}
	return nil
}

// ClearMarks implements Tracker: the kernel filters a dump by each bit
// (CTA_FILTER mark and mask), and each entry found is updated. An entry
// gone meanwhile is no error.
func (n *Netlink) ClearMarks(bits uint32, madeBefore time.Time) (int, error) {
	c, err := dial(n.netns)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	changed := 0
	for b := uint32(1); b != 0; b <<= 1 {
		if bits&b == 0 {
			continue
		}
		flows, err := c.DumpFilter(conntrack.NewFilter().Mark(b).MarkMask(b), nil)
		if err != nil {
			return changed, fmt.Errorf("conntrack dump by mark %#x: %w", b, err)
		}
		for _, f := range flows {
			if f.TupleOrig.Proto.Protocol != syscall.IPPROTO_TCP || f.Mark&bits == 0 {
				continue
			}
			e := entry(f)
			if !e.Start.IsZero() && e.Start.After(madeBefore) {
				continue // made since: its bits are new
			}
			if err := n.ClearMark(e.Orig, bits); err != nil && !errors.Is(err, ErrNotFound) {
				return changed, err
			}
			changed++
		}
	}
	return changed, nil
}

// Destroyed implements Tracker with a dedicated event connection.
func (n *Netlink) Destroyed(ctx context.Context, fn func(Entry)) error {
	c, err := dial(n.netns)
	if err != nil {
		return err
	}
	if err := c.SetReadBuffer(4 << 20); err != nil {
		c.Close()
		return fmt.Errorf("conntrack events: %w", err)
	}
	events := make(chan conntrack.Event, 1024)
	errs, err := c.Listen(events, 1, []netfilter.NetlinkGroup{netfilter.GroupCTDestroy})
	if err != nil {
		c.Close()
		return fmt.Errorf("conntrack events: %w (is net.netfilter.nf_conntrack_events enabled?)", err)
	}
	// Close waits for the library's worker, which may be blocked handing us
	// an event or an error: keep draining both until it has gone.
	defer func() {
		done := make(chan struct{})
		go func() {
			for {
				select {
				case <-events:
				case <-errs:
				case <-done:
					return
				}
			}
		}()
		c.Close()
		close(done)
	}()
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-errs:
			return fmt.Errorf("conntrack events: %w", err)
		case ev := <-events:
			if ev.Type == conntrack.EventDestroy && ev.Flow != nil && ev.Flow.TupleOrig.Proto.Protocol == syscall.IPPROTO_TCP {
				fn(entry(*ev.Flow))
			}
		}
	}
}

// Close implements Tracker.
func (n *Netlink) Close() error { return n.query.close() }
