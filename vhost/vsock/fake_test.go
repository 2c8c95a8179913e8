//go:build linux

package vsock_test

import (
	"encoding/binary"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/internal/sys"
	"github.com/shuntnet/shunt/vhost/vhostuser"
	"github.com/shuntnet/shunt/vhost/vsock"
)

// A fake QEMU and guest driver: the front-end's vhost-user messages on a
// socketpair, and a Linux-like virtio-vsock driver over a memfd that
// stands for guest memory (guest address gpa, front-end address va).
const (
	gpa      = 0x4000_0000
	va       = 0x7f00_0000_0000
	memSize  = 1 << 20
	qn       = 64      // queue size
	rxAt     = 0x0000  // rx desc, avail +0x400, used +0x800
	txAt     = 0x1000  // tx likewise
	rxBufAt  = 0x10000 // qn rx buffers of rxBufLen
	rxBufLen = 0x2000
	txBufAt  = 0x90000 // qn tx buffers of txBufLen
	txBufLen = 0x1000 + vsock.HdrSize
	guestCID = 5
)

type fake struct {
	t    testing.TB
	dev  *vsock.Device
	fe   *net.UnixConn
	mem  []byte
	kick [2]*os.File
	call [2]*os.File
	errs [2]*os.File
	done chan struct{} // closed when Serve returned
	// driver state
	txNext   uint16 // tx avail idx
	rxSeen   uint16 // rx used entries consumed
	rxPosted uint16
}

func newFake(t testing.TB) *fake {
	dev, err := vsock.New(guestCID, t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	return attach(t, dev)
}

func attach(t testing.TB, dev *vsock.Device) *fake {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	bf, ff := os.NewFile(uintptr(fds[0]), "be"), os.NewFile(uintptr(fds[1]), "fe")
	be, _ := net.FileConn(bf) // dups the fd
	fe, _ := net.FileConn(ff)
	bf.Close()
	ff.Close()
	f := &fake{t: t, dev: dev, fe: fe.(*net.UnixConn), done: make(chan struct{})}
	go func() { vhostuser.Serve(be.(*net.UnixConn), dev, t.Logf); close(f.done) }()
	t.Cleanup(func() {
		f.fe.Close()
		select {
		case <-f.done:
		case <-time.After(5 * time.Second):
			t.Error("Serve did not return 5 s after the front-end closed")
		}
	})
	mf, err := sys.Memfd("guest", memSize)
	if err != nil {
		t.Fatal(err)
	}
	defer mf.Close()
	if f.mem, err = sys.Map(mf, memSize); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sys.Unmap(f.mem) })

	feats := f.u64(f.req(1, nil, nil)) // GET_FEATURES
	if feats&vhostuser.FeatureVersion1 == 0 || feats&vhostuser.FeatureProtocolFeatures == 0 {
		t.Fatalf("features %#x", feats)
	}
	f.send(2, le64(vhostuser.FeatureVersion1|vhostuser.FeatureProtocolFeatures|vhostuser.FeatureIndirectDesc), nil, false)
	f.u64(f.req(15, nil, nil))
	f.send(16, le64(vhostuser.ProtocolReplyAck|vhostuser.ProtocolConfig), nil, false)
	getcfg := make([]byte, 12+8)
	binary.LittleEndian.PutUint32(getcfg[4:], 8) // offset 0, size 8
	cfg := f.req(24, getcfg, nil)
	if cid := binary.LittleEndian.Uint64(cfg[12:]); cid != guestCID {
		t.Fatalf("GET_CONFIG gave CID %d", cid)
	}
	f.send(3, nil, nil, true) // SET_OWNER
	table := make([]byte, 8+32)
	binary.LittleEndian.PutUint32(table, 1)
	binary.LittleEndian.PutUint64(table[8:], gpa)
	binary.LittleEndian.PutUint64(table[16:], memSize)
	binary.LittleEndian.PutUint64(table[24:], va)
	f.send(5, table, []int{int(mf.Fd())}, true)
	for q, at := range []uint64{rxAt, txAt} {
		f.send(8, state(q, qn), nil, true)
		f.send(10, state(q, 0), nil, true)
		addr := make([]byte, 40)
		binary.LittleEndian.PutUint32(addr, uint32(q))
		binary.LittleEndian.PutUint64(addr[8:], va+at)
		binary.LittleEndian.PutUint64(addr[16:], va+at+0x800)
		binary.LittleEndian.PutUint64(addr[24:], va+at+0x400)
		f.send(9, addr, nil, true)
		for i, req := range []uint32{13, 14, 12} { // CALL, ERR, KICK
			efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
			if err != nil {
				t.Fatal(err)
			}
			e := os.NewFile(uintptr(efd), "eventfd")
			t.Cleanup(func() { e.Close() })
			[]*[2]*os.File{&f.call, &f.errs, &f.kick}[i][q] = e
			f.send(req, le64(uint64(q)), []int{efd}, true)
		}
	}
	for i := 0; i < qn; i++ {
		f.desc(rxAt, i, gpa+rxBufAt+uint64(i)*rxBufLen, rxBufLen, 2, 0)
		f.postRx(uint16(i))
	}
	f.send(18, state(0, 1), nil, true) // enable rx, tx
	f.send(18, state(1, 1), nil, true)
	return f
}

func le64(v uint64) []byte { return binary.LittleEndian.AppendUint64(nil, v) }

func state(i, n int) []byte {
	b := make([]byte, 8)
	binary.LittleEndian.PutUint32(b, uint32(i))
	binary.LittleEndian.PutUint32(b[4:], uint32(n))
	return b
}

func (f *fake) u64(b []byte) uint64 {
	if len(b) != 8 {
		f.t.Fatalf("reply of %d bytes", len(b))
	}
	return binary.LittleEndian.Uint64(b)
}

// send sends a request; with ack it sets need_reply and wants success.
func (f *fake) send(req uint32, payload []byte, fds []int, ack bool) {
	f.t.Helper()
	flags := uint32(1)
	if ack {
		flags |= 8
	}
	f.write(req, flags, payload, fds)
	if ack {
		if r := f.reply(req); binary.LittleEndian.Uint64(r) != 0 {
			f.t.Fatalf("request %d refused", req)
		}
	}
}

func (f *fake) write(req, flags uint32, payload []byte, fds []int) {
	b := make([]byte, 12, 12+len(payload))
	binary.LittleEndian.PutUint32(b, req)
	binary.LittleEndian.PutUint32(b[4:], flags)
	binary.LittleEndian.PutUint32(b[8:], uint32(len(payload)))
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	if _, _, err := f.fe.WriteMsgUnix(append(b, payload...), oob, nil); err != nil {
		f.t.Fatal(err)
	}
}

func (f *fake) req(req uint32, payload []byte, fds []int) []byte {
	f.t.Helper()
	f.write(req, 1, payload, fds)
	return f.reply(req)
}

func (f *fake) reply(req uint32) []byte {
	f.t.Helper()
	_ = f.fe.SetReadDeadline(time.Now().Add(5 * time.Second))
	h := make([]byte, 12)
	if _, err := io.ReadFull(f.fe, h); err != nil {
		f.t.Fatalf("reply to %d: %v", req, err)
	}
	if r := binary.LittleEndian.Uint32(h); r != req || binary.LittleEndian.Uint32(h[4:]) != 5 {
		f.t.Fatalf("reply header %x to %d", h, req)
	}
	p := make([]byte, binary.LittleEndian.Uint32(h[8:]))
	if _, err := io.ReadFull(f.fe, p); err != nil {
		f.t.Fatal(err)
	}
	return p
}

func (f *fake) desc(q, i int, addr uint64, n uint32, flags, next uint16) {
	b := f.mem[q+16*i:]
	binary.LittleEndian.PutUint64(b, addr)
	binary.LittleEndian.PutUint32(b[8:], n)
	binary.LittleEndian.PutUint16(b[12:], flags)
	binary.LittleEndian.PutUint16(b[14:], next)
}

func (f *fake) offer(q int, head uint16) {
	avail := f.mem[q+0x400:]
	idx := binary.LittleEndian.Uint16(avail[2:])
	binary.LittleEndian.PutUint16(avail[4+2*int(idx%qn):], head)
	binary.LittleEndian.PutUint16(avail[2:], idx+1)
}

func (f *fake) kickQ(q int) { f.kick[q].Write(le64(1)) }

func (f *fake) postRx(head uint16) { f.offer(rxAt, head); f.rxPosted++ }

func (f *fake) used(q int) uint16 { return binary.LittleEndian.Uint16(f.mem[q+0x800+2:]) }

// sendRaw puts a tx packet of raw bytes in the next tx buffer and kicks.
func (f *fake) sendRaw(pkt []byte) {
	f.t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for f.txNext-f.used(txAt) >= qn {
		if time.Now().After(deadline) {
			f.t.Fatalf("the device took no tx buffer in 5 s")
		}
		time.Sleep(time.Millisecond)
	}
	slot := int(f.txNext % qn)
	at := txBufAt + slot*txBufLen
	copy(f.mem[at:at+txBufLen], pkt)
	f.desc(txAt, slot, gpa+uint64(at), uint32(len(pkt)), 0, 0)
	f.offer(txAt, uint16(slot))
	f.txNext++
	f.kickQ(1)
}

func (f *fake) sendPkt(h vsock.Hdr, payload []byte) {
	f.t.Helper()
	b := make([]byte, vsock.HdrSize+len(payload))
	h.Len = uint32(len(payload))
	h.Put(b)
	copy(b[vsock.HdrSize:], payload)
	f.sendRaw(b)
}

// recv waits for the next rx packet and gives its buffer back.
func (f *fake) recv(d time.Duration) (vsock.Hdr, []byte, bool) {
	deadline := time.Now().Add(d)
	for f.used(rxAt) == f.rxSeen {
		if time.Now().After(deadline) {
			return vsock.Hdr{}, nil, false
		}
		time.Sleep(200 * time.Microsecond)
	}
	e := f.mem[rxAt+0x800+4+8*int(f.rxSeen%qn):]
	id, n := binary.LittleEndian.Uint32(e), binary.LittleEndian.Uint32(e[4:])
	f.rxSeen++
	if id >= qn || n < vsock.HdrSize || n > rxBufLen {
		f.t.Fatalf("used rx element id %d len %d", id, n)
	}
	buf := f.mem[rxBufAt+int(id)*rxBufLen:]
	h, _ := vsock.ParseHdr(buf)
	if int(h.Len) != int(n)-vsock.HdrSize {
		f.t.Fatalf("rx packet %v in a used length of %d", h, n)
	}
	p := append([]byte(nil), buf[vsock.HdrSize:n]...)
	f.postRx(uint16(id))
	f.kickQ(0)
	return h, p, true
}

// expect waits for a packet with op, passing over credit updates.
func (f *fake) expect(op uint16) (vsock.Hdr, []byte) {
	f.t.Helper()
	h, p, ok := f.recv(5 * time.Second)
	for ok && h.Op == vsock.OpCreditUpdate && op != vsock.OpCreditUpdate {
		h, p, ok = f.recv(5 * time.Second)
	}
	if !ok {
		f.t.Fatalf("no packet in 5 s, want op %d", op)
	}
	if h.Op != op {
		f.t.Fatalf("packet %v, want op %d", h, op)
	}
	return h, p
}

func hdr(op uint16, guestPort, hostPort uint32) vsock.Hdr {
	return vsock.Hdr{SrcCID: guestCID, DstCID: vsock.HostCID, SrcPort: guestPort, DstPort: hostPort, Type: vsock.TypeStream, Op: op, BufAlloc: 64 << 10}
}

// connected returns the host's end of a guest connection from guestPort
// to a listener on hostPort.
func (f *fake) connected(guestPort, hostPort uint32) net.Conn {
	f.t.Helper()
	l, err := f.dev.Listen(hostPort)
	if err != nil {
		f.t.Fatal(err)
	}
	defer l.Close()
	f.sendPkt(hdr(vsock.OpRequest, guestPort, hostPort), nil)
	f.expect(vsock.OpResponse)
	c, err := l.Accept()
	if err != nil {
		f.t.Fatal(err)
	}
	return c
}
