package proto_test

import (
	"bytes"
	"errors"
	"net/netip"
	"testing"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/internal/proto/prototest"
)

var a, b = prototest.A, prototest.B

func samples() []proto.Msg { return prototest.Samples() }

func TestRoundTrip(t *testing.T) {
	for _, m := range samples() {
		t.Run(m.Type.String(), func(t *testing.T) {
			frame, err := m.Append(nil)
			if err != nil {
				t.Fatal(err)
			}
			got, err := proto.Decode(frame)
			if err != nil || got != m {
				t.Fatalf("Decode = %+v, %v; want %+v", got, err, m)
			}
			var w bytes.Buffer
			if err := proto.Write(&w, &m); err != nil {
				t.Fatal(err)
			}
			got, _, err = proto.Read(&w, nil)
			if err != nil || got != m {
				t.Fatalf("Read = %+v, %v; want %+v", got, err, m)
			}
		})
	}
}

// TestWireSizes pins the frame sizes: the C library encodes the same bytes.
func TestWireSizes(t *testing.T) {
	want := map[proto.Type]int{
		proto.Hello: 8, proto.Listen: 18, proto.Intent: 36, proto.Open: 41,
		proto.Ready: 4 + 4 + 4 + 8 + 4 + 8 + 8 + 1, proto.TCP: 6, proto.Close: 21, proto.Revoke: 18,
		proto.Kick: 17, proto.Ping: 8, proto.Reattach: 57, proto.RegionMsg: 12, proto.Unregion: 4,
		proto.Down: 22, proto.Left: 21, proto.Resume: 30, proto.Ended: 29,
	}
	for _, m := range samples() {
		n, ok := want[m.Type]
		if !ok {
			continue
		}
		frame, _ := m.Append(nil)
		if len(frame) != proto.HeaderSize+n {
			t.Errorf("%s: frame %d bytes, want %d", m.Type, len(frame), proto.HeaderSize+n)
		}
	}
}

func TestMalformed(t *testing.T) {
	good, _ := (&proto.Msg{Type: proto.Open, ReqID: 1, Role: proto.Active, Local: a, Remote: b}).Append(nil)
	mod := func(f func(b []byte) []byte) []byte { return f(append([]byte(nil), good...)) }
	tests := map[string][]byte{
		"short header":    good[:5],
		"old version":     mod(func(b []byte) []byte { b[0] = 1; return b }),
		"bad version":     mod(func(b []byte) []byte { b[0] = 4; return b }),
		"unknown type":    mod(func(b []byte) []byte { b[1] = 200; return b }),
		"reserved set":    mod(func(b []byte) []byte { b[2] = 1; return b }),
		"length too big":  mod(func(b []byte) []byte { b[4], b[5] = 0xff, 0xff; return b }),
		"truncated":       good[:len(good)-1],
		"trailing bytes":  append(mod(func(b []byte) []byte { b[4]++; return b }), 0),
		"bad role":        mod(func(b []byte) []byte { b[12] = 3; return b }),
		"length mismatch": mod(func(b []byte) []byte { b[4]--; return b }),
	}
	for name, frame := range tests {
		if _, err := proto.Decode(frame); !errors.Is(err, proto.ErrMalformed) {
			t.Errorf("%s: Decode = %v, want ErrMalformed", name, err)
		}
	}
}

// TestVersion2 checks that version-2 frames (an older guest library) still
// decode, with their own layouts, and that version 3's new types do not
// exist in version 2.
func TestVersion2(t *testing.T) {
	for _, m := range prototest.SamplesV2() {
		frame, err := m.Append(nil)
		if err != nil {
			t.Fatalf("%s: %v", m.Type, err)
		}
		if frame[0] != 2 {
			t.Fatalf("%s: frame version %d, want 2", m.Type, frame[0])
		}
		got, err := proto.Decode(frame)
		if err != nil || got != m {
			t.Fatalf("%s: Decode = %+v, %v; want %+v", m.Type, got, err, m)
		}
	}
	hello, _ := (&proto.Msg{Version: 2, Type: proto.Hello, PID: 1}).Append(nil)
	if len(hello) != proto.HeaderSize+4 {
		t.Fatalf("v2 HELLO is %d bytes, want %d", len(hello), proto.HeaderSize+4)
	}
	for _, typ := range []proto.Type{proto.Down, proto.Left, proto.Resume, proto.Ended} {
		if _, err := (&proto.Msg{Version: 2, Type: typ}).Append(nil); !errors.Is(err, proto.ErrMalformed) {
			t.Errorf("v2 %s encoded: %v", typ, err)
		}
		frame, _ := (&proto.Msg{Type: typ, Side: proto.SideA}).Append(nil)
		frame[0] = 2
		if _, err := proto.Decode(frame); !errors.Is(err, proto.ErrMalformed) {
			t.Errorf("v2 %s decoded: %v", typ, err)
		}
	}
	frame, _ := (&proto.Msg{Type: proto.Ping}).Append(nil)
	frame[0] = 1
	if _, err := proto.Decode(frame); !errors.Is(err, proto.ErrVersion) {
		t.Errorf("v1 frame: %v, want ErrVersion", err)
	}
}

// FuzzDecode: any bytes decode to a message that re-encodes to a frame which
// decodes to the same message, or fail with ErrMalformed.
func FuzzDecode(f *testing.F) {
	for _, m := range samples() {
		frame, _ := m.Append(nil)
		f.Add(frame)
	}
	f.Fuzz(func(t *testing.T, frame []byte) {
		m, err := proto.Decode(frame)
		if err != nil {
			if !errors.Is(err, proto.ErrMalformed) {
				t.Fatalf("error %v does not wrap ErrMalformed", err)
			}
			return
		}
		again, err := m.Append(nil)
		if err != nil {
			t.Fatalf("re-encode %+v: %v", m, err)
		}
		m2, err := proto.Decode(again)
		if err != nil || m2 != m {
			t.Fatalf("round trip: %+v, %v; want %+v", m2, err, m)
		}
	})
}

// TestAddressForms: an IPv4 address encodes to the same 16 bytes whether
// it is given as IPv4 or IPv4-mapped IPv6 (an AF_INET6 socket's name for
// an IPv4 peer), and decodes as IPv4: OPENs from an AF_INET and an
// AF_INET6 socket name one conntrack tuple. IPv6 addresses, and the two
// unspecified addresses of a LISTEN, keep their family; a zone is dropped.
func TestAddressForms(t *testing.T) {
	for _, tc := range []struct {
		name     string
		in, want string
	}{
		{"ipv4", "10.77.1.2:5201", "10.77.1.2:5201"},
		{"ipv4-mapped", "[::ffff:10.77.1.2]:5201", "10.77.1.2:5201"},
		{"ipv6", "[fd00:77:1::2]:5201", "[fd00:77:1::2]:5201"},
		{"ipv6-zone", "[fe80::1%eth0]:5201", "[fe80::1]:5201"},
		{"ipv4-any", "0.0.0.0:5201", "0.0.0.0:5201"},
		{"ipv4-any-mapped", "[::ffff:0.0.0.0]:5201", "0.0.0.0:5201"},
		{"ipv6-any", "[::]:5201", "[::]:5201"},
		{"ipv6-loopback", "[::1]:5201", "[::1]:5201"},
		{"ipv4-compatible-is-ipv6", "[::10.77.1.2]:5201", "[::a4d:102]:5201"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in, want := netip.MustParseAddrPort(tc.in), netip.MustParseAddrPort(tc.want)
			if got := proto.Unmap(in); got != want {
				t.Fatalf("Unmap(%s) = %s, want %s", in, got, want)
			}
			m := proto.Msg{Type: proto.Open, ReqID: 1, Role: proto.Passive, Local: in, Remote: want}
			frame, err := m.Append(nil)
			if err != nil {
				t.Fatal(err)
			}
			got, err := proto.Decode(frame)
			if err != nil || got.Local != want || got.Remote != want {
				t.Fatalf("decoded %s and %s (%v); want %s for both", got.Local, got.Remote, err, want)
			}
			if w, _ := (&proto.Msg{Type: proto.Open, ReqID: 1, Role: proto.Passive, Local: want, Remote: want}).Append(nil); !bytes.Equal(w, frame) {
				t.Fatalf("%s and %s encode differently:\n% x\n% x", in, want, frame, w)
			}
		})
	}
}
