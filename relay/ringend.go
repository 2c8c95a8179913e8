package relay

import (
	"fmt"

	"github.com/shuntnet/shunt/shm/ring"
)

// RingEnd checks one ring's marks as a reader that comes late must:
// no byte before a start, a start below MaxStart, the head never
// past the tail and the tail never more than the capacity ahead of it.
// It returns the start and the end (start + bytes written). A restarted
// hostd reads so a ring whose bridge died with its predecessor
// (hostd/across, orphans; hostd/broker, a vsock VM's adopted stretch).
func RingEnd(s ring.Stats, capacity uint64) (started bool, start, end uint64, err error) {
	switch {
	case s.Reset:
		return false, 0, 0, fmt.Errorf("reset (reason %d)", s.Reason)
	case s.Read > s.Written:
		return false, 0, 0, fmt.Errorf("head %d past tail %d", s.Read, s.Written)
	case s.Written-s.Read > capacity:
		return false, 0, 0, fmt.Errorf("tail %d more than the capacity %d past head %d", s.Written, capacity, s.Read)
	case !s.Started && s.Written != 0:
		return false, 0, 0, fmt.Errorf("%d bytes without a start", s.Written)
	case !s.Started:
		return false, 0, 0, nil
	case s.Start >= MaxStart || s.Written >= MaxStart:
		return false, 0, 0, fmt.Errorf("start %d or tail %d out of bounds", s.Start, s.Written)
	}
	return true, s.Start, s.Start + s.Written, nil
}
