package cni

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"

	"github.com/shuntnet/shunt/hostd/admin"
)

// fakeHostd answers guest-add, guest-remove and guest-list as hostd does,
// from a map: enough for the plugin's logic, with no root.
type fakeHostd struct {
	mu     sync.Mutex
	guests map[string]admin.GuestSpec
	refuse string // if set, guest-add fails with it
}

func (f *fakeHostd) handle(r admin.Request) (any, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	switch r.Cmd {
	case admin.CmdGuestAdd:
		if f.refuse != "" {
			return nil, errors.New(f.refuse)
		}
		f.guests[r.Spec.Name] = *r.Spec
		return admin.GuestReply{Name: r.Spec.Name, ID: 7, Added: true}, nil
	case admin.CmdGuestRemove:
		_, had := f.guests[r.Guest]
		delete(f.guests, r.Guest)
		return admin.GuestReply{Name: r.Guest, Removed: had}, nil
	case admin.CmdStatus:
		return map[string]int{}, nil
	case admin.CmdGuestList:
		var out []admin.GuestSpec
		for _, s := range f.guests {
			out = append(out, s)
		}
		return out, nil
	}
	return nil, fmt.Errorf("unknown %q", r.Cmd)
}

func startFake(t *testing.T) (*fakeHostd, string) {
	f := &fakeHostd{guests: map[string]admin.GuestSpec{}}
	sock := filepath.Join(t.TempDir(), "admin.sock")
	s, err := admin.Listen(sock, f.handle)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return f, sock
}

// prev is a ptp plugin's result as CNI 1.0.0 gives it: the host veth, the
// container's eth0, and one address on eth0.
const prev = `{"cniVersion":"1.0.0","interfaces":[{"name":"veth1234"},{"name":"eth0","sandbox":"/run/netns/c1"}],
 "ips":[{"address":"10.9.0.5/24","gateway":"10.9.0.1","interface":1}]}`

func conf(sock, extra string) []byte {
	return []byte(fmt.Sprintf(`{"cniVersion":"1.0.0","name":"n","type":"shunt","group":"g","admin_socket":%q%s,"prevResult":%s}`, sock, extra, prev))
}

func args(stdin []byte) *skel.CmdArgs {
	return &skel.CmdArgs{ContainerID: "abc123", Netns: "/run/netns/c1", IfName: "eth0", StdinData: stdin}
}

func peer(bridged bool) func(string, string) (string, bool, error) {
	return func(ns, ifname string) (string, bool, error) { return "veth1234", bridged, nil }
}

// captureStdout runs fn with os.Stdout going to a pipe, and returns what
// it wrote (the plugin prints its result there, as CNI says).
func captureStdout(t *testing.T, fn func() error) (string, error) {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	old := os.Stdout
	os.Stdout = w
	var buf bytes.Buffer
	done := make(chan struct{})
	go func() { io.Copy(&buf, r); close(done) }()
	ferr := fn()
	os.Stdout = old
	w.Close()
	<-done
	return buf.String(), ferr
}

func code(err error) uint {
	var e *types.Error
	if errors.As(err, &e) {
		return e.Code
	}
	return 0
}

func TestCNIAddCheckDel(t *testing.T) {
	f, sock := startFake(t)
	p := &Plugin{HostPeer: peer(false)}
	out, err := captureStdout(t, func() error { return p.Add(args(conf(sock, ""))) })
	if err != nil {
		t.Fatalf("ADD: %v", err)
	}
	// The previous result passes through unchanged.
	if !strings.Contains(out, `"10.9.0.5/24"`) || !strings.Contains(out, `"veth1234"`) {
		t.Errorf("ADD printed %s, want the previous result", out)
	}
	g, ok := f.guests["cni-abc123"]
	if !ok {
		t.Fatalf("hostd has %v, want guest cni-abc123", f.guests)
	}
	want := admin.GuestSpec{Name: "cni-abc123", Group: "g", Netns: "/run/netns/c1", Interface: "veth1234", Addresses: []string{"10.9.0.5"}, Container: "abc123"}
	if fmt.Sprint(g) != fmt.Sprint(want) {
		t.Errorf("spec %+v, want %+v", g, want)
	}
	if err := p.Check(args(conf(sock, ""))); err != nil {
		t.Errorf("CHECK after ADD: %v", err)
	}
	if err := p.Del(args(conf(sock, ""))); err != nil {
		t.Fatalf("DEL: %v", err)
	}
	if len(f.guests) != 0 {
		t.Errorf("after DEL hostd still has %v", f.guests)
	}
	if err := p.Del(args(conf(sock, ""))); err != nil {
		t.Errorf("a repeated DEL: %v, want success", err)
	}
	if err := p.Check(args(conf(sock, ""))); code(err) != types.ErrUnknownContainer {
		t.Errorf("CHECK after DEL: %v, want code %d", err, types.ErrUnknownContainer)
	}
}

// A bridge port is no interface to mark by: the guest gets none.
func TestCNIBridgedHasNoInterface(t *testing.T) {
	f, sock := startFake(t)
	p := &Plugin{HostPeer: peer(true)}
	if _, err := captureStdout(t, func() error { return p.Add(args(conf(sock, ""))) }); err != nil {
		t.Fatal(err)
	}
	if g := f.guests["cni-abc123"]; g.Interface != "" {
		t.Errorf("bridged: interface %q, want none", g.Interface)
	}
	p = &Plugin{HostPeer: func(string, string) (string, bool, error) {
		t.Error("interface none looked for a peer")
		return "", false, nil
	}}
	if err := p.Del(args(conf(sock, ""))); err != nil {
		t.Fatal(err)
	}
	if _, err := captureStdout(t, func() error { return p.Add(args(conf(sock, `,"interface":"none"`))) }); err != nil {
		t.Fatal(err)
	}
}

func TestCNIErrors(t *testing.T) {
	f, sock := startFake(t)
	p := &Plugin{HostPeer: peer(false)}
	gone := filepath.Join(t.TempDir(), "nobody.sock")
	noPrev := []byte(fmt.Sprintf(`{"cniVersion":"1.0.0","name":"n","type":"shunt","admin_socket":%q}`, sock))
	for _, c := range []struct {
		name string
		run  func() error
		code uint
	}{
		{"no prevResult", func() error { return p.Add(args(noPrev)) }, types.ErrInvalidNetworkConfig},
		{"bad JSON", func() error { return p.Add(args([]byte("{"))) }, types.ErrDecodingFailure},
		{"bad interface", func() error { return p.Add(args(conf(sock, `,"interface":"eth9"`))) }, types.ErrInvalidNetworkConfig},
		{"hostd down at ADD", func() error { return p.Add(args(conf(gone, ""))) }, types.ErrTryAgainLater},
		{"no netns", func() error { a := args(conf(sock, "")); a.Netns = ""; return p.Add(a) }, types.ErrInvalidNetNS},
		{"bad container id", func() error { a := args(conf(sock, "")); a.ContainerID = "a/b"; return p.Add(a) }, types.ErrInvalidEnvironmentVariables},
		{"no address on the interface", func() error { a := args(conf(sock, "")); a.IfName = "eth1"; return p.Add(a) }, types.ErrInvalidNetworkConfig},
		{"hostd refuses", func() error { f.refuse = "no"; defer func() { f.refuse = "" }(); return p.Add(args(conf(sock, ""))) }, ErrRefused},
	} {
		_, err := captureStdout(t, c.run)
		if code(err) != c.code {
			t.Errorf("%s: %v (code %d), want code %d", c.name, err, code(err), c.code)
		}
	}
	if err := p.Status(args(conf(sock, ""))); err != nil {
		t.Errorf("STATUS with hostd up: %v", err)
	}
	if err := p.Status(args(conf(gone, ""))); code(err) != ErrUnavailable {
		t.Errorf("STATUS with hostd down: %v, want code %d", err, ErrUnavailable)
	}
	// DEL with hostd down succeeds: hostd drops the guest itself once
	// its namespace is gone.
	if err := p.Del(args(conf(gone, ""))); err != nil {
		t.Errorf("DEL with hostd down: %v, want success", err)
	}
}

func TestCNIGuestName(t *testing.T) {
	long := strings.Repeat("f", 64)
	n, err := GuestName(long)
	if err != nil || len(n) > 64 || !strings.HasPrefix(n, "cni-ffff") {
		t.Errorf("GuestName(64 hex) = %q, %v: want cni-... of at most 64 bytes", n, err)
	}
	if _, err := GuestName(""); err == nil {
		t.Error("an empty container id was taken")
	}
}
