package broker

import (
	"math/rand/v2"
	"testing"
	"time"
)

// TestTTLQueue checks the queue against a plain map of expiry times over
// random operations with a clock that only moves forward, as the broker's
// does: every key lives ttl from its last put.
func TestTTLQueue(t *testing.T) {
	const ttl = 10 * time.Second
	r := rand.New(rand.NewPCG(1, 2))
	var q ttlQueue[int, int]
	ref := map[int]time.Time{} // key -> until
	now := time.Unix(1000, 0)
	for step := range 20000 {
		k := r.IntN(64)
		switch op := r.IntN(6); op {
		case 0, 1:
			q.put(k, step, now.Add(ttl))
			ref[k] = now.Add(ttl)
		case 2:
			if got, want := q.remove(k), hasKey(ref, k); got != want {
				t.Fatalf("step %d: remove(%d) = %v, want %v", step, k, got, want)
			}
			delete(ref, k)
		case 3:
			n := q.expire(now)
			want := 0
			for k, u := range ref {
				if !now.Before(u) {
					delete(ref, k)
					want++
				}
			}
			if n != want {
				t.Fatalf("step %d: expire removed %d, want %d", step, n, want)
			}
		case 4:
			now = now.Add(time.Duration(r.IntN(3000)) * time.Millisecond)
		case 5:
			u, ok := ref[k]
			if got, want := q.has(k, now), ok && now.Before(u); got != want {
				t.Fatalf("step %d: has(%d) = %v, want %v", step, k, got, want)
			}
		}
		if q.len() != len(ref) || q.order.Len() != len(ref) {
			t.Fatalf("step %d: len %d (list %d), want %d", step, q.len(), q.order.Len(), len(ref))
		}
	}
	// The order is expiry order: the front expires first.
	var prev time.Time
	for e := q.order.Front(); e != nil; e = e.Next() {
		it := e.Value.(*ttlItem[int, int])
		if it.until.Before(prev) {
			t.Fatalf("queue out of expiry order: %v after %v", it.until, prev)
		}
		prev = it.until
	}
}

func hasKey(m map[int]time.Time, k int) bool { _, ok := m[k]; return ok }

// TestTTLQueueDropOldest: dropOldest takes the key put (or refreshed)
// longest ago.
func TestTTLQueueDropOldest(t *testing.T) {
	var q ttlQueue[string, struct{}]
	now := time.Unix(0, 0)
	for i, k := range []string{"a", "b", "c"} {
		q.put(k, struct{}{}, now.Add(time.Duration(i)*time.Second))
	}
	q.put("a", struct{}{}, now.Add(5*time.Second)) // refreshed: now the newest
	if !q.dropOldest() || q.has("b", now) || !q.has("a", now) || !q.has("c", now) {
		t.Fatalf("after dropOldest: a %v b %v c %v, want b dropped", q.has("a", now), q.has("b", now), q.has("c", now))
	}
	q.dropOldest()
	q.dropOldest()
	if q.dropOldest() || q.len() != 0 {
		t.Fatalf("dropOldest on an empty queue: len %d", q.len())
	}
}

// BenchmarkTTLQueuePut: a put (with its expiry pass) costs the same however
// many keys the queue holds.
func BenchmarkTTLQueuePut(b *testing.B) {
	var q ttlQueue[int, struct{}]
	now := time.Unix(0, 0)
	for i := range 1 << 16 {
		q.put(-i-1, struct{}{}, now.Add(time.Hour))
	}
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		q.expire(now)
		q.put(i&1023, struct{}{}, now.Add(time.Hour))
	}
}
