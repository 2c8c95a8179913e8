//go:build linux

package vhostuser

import (
	"encoding/binary"
	"io"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// nopBackend is a device of two queues that takes no buffers.
type nopBackend struct {
	sync.Mutex
	kicks int
}

func (b *nopBackend) Features() uint64  { return 0 }
func (b *nopBackend) Config() []byte    { return []byte{1, 2, 3, 4, 5, 6, 7, 8} }
func (b *nopBackend) Queues() int       { return 2 }
func (b *nopBackend) Attach(*Session)   {}
func (b *nopBackend) Kick(int)          { b.kicks++ }
func (b *nopBackend) Detach(s *Session) {}

// pair starts Serve on one end of a socketpair and returns the other.
func pair(t testing.TB) (*net.UnixConn, chan error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	bf, ff := os.NewFile(uintptr(fds[0]), "be"), os.NewFile(uintptr(fds[1]), "fe")
	be, _ := net.FileConn(bf)
	fe, _ := net.FileConn(ff)
	bf.Close()
	ff.Close()
	done := make(chan error, 1)
	go func() { done <- Serve(be.(*net.UnixConn), &nopBackend{}, func(string, ...any) {}) }()
	return fe.(*net.UnixConn), done
}

func message(req, flags uint32, payload []byte) []byte {
	b := make([]byte, headerSize, headerSize+len(payload))
	binary.LittleEndian.PutUint32(b, req)
	binary.LittleEndian.PutUint32(b[4:], flags)
	binary.LittleEndian.PutUint32(b[8:], uint32(len(payload)))
	return append(b, payload...)
}

func readReply(t *testing.T, c *net.UnixConn) []byte {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	h := make([]byte, headerSize)
	if _, err := io.ReadFull(c, h); err != nil {
		t.Fatalf("no reply: %v", err)
	}
	p := make([]byte, binary.LittleEndian.Uint32(h[8:]))
	if _, err := io.ReadFull(c, p); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestRefusals: requests that break the protocol are refused with a
// failed ack (REPLY_ACK), and the session goes on.
func TestRefusals(t *testing.T) {
	c, done := pair(t)
	defer c.Close()
	c.Write(message(reqSetProtocolFeatures, flagVersion, u64(ProtocolReplyAck|ProtocolConfig)))
	state := func(i, n uint32) []byte {
		b := make([]byte, 8)
		binary.LittleEndian.PutUint32(b, i)
		binary.LittleEndian.PutUint32(b[4:], n)
		return b
	}
	for name, m := range map[string][]byte{
		"unknown request":           message(99, flagVersion|flagNeedReply, nil),
		"vring index beyond device": message(reqSetVringNum, flagVersion|flagNeedReply, state(7, 64)),
		"vring size not a power":    message(reqSetVringNum, flagVersion|flagNeedReply, state(0, 100)),
		"vring size too big":        message(reqSetVringNum, flagVersion|flagNeedReply, state(0, 65536)),
		"features not offered":      message(reqSetFeatures, flagVersion|flagNeedReply, u64(1<<40)),
		"kick without fd":           message(reqSetVringKick, flagVersion|flagNeedReply, u64(0)),
		"mem table without fds":     message(reqSetMemTable, flagVersion|flagNeedReply, append(binary.LittleEndian.AppendUint32(nil, 1), make([]byte, 36)...)),
		"short payload":             message(reqSetVringBase, flagVersion|flagNeedReply, []byte{1}),
	} {
		c.Write(m)
		if ack := binary.LittleEndian.Uint64(readReply(t, c)); ack == 0 {
			t.Errorf("%s: accepted", name)
		}
	}
	c.Write(message(reqGetFeatures, flagVersion, nil))
	if f := binary.LittleEndian.Uint64(readReply(t, c)); f&FeatureVersion1 == 0 {
		t.Fatalf("features %#x after the refusals", f)
	}
	// GET_CONFIG beyond the config space is fatal: QEMU waits for an
	// answer this back-end cannot give.
	bad := make([]byte, 12+8)
	binary.LittleEndian.PutUint32(bad, 300)
	binary.LittleEndian.PutUint32(bad[4:], 8)
	c.Write(message(reqGetConfig, flagVersion, bad))
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("Serve ended without an error")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Serve did not end")
	}
}

// TestBadHeader: a header with another version or an oversized payload
// ends the session.
func TestBadHeader(t *testing.T) {
	for _, m := range [][]byte{message(1, 2, nil), message(1, flagVersion, make([]byte, maxPayload+1))} {
		c, done := pair(t)
		c.Write(m)
		select {
		case err := <-done:
			if err == nil {
				t.Fatalf("header %x: Serve ended without an error", m[:12])
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("header %x: Serve did not end", m[:12])
		}
		c.Close()
	}
}

// FuzzServe: any byte stream from the front-end ends in replies, refusals
// or the session's end, never a panic or a hang once the front-end closes.
func FuzzServe(f *testing.F) {
	f.Add(message(reqGetFeatures, flagVersion, nil))
	f.Add(append(message(reqSetVringNum, flagVersion, make([]byte, 8)), message(reqGetVringBase, flagVersion, make([]byte, 8))...))
	f.Add(message(reqGetConfig, flagVersion, make([]byte, 20)))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, done := pair(t)
		go io.Copy(io.Discard, c)
		c.Write(data)
		c.CloseWrite()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatal("Serve did not end 10 s after the front-end closed")
		}
		c.Close()
	})
}
