package relay

import (
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"
)

// negotiate runs NegotiateRDMA on both ends of a loopback TCP connection
// with the given opens.
func negotiate(t *testing.T, openA, openB func() (Verbs, error)) (la, lb *RDMALink, ca, cb net.Conn, ea, eb error) {
	t.Helper()
	as, bs := conns(t, 1)
	ca, cb = as[0], bs[0]
	t.Cleanup(func() { ca.Close(); cb.Close() })
	done := make(chan struct{})
	go func() { lb, eb = NegotiateRDMA(cb, openB, RDMAOptions{Timeout: 5 * time.Second}); close(done) }()
	la, ea = NegotiateRDMA(ca, openA, RDMAOptions{Timeout: 5 * time.Second})
	<-done
	t.Cleanup(func() {
		for _, l := range []*RDMALink{la, lb} {
			if l != nil {
				l.Close()
				l.Wait()
			}
		}
	})
	return
}

// TestNegotiateRDMA: two ends that both offer RDMA get an RDMA link that
// carries a flow both ways; when the peer's side channel closes (its
// relay gone), the link ends at once though no flow sends.
func TestNegotiateRDMA(t *testing.T) {
	va, vb := fakePair(MinRing, 16)
	la, lb, ca, _, ea, eb := negotiate(t, func() (Verbs, error) { return va, nil }, func() (Verbs, error) { return vb, nil })
	if ea != nil || eb != nil {
		t.Fatalf("negotiate: %v, %v", ea, eb)
	}
	downAndLeftInOrder(t, la, lb)
	ca.Close()
	for end := time.Now().Add(5 * time.Second); lb.Err() == nil; time.Sleep(time.Millisecond) {
		if time.Now().After(end) {
			t.Fatal("the link outlived its peer's side channel")
		}
	}
	if !strings.Contains(lb.Err().Error(), "side channel") {
		t.Fatalf("link error %v", lb.Err())
	}
}

// TestNegotiateTCP: when either end offers no RDMA (no device, a build
// without the tag) both get ErrUseTCP with the reason, the offered queue
// pair is closed, and the connection is clean: the TCP link runs on it.
func TestNegotiateTCP(t *testing.T) {
	noRDMA := errors.New("ibv: built without RDMA")
	for name, c := range map[string]struct {
		a, b     bool
		whyA     string
		whyB     string
		closedVA bool
	}{
		"neither":  {whyA: "this host offers no RDMA: ibv: built without RDMA", whyB: "this host offers no RDMA"},
		"only one": {a: true, whyA: "the peer offers no RDMA", whyB: "this host offers no RDMA", closedVA: true},
	} {
		t.Run(name, func(t *testing.T) {
			va, _ := fakePair(MinRing, 16)
			openA := func() (Verbs, error) { return nil, noRDMA }
			if c.a {
				openA = func() (Verbs, error) { return va, nil }
			}
			_, _, ca, cb, ea, eb := negotiate(t, openA, nil)
			for i, e := range []struct {
				err error
				why string
			}{{ea, c.whyA}, {eb, c.whyB}} {
				if !errors.Is(e.err, ErrUseTCP) || !strings.HasSuffix(e.err.Error(), e.why) {
					t.Errorf("end %d: %v, want ErrUseTCP: %s", i, e.err, e.why)
				}
			}
			if va.closed.Load() != c.closedVA {
				t.Errorf("the offered queue pair closed: %v", va.closed.Load())
			}
			la, lb := NewLink([]net.Conn{ca}, LinkOptions{}), NewLink([]net.Conn{cb}, LinkOptions{})
			defer func() { la.Close(); lb.Close(); la.Wait(); lb.Wait() }()
			downAndLeftInOrder(t, la, lb)
		})
	}
}

// TestNegotiateRefuses: a peer that says something else than an offer is
// a protocol error, not a TCP link.
func TestNegotiateRefuses(t *testing.T) {
	as, bs := conns(t, 1)
	defer as[0].Close()
	defer bs[0].Close()
	go func() { bs[0].Write([]byte("GET / HTTP/1.0\r\n")); io.Copy(io.Discard, bs[0]) }()
	if _, err := NegotiateRDMA(as[0], nil, RDMAOptions{}); !errors.Is(err, ErrProtocol) || errors.Is(err, ErrUseTCP) {
		t.Fatalf("negotiate with a stranger: %v", err)
	}
}
