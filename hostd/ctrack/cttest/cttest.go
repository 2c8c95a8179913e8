// Package cttest is a fake conntrack table for unit tests of logic that
// consumes ctrack.Tracker (the broker). Integration tests use the kernel.
package cttest

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/shuntnet/shunt/hostd/ctrack"
)

// Table is an in-memory conntrack table. Safe for concurrent use.
type Table struct {
	mu      sync.Mutex
	entries []ctrack.Entry
	nextID  uint32
	lookups int // Lookups
	clears  int // Clears
}

// Add inserts an ESTABLISHED, assured TCP entry with the given directions.
func (t *Table) Add(orig, reply ctrack.Tuple, mark uint32) ctrack.Entry {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.nextID++
	e := ctrack.Entry{ID: t.nextID, Orig: orig, Reply: reply, TCPState: ctrack.StateEstablished, Assured: true, Mark: mark, Start: time.Now(),
		PacketsOrig: 3, PacketsReply: 2, BytesOrig: 180, BytesReply: 120} // the handshake, accounted
	t.entries = append(t.entries, e)
	return e
}

// Delete removes the entry with id (as conntrack -D does; no event is
// reported: call the broker's ConntrackDestroyed for that). It reports
// whether there was one.
func (t *Table) Delete(id uint32) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	for i, e := range t.entries {
		if e.ID == id {
			t.entries = append(t.entries[:i], t.entries[i+1:]...)
			return true
		}
	}
	return false
}

// Count adds packets to the accounting counters of the entry with id, in
// its original and reply directions (a lease carrying packets).
func (t *Table) Count(id uint32, orig, reply uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for i := range t.entries {
		if e := &t.entries[i]; e.ID == id {
			e.PacketsOrig += orig
			e.PacketsReply += reply
			e.BytesOrig += 100 * orig
			e.BytesReply += 100 * reply
		}
	}
}

// Uncount clears the accounting counters of the entry with id, as on a
// host with net.netfilter.nf_conntrack_acct off.
func (t *Table) Uncount(id uint32) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for i := range t.entries {
		if e := &t.entries[i]; e.ID == id {
			e.PacketsOrig, e.PacketsReply, e.BytesOrig, e.BytesReply = 0, 0, 0, 0
		}
	}
}

// Pass sets bits of the mark of the entry with id, as hostd's proof
// chains do when a packet of the connection passes the filter.
func (t *Table) Pass(id uint32, bits uint32) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for i := range t.entries {
		if e := &t.entries[i]; e.ID == id {
			e.Mark |= bits
		}
	}
}

// ClearMark implements ctrack.Tracker.
func (t *Table) ClearMark(q ctrack.Tuple, bits uint32) error {
	q = q.Unmap()
	t.mu.Lock()
	defer t.mu.Unlock()
	for i := range t.entries {
		if e := &t.entries[i]; e.Orig == q || e.Reply == q {
			e.Mark &^= bits
			return nil
		}
	}
	return fmt.Errorf("%s: %w", q, ctrack.ErrNotFound)
}

// ClearMarks implements ctrack.Tracker. Entries are made with no start
// time unless SetStart gave one.
func (t *Table) ClearMarks(bits uint32, madeBefore time.Time) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for i := range t.entries {
		if e := &t.entries[i]; e.Mark&bits != 0 && (e.Start.IsZero() || !e.Start.After(madeBefore)) {
			e.Mark &^= bits
			n++
		}
	}
	t.clears++
	return n, nil
}

// Clears returns how many times ClearMarks ran.
func (t *Table) Clears() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.clears
}

// Lookup implements ctrack.Tracker: either direction matches.
func (t *Table) Lookup(q ctrack.Tuple) (ctrack.Entry, error) {
	q = q.Unmap() // as the kernel's: either form of an IPv4 tuple
	t.mu.Lock()
	defer t.mu.Unlock()
	t.lookups++
	for _, e := range t.entries {
		if e.Orig == q || e.Reply == q {
			return e, nil
		}
	}
	return ctrack.Entry{}, fmt.Errorf("%s: %w", q, ctrack.ErrNotFound)
}

// Lookups returns how many lookups the table answered.
func (t *Table) Lookups() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.lookups
}

// Destroyed implements ctrack.Tracker: it reports nothing until ctx ends.
func (t *Table) Destroyed(ctx context.Context, fn func(ctrack.Entry)) error {
	<-ctx.Done()
	return nil
}

// Close implements ctrack.Tracker.
func (t *Table) Close() error { return nil }
