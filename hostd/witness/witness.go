package witness

import (
	"errors"
	"time"
)

// ErrNoSYN means no SYN with that tuple was seen.
var ErrNoSYN = errors.New("witness: no SYN seen for this tuple")

// Options bound what the witness keeps.
type Options struct {
	// MaxRecords is the size of the map of SYNs; 0 = 65536. When it is
	// full, new records are refused (Stats.Full): a burst cannot evict a
	// record that a claim still needs.
	MaxRecords int
	// PerInterface is how many records one interface may hold at once; 0
	// = MaxRecords/8, so one guest's SYN flood fills at most an eighth of
	// the map (Stats.OverQuota).
	PerInterface int
	// TTL is how long a record is kept after its SYN (refreshed by a
	// retransmitted SYN from the same interface); 0 = 60s. A claim comes
	// within seconds of the SYN; the sweeper deletes older records.
	TTL time.Duration
	// SweepEvery is how often the sweeper runs; 0 = TTL/4; negative:
	// never (tests call Sweep themselves).
	SweepEvery time.Duration
}

func (o Options) withDefaults() Options {
	if o.MaxRecords <= 0 {
		o.MaxRecords = 1 << 16
	}
	if o.PerInterface <= 0 {
		o.PerInterface = max(o.MaxRecords/8, 1)
	}
	if o.TTL <= 0 {
		o.TTL = time.Minute
	}
	if o.SweepEvery == 0 {
		o.SweepEvery = o.TTL / 4
	}
	return o
}

// Stat indexes the program's counters.
type Stat uint32

const (
	StatRecorded  Stat = iota // SYNs of new tuples recorded
	StatConflicts             // SYNs for a recorded tuple from another interface (ignored)
	StatFull                  // new tuples refused: the map was full
	StatOverQuota             // new tuples refused: their interface held its share
	numStats
)

// Stats are the program's counters since Load.
type Stats struct {
	Recorded, Conflicts, Full, OverQuota uint64
}
