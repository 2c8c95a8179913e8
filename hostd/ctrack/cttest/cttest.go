// Package cttest is a fake conntrack table for unit tests of logic that
// consumes ctrack.Tracker (the broker). Integration tests use the kernel.
package cttest

import (
	"context"
	"fmt"
	"sync"

	"github.com/shuntnet/shunt/hostd/ctrack"
)

// Table is an in-memory conntrack table. Safe for concurrent use.
type Table struct {
	mu      sync.Mutex
	entries []ctrack.Entry
	nextID  uint32
}

// Add inserts an ESTABLISHED, assured TCP entry with the given directions.
func (t *Table) Add(orig, reply ctrack.Tuple, mark uint32) ctrack.Entry {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.nextID++
	e := ctrack.Entry{ID: t.nextID, Orig: orig, Reply: reply, TCPState: ctrack.StateEstablished, Assured: true, Mark: mark}
	t.entries = append(t.entries, e)
	return e
}

// Lookup implements ctrack.Tracker: either direction matches.
func (t *Table) Lookup(q ctrack.Tuple) (ctrack.Entry, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, e := range t.entries {
		if e.Orig == q || e.Reply == q {
			return e, nil
		}
	}
	return ctrack.Entry{}, fmt.Errorf("%s: %w", q, ctrack.ErrNotFound)
}

// Destroyed implements ctrack.Tracker: it reports nothing until ctx ends.
func (t *Table) Destroyed(ctx context.Context, fn func(ctrack.Entry)) error {
	<-ctx.Done()
	return nil
}

// Close implements ctrack.Tracker.
func (t *Table) Close() error { return nil }
