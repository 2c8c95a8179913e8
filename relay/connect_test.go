package relay

import (
	"crypto/rand"
	"errors"
	"net"
	"os"
	"testing"
	"time"
)

func TestLinkListenerTokens(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := ListenLinks(ln)
	defer l.Close()
	dial := func() (net.Conn, error) { return net.Dial("tcp", ln.Addr().String()) }
	token, other := make([]byte, TokenSize), make([]byte, TokenSize)
	rand.Read(token)
	rand.Read(other)

	// A connection with a token nobody expects is closed at once.
	bad, err := DialLink(dial, other, 1)
	if err != nil {
		t.Fatal(err)
	}
	_ = bad[0].SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := bad[0].Read(make([]byte, 1)); err == nil {
		t.Fatal("a connection with an unexpected token was kept")
	}

	got := make(chan []net.Conn, 1)
	go func() {
		cs, err := l.Expect(token, 2, 5*time.Second)
		if err != nil {
			t.Error(err)
		}
		got <- cs
	}()
	time.Sleep(50 * time.Millisecond)
	mine, err := DialLink(dial, token, 2)
	if err != nil {
		t.Fatal(err)
	}
	theirs := <-got
	if len(theirs) != 2 {
		t.Fatalf("expected 2 connections, got %d", len(theirs))
	}
	// Index order is kept: each side's conns[i] are the two ends of one connection.
	for i := range 2 {
		if _, err := mine[i].Write([]byte{byte(i)}); err != nil {
			t.Fatal(err)
		}
		b := make([]byte, 1)
		_ = theirs[i].SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := theirs[i].Read(b); err != nil || b[0] != byte(i) {
			t.Fatalf("connection %d: read %v, %v", i, b, err)
		}
	}

	// Expect gives up in time when too few come.
	if _, err := l.Expect(other, 2, 200*time.Millisecond); err == nil {
		t.Fatal("Expect returned without the connections")
	}
}

// TestLinkListenerSlotsPerSource: one address holding handshakes open
// (connected, silent) gets at most a link's worth of slots; its next
// connection is closed at once, and a peer from another address still
// makes its link.
func TestLinkListenerSlotsPerSource(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := ListenLinks(ln)
	defer l.Close()
	from := func(src string) func() (net.Conn, error) {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: 5 * time.Second}
		return func() (net.Conn, error) { return d.Dial("tcp", ln.Addr().String()) }
	}
	var silent []net.Conn
	defer func() {
		for _, c := range silent {
			c.Close()
		}
	}()
	for range maxLinkConns {
		c, err := from("127.0.0.3")()
		if err != nil {
			t.Fatal(err)
		}
		silent = append(silent, c)
	}
	// The listener takes connections in order: once this one is closed,
	// all the silent ones before it hold their slots.
	extra, err := from("127.0.0.3")()
	if err != nil {
		t.Fatal(err)
	}
	defer extra.Close()
	_ = extra.SetReadDeadline(time.Now().Add(linkHandshake / 2))
	if _, err := extra.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a connection past its address's slots was kept (%v)", err)
	}

	token := make([]byte, TokenSize)
	rand.Read(token)
	w, err := l.Want(token, 2)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := DialLink(from("127.0.0.2"), token, 2); err != nil {
		t.Fatal(err)
	}
	if cs, err := w.Wait(linkHandshake/2, nil); err != nil || len(cs) != 2 {
		t.Fatalf("a peer's link beside a silent host: %v (%d connections)", err, len(cs))
	}
}
