package cdi

import (
	"os"
	"strings"
	"testing"
)

// shunt.json, which the shunt-host package installs as /etc/cdi/shunt.json,
// is what Make writes for the packages' paths (regenerate it with
// hostd cdi, or by copying what this test prints).
func TestCDIShippedSpec(t *testing.T) {
	s, err := Make(DefaultSocket, DefaultLibrary)
	if err != nil {
		t.Fatal(err)
	}
	want, err := s.JSON()
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile("shunt.json")
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != string(want) {
		t.Errorf("shunt.json is not what Make writes; want:\n%s", want)
	}
}

func TestCDIEdits(t *testing.T) {
	s, err := Make("/run/x/shunt/control.sock", "/opt/lib/libshunt-preload.so")
	if err != nil {
		t.Fatal(err)
	}
	if s.Kind != Kind || len(s.Devices) != 2 {
		t.Fatalf("spec %+v", s)
	}
	def, sock := s.Devices[0], s.Devices[1]
	env := strings.Join(def.ContainerEdits.Env, " ")
	if !strings.Contains(env, "SHUNT_CONTROL=/run/x/shunt/control.sock") || !strings.Contains(env, "LD_PRELOAD=/usr/lib/shunt/libshunt-preload.so") {
		t.Errorf("default device env %q", env)
	}
	// The directory is mounted, not the socket: a restarted hostd's new
	// socket must be seen.
	if m := def.ContainerEdits.Mounts[0]; m.HostPath != "/run/x/shunt" || m.ContainerPath != "/run/x/shunt" {
		t.Errorf("socket mount %+v", m)
	}
	if m := def.ContainerEdits.Mounts[1]; m.HostPath != "/opt/lib/libshunt-preload.so" || m.Options[0] != "ro" {
		t.Errorf("library mount %+v", m)
	}
	if strings.Contains(strings.Join(sock.ContainerEdits.Env, " "), "LD_PRELOAD") || len(sock.ContainerEdits.Mounts) != 1 {
		t.Errorf("socket device %+v: want the socket only", sock)
	}
	// A socket whose directory holds hostd's admin socket is refused: the
	// directory is mounted into containers whole.
	for _, bad := range []string{"/run/shunt/control.sock", "/run/c.sock", "relative.sock"} {
		if _, err := Make(bad, DefaultLibrary); err == nil {
			t.Errorf("Make(%q) was taken", bad)
		}
	}
}
