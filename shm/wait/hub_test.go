package wait_test

import (
	"errors"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shuntnet/shunt/shm/wait"
)

// TestHubNoLostWakeup: TestNoLostWakeup's hand-off through a Hub, both
// ends sleeping in it every round (Block), and with 150 pairs at once,
// more than one futex_waitv holds (the rest sleep in futexes of their
// own): a lost wake-up hangs a pair, which the deadline turns into a
// failure.
func TestHubNoLostWakeup(t *testing.T) {
	for _, pairs := range []int{1, 150} {
		h := wait.NewHub()
		p := &wait.Policy{Mode: wait.Block, Signal: h}
		deadline := time.Now().Add(60 * time.Second)
		rounds := uint64(20000 / pairs)
		var wg sync.WaitGroup
		errs := make(chan error, 2*pairs)
		for range pairs {
			var ping, pong counter
			var pingFlag, pongFlag atomic.Uint32
			wg.Add(2)
			go func() {
				defer wg.Done()
				for i := uint64(1); i <= rounds; i++ {
					ping.want = i
					if err := p.Wait(&ping, &pingFlag, deadline); err != nil {
						errs <- err
						return
					}
					pong.v.Store(i)
					p.Wake(&pongFlag)
				}
			}()
			go func() {
				defer wg.Done()
				for i := uint64(1); i <= rounds; i++ {
					ping.v.Store(i)
					p.Wake(&pingFlag)
					pong.want = i
					if err := p.Wait(&pong, &pongFlag, deadline); err != nil {
						errs <- err
						return
					}
				}
			}()
		}
		wg.Wait()
		h.Close()
		select {
		case err := <-errs:
			t.Fatalf("%d pairs: %v (a lost wake-up?)", pairs, err)
		default:
		}
	}
}

// TestHubDeadline: a wait nobody wakes ends at its deadline, through the
// Hub's own timeout.
func TestHubDeadline(t *testing.T) {
	h := wait.NewHub()
	defer h.Close()
	p := &wait.Policy{Mode: wait.Block, Signal: h}
	var flag atomic.Uint32
	err := p.Wait(&counter{want: 1}, &flag, time.Now().Add(20*time.Millisecond))
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Wait past its deadline = %v, want %v", err, os.ErrDeadlineExceeded)
	}
}

// TestHubClose: Close ends a wait in progress (its caller re-checks and
// sleeps again, in a futex of its own), and a Wake still reaches it.
func TestHubClose(t *testing.T) {
	h := wait.NewHub()
	var flag atomic.Uint32
	flag.Store(1)
	back := make(chan error, 1)
	go func() { back <- h.Wait(&flag, 1, 0) }()
	// Wait until the Hub holds the wait: Close must end one in progress.
	for t0 := time.Now(); ; time.Sleep(time.Millisecond) {
		if h.Waiting() == 1 {
			break
		}
		if time.Since(t0) > 10*time.Second {
			t.Fatal("the Hub never held the wait")
		}
	}
	h.Close()
	select {
	case err := <-back:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not end a wait in progress")
	}
	h.Close() // idempotent
	c := &counter{want: 1}
	p := &wait.Policy{Mode: wait.Block, Signal: h}
	go func() { c.v.Store(1); p.Wake(&flag) }()
	if err := p.Wait(c, &flag, time.Now().Add(10*time.Second)); err != nil {
		t.Fatalf("a wait after Close: %v", err)
	}
}

// BenchmarkHandOff: two goroutines hand a counter back and forth, each
// asleep between turns (Block, so every turn is a wake-up), with and
// without a Hub. Each sleeper without one holds a P in its futex, so a
// third goroutine, runnable meanwhile, waits for the runtime to take a
// P back; "busy" adds such a goroutine, which yields in a loop.
func BenchmarkHandOff(b *testing.B) {
	for _, busy := range []bool{false, true} {
		for _, hub := range []bool{false, true} {
			name := map[bool]string{false: "futex", true: "hub"}[hub]
			if busy {
				name += "/busy"
			}
			b.Run(name, func(b *testing.B) {
				p := &wait.Policy{Mode: wait.Block}
				if hub {
					h := wait.NewHub()
					defer h.Close()
					p.Signal = h
				}
				stop := make(chan struct{})
				defer close(stop)
				if busy {
					go func() {
						for {
							select {
							case <-stop:
								return
							default:
								runtime.Gosched()
							}
						}
					}()
				}
				handOff(b, p)
			})
		}
	}
}

func handOff(b *testing.B, p *wait.Policy) {
	var ping, pong counter
	var pingFlag, pongFlag atomic.Uint32
	deadline := time.Now().Add(time.Minute)
	done := make(chan error, 1)
	n := uint64(b.N)
	go func() {
		for i := uint64(1); i <= n; i++ {
			ping.want = i
			if err := p.Wait(&ping, &pingFlag, deadline); err != nil {
				done <- err
				return
			}
			pong.v.Store(i)
			p.Wake(&pongFlag)
		}
		done <- nil
	}()
	b.ResetTimer()
	for i := uint64(1); i <= n; i++ {
		ping.v.Store(i)
		p.Wake(&pingFlag)
		pong.want = i
		if err := p.Wait(&pong, &pongFlag, deadline); err != nil {
			b.Fatal(err)
		}
	}
	if err := <-done; err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/1e3, "us/turn")
}
