package vsockd

import (
	"errors"
	"strings"
	"testing"

	"github.com/shuntnet/shunt/hostd/vsockhost"
)

// TestDecode: each refusal, and a round trip of each op.
func TestDecode(t *testing.T) {
	bad := map[string]string{
		"not json":       `{"op":`,
		"unknown field":  `{"op":"list","extra":1}`,
		"unknown op":     `{"op":"reboot"}`,
		"old version":    `{"op":"hello","version":0}`,
		"two messages":   `{"op":"list"}{"op":"list"}`,
		"device no id":   `{"op":"device","device":{"guest":"a","id":0,"socket":"/run/a","cid":3}}`,
		"relative sock":  `{"op":"device","device":{"guest":"a","id":1,"socket":"run/a","cid":3}}`,
		"unclean sock":   `{"op":"device","device":{"guest":"a","id":1,"socket":"/run/../a","cid":3}}`,
		"long sock":      `{"op":"device","device":{"guest":"a","id":1,"socket":"/` + strings.Repeat("x", 102) + `","cid":3}}`,
		"reserved cid":   `{"op":"device","device":{"guest":"a","id":1,"socket":"/run/a","cid":2}}`,
		"any cid":        `{"op":"device","device":{"guest":"a","id":1,"socket":"/run/a","cid":4294967295}}`,
		"name with \\n":  `{"op":"device","device":{"guest":"a\n","id":1,"socket":"/run/a","cid":3}}`,
		"long name":      `{"op":"device","device":{"guest":"` + strings.Repeat("a", 65) + `","id":1,"socket":"/run/a","cid":3}}`,
		"forget no id":   `{"op":"forget"}`,
		"frontend no id": `{"op":"frontend","connected":true}`,
		"stat no stat":   `{"op":"stat","id":3}`,
		"too long":       `{"op":"list","error":"` + strings.Repeat("x", MaxMsg) + `"}`,
	}
	for name, b := range bad {
		t.Run(name, func(t *testing.T) {
			if m, err := Decode([]byte(b)); !errors.Is(err, ErrProto) {
				t.Fatalf("Decode(%q) = %+v, %v: want ErrProto", b, m, err)
			}
		})
	}
	good := []Msg{
		{Op: OpHello, Version: Version, PID: 42},
		{Op: OpDevice, Device: &Device{Guest: "vm1", ID: 3, Socket: "/run/shunt/vm1.vsock", CID: 3}},
		{Op: OpDevice, ID: 3, Kept: true, Connected: true},
		{Op: OpList}, {Op: OpEnd}, {Op: OpForget, ID: 9},
		{Op: OpStat, ID: 3, Stat: &vsockhost.Stat{Guest: "vm1", CID: 3, Connected: true, RxBytes: 1 << 40}},
		{Op: OpFrontend, ID: 3, Connected: true},
		{Op: OpError, Error: "no"},
	}
	for _, m := range good {
		b, err := Encode(m)
		if err != nil {
			t.Fatal(err)
		}
		got, err := Decode(b)
		if err != nil {
			t.Fatalf("%s: %v", b, err)
		}
		b2, _ := Encode(got)
		if string(b2) != string(b) {
			t.Fatalf("round trip: %s, then %s", b, b2)
		}
	}
}

// FuzzDecode: Decode never panics, and what it accepts encodes to
// something it accepts again, the same.
func FuzzDecode(f *testing.F) {
	f.Add([]byte(`{"op":"hello","version":1}`))
	f.Add([]byte(`{"op":"device","device":{"guest":"a","id":1,"socket":"/run/a","cid":3}}`))
	f.Add([]byte(`{"op":"stat","id":3,"stat":{"guest":"a","cid":3}}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := Decode(b)
		if err != nil {
			return
		}
		e, err := Encode(m)
		if err != nil {
			return // valid but longer once re-encoded (escapes): refused on send
		}
		m2, err := Decode(e)
		if err != nil {
			t.Fatalf("%q decoded, re-encoded as %q, refused: %v", b, e, err)
		}
		if e2, _ := Encode(m2); string(e2) != string(e) {
			t.Fatalf("not stable: %q then %q", e, e2)
		}
	})
}
