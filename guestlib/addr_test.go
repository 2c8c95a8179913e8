package guestlib

import (
	"context"
	"net"
	"net/netip"
	"testing"

	"github.com/shuntnet/shunt/guestlib/guesttest"
	"github.com/shuntnet/shunt/internal/proto"
)

// TestDualStackNames: a listener on [::] (network "tcp": one AF_INET6
// socket for both families) registers [::]; a connection it accepts from
// an IPv4 client, which its kernel names ::ffff:127.0.0.1, is announced
// under its IPv4 tuple, as the client's own AF_INET socket names it, and
// one from an IPv6 client under its IPv6 tuple.
func TestDualStackNames(t *testing.T) {
	probe, err := net.Listen("tcp6", "[::1]:0")
	if err != nil {
		t.Skipf("no IPv6 loopback here (%v): enable IPv6 (sysctl net.ipv6.conf.lo.disable_ipv6=0)", err)
	}
	probe.Close()
	h := guesttest.Start(t)
	c := newClient(t, h, Options{})
	ch := async(func() *Listener {
		l, err := (&ListenConfig{Client: c}).Listen(context.Background(), "tcp", "[::]:0")
		if err != nil {
			t.Error(err)
		}
		return l
	})
	s := h.Greet(t)
	lm := s.Expect(t, proto.Listen)
	ping := s.Expect(t, proto.Ping)
	s.Send(t, proto.Msg{Type: proto.Pong, Nonce: ping.Nonce})
	l := await(t, ch, "Listen")
	if l == nil {
		t.FailNow()
	}
	t.Cleanup(func() { l.Close() })
	port := l.Addr().(*net.TCPAddr).AddrPort().Port()
	if want := netip.AddrPortFrom(netip.IPv6Unspecified(), port); lm.Local != want {
		t.Fatalf("LISTEN %s, want %s", lm.Local, want)
	}
	for _, tc := range []struct{ network, to string }{
		{"tcp4", "127.0.0.1"},
		{"tcp6", "::1"},
	} {
		t.Run(tc.network, func(t *testing.T) {
			peer, err := net.Dial(tc.network, netip.AddrPortFrom(netip.MustParseAddr(tc.to), port).String())
			if err != nil {
				t.Fatal(err)
			}
			defer peer.Close()
			conn, err := l.AcceptShunt()
			if err != nil {
				t.Fatal(err)
			}
			open := s.Expect(t, proto.Open)
			defer s.Expect(t, proto.Close)
			defer conn.Close()
			// The peer's own socket names the tuple; the OPEN must say the same.
			wantLocal := peer.RemoteAddr().(*net.TCPAddr).AddrPort()
			wantRemote := peer.LocalAddr().(*net.TCPAddr).AddrPort()
			if open.Role != proto.Passive || open.Local != wantLocal || open.Remote != wantRemote {
				t.Fatalf("OPEN %s <- %s (role %d), want passive %s <- %s", open.Local, open.Remote, open.Role, wantLocal, wantRemote)
			}
			if conn.local != wantLocal || conn.remote != wantRemote {
				t.Fatalf("conn named %s <- %s, want %s <- %s", conn.local, conn.remote, wantLocal, wantRemote)
			}
			if tc.network == "tcp4" && !conn.remote.Addr().Is4() {
				t.Fatalf("an IPv4 client named %s, want an IPv4 address", conn.remote)
			}
		})
	}
}
