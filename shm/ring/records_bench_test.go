package ring_test

import (
	"testing"

	"github.com/shuntnet/shunt/shm/ring"
)

// BenchmarkRecordOneThread: an 8-byte record written, polled and consumed
// by one goroutine, through a 64 KiB ring: what the two ends' own work
// costs per message (stores, fences, checks) without the cache-line
// transfers between cores that shm.BenchmarkRecordPingPong measures. It
// needs no second core, so a loaded machine disturbs it less.
func BenchmarkRecordOneThread(b *testing.B) {
	_, _, w, rd := recRing(b, 64<<10, 0x5500000000)
	var i uint64
	for b.Loop() {
		p, err := w.Reserve(8)
		if err != nil {
			b.Fatal(err)
		}
		p[0] = byte(i)
		w.Commit(8, ring.RecKindData, 0)
		rec, ok, err := rd.Poll()
		if !ok || err != nil || rec.Payload[0] != byte(i) {
			b.Fatalf("record %d: %v %v", i, ok, err)
		}
		rd.Consume()
		i++
	}
}
