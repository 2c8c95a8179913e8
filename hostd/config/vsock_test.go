package config_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/shuntnet/shunt/hostd/config"
)

const vsockBase = `
trust_group "t" {}
guest "vm1" {
  id        = 1
  group     = "t"
  control   = "/run/shunt/vm1.sock"
  addresses = ["10.77.1.2"]
  vsock {
    socket = "/run/shunt/vm1.vsock"
    cid    = 3
  }
}
`

func TestVsock(t *testing.T) {
	c, err := config.Parse("hostd.hcl", []byte(vsockBase))
	if err != nil {
		t.Fatal(err)
	}
	if v := c.Guests[0].Vsock; v == nil || v.Socket != "/run/shunt/vm1.vsock" || v.CID != 3 {
		t.Fatalf("vsock: %+v", v)
	}
	second := func(body string) string {
		return vsockBase + "guest \"vm2\" {\n id = 2\n group = \"t\"\n control = \"/run/shunt/vm2.sock\"\n addresses = [\"10.77.2.2\"]\n" + body + "}\n"
	}
	for _, tc := range []struct{ src, want string }{
		{second("vsock {\n socket = \"/run/shunt/vm2.vsock\"\n cid = 3\n}\n"), "cid 3 is already guest \"vm1\"'s"},
		{second("vsock {\n socket = \"/run/shunt/vm1.vsock\"\n cid = 4\n}\n"), "is already guest \"vm1\"'s"},
		{second("vsock {\n socket = \"/run/shunt/vm1.sock\"\n cid = 4\n}\n"), "guest \"vm1\"'s control socket"},
		{second("vsock {\n socket = \"/run/shunt/vm2.sock\"\n cid = 4\n}\n"), "the guest's control socket"},
		{second("vsock {\n socket = \"vm2.vsock\"\n cid = 4\n}\n"), "want an absolute path"},
		{second("vsock {\n socket = \"/run/shunt/vm2.vsock\"\n cid = 2\n}\n"), "cid 2: want 3"},
		{second("vsock {\n socket = \"/run/shunt/vm2.vsock\"\n cid = 4294967295\n}\n"), "want 3"},
		{second("netns = \"/run/netns/x\"\nvsock {\n socket = \"/run/shunt/vm2.vsock\"\n cid = 4\n}\n"), "process guest"},
		{second("vsock {\n cid = 4\n}\n"), "socket"},
	} {
		if _, err := config.Parse("hostd.hcl", []byte(tc.src)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("want an error with %q, got %v", tc.want, err)
		}
	}
	if _, err := config.Parse("hostd.hcl", []byte(second("vsock {\n socket = \"/run/shunt/vm2.vsock\"\n cid = 4\n}\n"))); err != nil {
		t.Fatal(err)
	}
}

// TestVsockHybrid: a hybrid vsock block (Firecracker, Cloud Hypervisor)
// and a vsock VM without a control socket (its control channel on vsock);
// a guest with neither is refused.
func TestVsockHybrid(t *testing.T) {
	guest := func(name, body string) string {
		return fmt.Sprintf("guest %q {\n id = %d\n group = \"t\"\n addresses = [\"10.77.9.%d\"]\n%s}\n", name, len(name), len(name), body)
	}
	src := vsockBase + guest("fc-vm", "vsock {\n hybrid = \"/run/fc/vm.vsock\"\n}\n") + guest("q-vm-2", "vsock {\n socket = \"/run/shunt/q.vsock\"\n cid = 9\n}\n")
	c, err := config.Parse("hostd.hcl", []byte(src))
	if err != nil {
		t.Fatal(err)
	}
	if g := c.Guests[1]; g.Control != "" || g.Vsock == nil || g.Vsock.Hybrid != "/run/fc/vm.vsock" || g.Vsock.Socket != "" {
		t.Fatalf("hybrid guest: %+v %+v", g, g.Vsock)
	}
	if g := c.Guests[2]; g.Control != "" || g.Vsock == nil || g.Vsock.Socket != "/run/shunt/q.vsock" {
		t.Fatalf("vsock guest without control: %+v %+v", g, g.Vsock)
	}
	for _, tc := range []struct{ src, want string }{
		{guest("nothing", ""), "control: want the guest's control socket"},
		{guest("both-ways", "vsock {\n hybrid = \"/run/fc/x.vsock\"\n cid = 4\n}\n"), "give hybrid alone"},
		{guest("relative", "vsock {\n hybrid = \"x.vsock\"\n}\n"), "want an absolute path"},
		{guest("taken", "vsock {\n hybrid = \"/run/shunt/vm1.vsock\"\n}\n"), "already guest \"vm1\"'s"},
		{guest("taken2", "vsock {\n hybrid = \"/run/shunt/vm1.sock\"\n}\n"), "already guest \"vm1\"'s"},
	} {
		if _, err := config.Parse("hostd.hcl", []byte(vsockBase+tc.src)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: want an error with %q, got %v", tc.src, tc.want, err)
		}
	}
}

// TestVsockdSocket: vsockd_socket is an absolute path of its own, and
// with it each device socket leaves room for shunt-vsockd's forwards.
func TestVsockdSocket(t *testing.T) {
	for _, tc := range []struct{ line, want string }{ // want "" = accepted
		{`vsockd_socket = "/run/shunt/vsockd.sock"`, ""},
		{`vsockd_socket = "vsockd.sock"`, "clean absolute path"},
		{`vsockd_socket = "/run/shunt/vm1.vsock"`, "guest \"vm1\"'s socket"},
		{`vsockd_socket = "/run/shunt/vm1.sock"`, "guest \"vm1\"'s socket"},
	} {
		c, err := config.Parse("hostd.hcl", []byte(tc.line+"\n"+vsockBase))
		switch {
		case tc.want == "" && (err != nil || c.VsockdSocket != "/run/shunt/vsockd.sock"):
			t.Errorf("%s: %v", tc.line, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%s: %v, want an error saying %q", tc.line, err, tc.want)
		}
	}
	long := strings.Replace(vsockBase, "/run/shunt/vm1.vsock", "/run/shunt/"+strings.Repeat("v", 92), 1)
	if _, err := config.Parse("hostd.hcl", []byte(long)); err != nil {
		t.Fatalf("a 103-byte socket without vsockd_socket: %v", err)
	}
	if _, err := config.Parse("hostd.hcl", []byte("vsockd_socket = \"/run/shunt/vsockd.sock\"\n"+long)); err == nil || !strings.Contains(err.Error(), "at most 102 bytes") {
		t.Fatalf("a 103-byte socket with vsockd_socket: %v", err)
	}
}
